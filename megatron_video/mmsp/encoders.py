"""A small per-frame ViT from Megatron-Core pieces, a vision encoder for ``MMSPLLaVAModel``.

Megatron's ``CLIPViTModel`` cannot be built on a machine without TransformerEngine and CUDA (its
default norm is ``torch.nn.LayerNorm`` called with ``config=``, and it moves its position ids with
``.cuda()``); ``FrameViT`` is the same architecture at toy scale: patch embedding, a class token,
learned positions, a Megatron ``TransformerBlock`` (any layer spec, e.g. the local ViT spec with
``no_mask``), final norm. It encodes every frame independently -- what MM-SP's stage 1 needs.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock

__all__ = ["FrameViT"]


class FrameViT(MegatronModule):
    """``[n, channels, img_h, img_w] -> [n, class_token_len + patches, hidden]``."""

    def __init__(
        self,
        config,
        layer_spec,
        img_h: int,
        img_w: int,
        patch_dim: int,
        channels: int = 3,
        class_token_len: int = 1,
    ):
        super().__init__(config=config)
        for name, v in (("img_h", img_h), ("img_w", img_w)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v % patch_dim:
                raise ValueError(
                    f"{name} ({v!r}) must be a positive multiple of patch_dim ({patch_dim})"
                )
        self.patch_dim, self.class_token_len = patch_dim, class_token_len
        self.add_class_token = class_token_len > 0
        h = config.hidden_size
        patches = (img_h // patch_dim) * (img_w // patch_dim)
        self.conv1 = torch.nn.Conv2d(
            channels, h, kernel_size=patch_dim, stride=patch_dim, bias=False
        )
        self.class_token = torch.nn.Parameter(torch.randn(1, class_token_len, h) * 0.02)
        self.position_embeddings = torch.nn.Embedding(patches + class_token_len, h)
        self.decoder = TransformerBlock(
            config=config, spec=layer_spec, pre_process=True, post_process=True
        )

    def set_input_tensor(self, input_tensor):
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x.to(self.conv1.weight.dtype)).flatten(2).transpose(1, 2)  # [n, patches, h]
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        # the positions by lookup, not ``weight[None]``: that view's gradient would be the sum's
        # incoming gradient itself, of which (one frame) the class token's is a slice, so the two
        # ``.grad`` would share a buffer and plain autograd accumulation would count it twice
        pos = self.position_embeddings(
            torch.arange(self.position_embeddings.num_embeddings, device=x.device)
        )
        x = x + pos[None]
        x = self.decoder(x.transpose(0, 1).contiguous(), attention_mask=None)  # [s, n, h]
        return x.transpose(0, 1).contiguous()
