"""The Wan 2.1 / 2.2 transformer (diffusers' ``WanTransformer3DModel``) as Megatron layers.

``WanConfig`` (``config``) is Megatron's ``TransformerConfig`` plus diffusers' Wan config fields.
``WanModel`` is a ``MegatronModule``: patch embedding (the (pt, ph, pw) Conv3d as a linear over
patch tokens), the condition embedder (``embedders``: sinusoid + ``time_embedder`` + shared
``time_proj`` to 6 D, GELU-tanh text projection, the I2V image embedder), a
``VideoTransformerBlock`` of ``WanLayer``s (``layer``) from a ``ModuleSpec`` (``wan_layer_specs``),
the output norm with its 2-row table and ``proj_out``. Tokens are split contiguously over the CP
group (rank ``c`` holds ``[c*s, (c+1)*s)``); the self-attention core is the 2D attention,
cross-attention has no CP. Precision: where diffusers computes in fp32 (modulation, norms, residual
stream, output norm, timestep embedding) this computes in max(fp32, dtype) (``island_dtype``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.geometry import VideoGeometry
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.models.dit_layer import DiTParams, VideoTransformerBlock
from megatron_video.models.embedders import mark_pipeline_replicated
from megatron_video.models.packed import check_packed, packed_attention_mask, per_clip_to_tokens
from megatron_video.models.wan.config import WanConfig
from megatron_video.models.wan.embedders import WanConditionEmbedder, WanOutputHead, wan_linear
from megatron_video.models.wan.rope import WanRope

__all__ = [
    "WanModel",
]


class WanModel(MegatronModule):
    """diffusers' ``WanTransformer3DModel`` on Megatron; see the module docstring.

    ``forward(tokens, timestep, text, geometry, image=None, attention_mask=None,
    positions=None)``: ``tokens [b, s_local, C*pt*ph*pw]`` this CP rank's patch tokens
    (``embedders.patchify`` order; first stage), ``timestep [b]`` or per token ``[b, s_local]``,
    ``text [b, L, text_dim]``, ``image [b, L_img, image_dim]`` (I2V), ``geometry`` the global
    token grid; ``positions [s_local]`` the tokens' ids in ``geometry`` for RoPE (default: the
    contiguous CP split; the teacher-forcing layout passes its own, both halves sharing them) and
    ``attention_mask`` the 2D attention's mask (teacher forcing). Returns
    ``[b, s_local, pt*ph*pw*C_out]`` on the last stage (hidden states ``[s_local, b, D]`` on the
    others).

    A packed micro-batch (docs/architecture.md, "Packed micro-batches in the models"):
    ``geometry`` a ``PackedVideo`` (full clips: T2V; teacher-forcing clips: ``wan_ar``),
    ``tokens [1, s_local, ...]`` at the ids ``placement.rank_ids(cp_rank)`` (``placement`` None
    only at CP = 1), ``timestep [C]`` per clip or ``[1, s_local]`` per token, ``text [C, L,
    text_dim]`` per clip; ``positions`` and ``image`` must be None; ``attention_mask`` None (the
    clips' mask) or an override.
    """

    def __init__(
        self,
        config: WanConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_spec: Optional[ModuleSpec] = None,
        vp_stage: Optional[int] = None,
    ):
        if layer_spec is None:  # as GPTModel: the spec is given (models/wan/wan_layer_specs.py)
            raise ValueError(
                "layer_spec (None) must be given: a Wan layer ModuleSpec, e.g. "
                "megatron_video.models.wan.get_wan_layer_spec(config)"
            )
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.pre_process, self.post_process = pre_process, post_process
        self.rope = WanRope(config.kv_channels, config.rope_max_seq_len, config.rope_theta)
        self.condition_embedder = WanConditionEmbedder(config)
        mark_pipeline_replicated(self.condition_embedder)
        if pre_process:
            self.patch_embedding = wan_linear(config.patch_dim, config.hidden_size, config)
        spec = layer_spec
        self.decoder = VideoTransformerBlock(
            config, spec, pre_process=pre_process, post_process=False, vp_stage=vp_stage
        )
        if post_process:
            self.head = WanOutputHead(config)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def cp(self) -> Tuple[int, int]:
        """``(cp_size, cp_rank)`` of the layers (resolved by their one rule)."""
        return self.decoder.layers[0]._cp()

    def _check(self, s: int, timestep, text, geometry, positions):
        P, _ = self.cp()
        if positions is not None:
            if not isinstance(geometry, VideoGeometry) or tuple(positions.shape) != (s,):
                raise ValueError(
                    f"positions ({tuple(positions.shape)}) must be [s_local = {s}] global "
                    f"token ids of geometry ({geometry})"
                )
        elif not isinstance(geometry, VideoGeometry) or s * P != geometry.tokens:
            raise ValueError(
                f"tokens per rank ({s}) x cp_size ({P}) must equal the tokens of "
                f"geometry ({geometry})"
            )
        if timestep.dim() not in (1, 2) or (timestep.dim() == 2 and timestep.shape[1] != s):
            raise ValueError(
                f"timestep ({tuple(timestep.shape)}) must be [b] or per token [b, s_local = {s}]"
            )
        if text.dim() != 3 or text.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"text ({tuple(text.shape)}) must be [b, L, text_dim = {self.config.text_dim}]"
            )

    def forward(
        self,
        tokens: Optional[torch.Tensor],
        timestep: torch.Tensor,
        text: torch.Tensor,
        geometry: VideoGeometry,
        image: Optional[torch.Tensor] = None,
        attention_mask=None,
        positions: Optional[torch.Tensor] = None,
        placement: Optional[Placement] = None,
    ) -> torch.Tensor:
        if isinstance(geometry, PackedVideo):
            return self._forward_packed(
                tokens, timestep, text, geometry, image, attention_mask, positions, placement
            )
        if placement is not None:
            raise ValueError(
                f"placement ({placement!r}) must be None unless geometry is a PackedVideo"
            )
        s = tokens.shape[1] if self.pre_process else self.decoder.input_tensor.shape[0]
        self._check(s, timestep, text, geometry, positions)
        _, rank = self.cp()
        if positions is None:  # the contiguous CP split
            positions = torch.arange(rank * s, (rank + 1) * s)
        cos, sin = self.rope(positions, geometry)
        temb, proj, context = self.condition_embedder(timestep, text, image)
        hidden = None
        if self.pre_process:
            if tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim:
                raise ValueError(
                    f"tokens ({tuple(tokens.shape)}) must be [b, s_local, "
                    f"patch_dim = {self.config.patch_dim}]"
                )
            hidden = self.patch_embedding(tokens).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=proj,
            geometry=geometry,
            attention_mask=attention_mask,
            rotary_pos_emb=torch.stack([cos, sin]).to(text.device),
        )
        out = self.decoder(hidden, params, context=context.transpose(0, 1).contiguous())
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.head(out.transpose(0, 1), temb)

    def _check_packed(self, tokens, timestep, text, packed, image, mask, positions, placement):
        """This CP rank's global ids and their clips, after the packed input checks."""
        if image is not None or positions is not None:
            raise ValueError(
                "image and positions must be None for a packed micro-batch (geometry "
                "PackedVideo): I2V is not packed; positions come from each token's clip"
            )
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(
                f"attention_mask ({type(mask).__name__}) must be None (the clips' mask) or a "
                f"megatron_video AttentionMask for a packed micro-batch"
            )
        n = packed.num_clips
        if text.dim() != 3 or text.shape[0] != n or text.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"text ({tuple(text.shape)}) must be [num_clips = {n}, L, text_dim = "
                f"{self.config.text_dim}] for a packed micro-batch"
            )
        if self.pre_process and (tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim):
            raise ValueError(
                f"tokens ({tuple(tokens.shape)}) must be [1, s_local, patch_dim = "
                f"{self.config.patch_dim}]"
            )
        s = tokens.shape[1] if self.pre_process else self.decoder.input_tensor.shape[0]
        b = tokens.shape[0] if self.pre_process else self.decoder.input_tensor.shape[1]
        kind = packed.kinds[0] if isinstance(packed, PackedVideo) else None
        ids = check_packed(packed, kind, "WanModel", placement, self.cp(), s, b)
        if tuple(timestep.shape) not in ((n,), (1, s)):
            raise ValueError(
                f"timestep ({tuple(timestep.shape)}) must be [num_clips = {n}] per clip or "
                f"[1, s_local = {s}] per token for a packed micro-batch"
            )
        return ids, packed.clip_of(ids)

    def _forward_packed(self, tokens, timestep, text, packed, image, mask, positions, placement):
        """``forward`` on a packed micro-batch (class docstring)."""
        ids, clip = self._check_packed(
            tokens, timestep, text, packed, image, mask, positions, placement
        )
        cos, sin = self.rope(ids, packed)
        temb, proj, context = self.condition_embedder(timestep, text)
        if timestep.dim() == 1:  # per clip -> per token (padding: zeros)
            clip = clip.to(temb.device)
            temb, proj = per_clip_to_tokens(temb, clip)[None], per_clip_to_tokens(proj, clip)[None]
        hidden = None
        if self.pre_process:
            hidden = self.patch_embedding(tokens).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=proj,
            attention_mask=packed_attention_mask(packed) if mask is None else mask,
            rotary_pos_emb=torch.stack([cos, sin]).to(text.device),
            packed=packed,
            placement=placement,
        )
        C, L, D = context.shape
        out = self.decoder(hidden, params, context=context.reshape(C * L, 1, D).contiguous())
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.head(out.transpose(0, 1), temb)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        from megatron_video.models.video_dit import mark_pp_replicas

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return mark_pp_replicas(sd, [f"{prefix}condition_embedder."])
