"""Wan's configuration: ``WanConfig`` (Megatron's ``TransformerConfig`` plus the fields of diffusers'
``WanTransformer3DModel`` config), the settings every Wan model has (``wan_architecture``) and
the precision rule (``island_dtype``: where diffusers computes in fp32, this computes in
max(fp32, dtype)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "IMAGE_CONTEXT_TEXT_TOKENS",
    "WanConfig",
    "island_dtype",
    "gelu_tanh",
    "wan_architecture",
]


# diffusers' WanAttnProcessor: "512 is the context length of the text encoder, hardcoded for now";
# with the image branch the first L - 512 context tokens are the image's.
IMAGE_CONTEXT_TEXT_TOKENS = 512


def island_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where diffusers computes in fp32: max(fp32, dtype) (bf16 -> fp32, float64 stays float64)."""
    return torch.promote_types(torch.float32, dtype)


def wan_architecture() -> dict:
    """The ``TransformerConfig`` settings every Wan model has (biased linears, GELU-tanh FFN, no
    dropout), whichever config its sizes come from."""
    return dict(
        add_bias_linear=True,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (diffusers' ``gelu-approximate`` / ``gelu_tanh``)."""
    return F.gelu(x, approximate="tanh")


@dataclass
class WanConfig(TransformerConfig):
    """``TransformerConfig`` plus the fields of diffusers' ``WanTransformer3DModel`` config.

    ``hidden_size`` = heads x ``kv_channels`` (diffusers' ``attention_head_dim``),
    ``ffn_hidden_size`` = ``ffn_dim``, ``layernorm_epsilon`` = ``eps``."""

    patch_size: Tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None
    rope_theta: float = 10000.0
    layer_backend: str = "local"
    has_cond_embedder: bool = True  # embedders replicated on every pipeline stage

    def __post_init__(self):
        super().__post_init__()
        if len(tuple(self.patch_size)) != 3 or any(int(p) < 1 for p in self.patch_size):
            raise ValueError(f"patch_size ({self.patch_size!r}) must be three positive integers")
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if self.num_query_groups not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must equal "
                f"num_attention_heads ({self.num_attention_heads}) for Wan"
            )
        if self.image_dim is None and self.pos_embed_seq_len is not None:
            raise ValueError(f"pos_embed_seq_len ({self.pos_embed_seq_len}) needs image_dim")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def out_patch_dim(self) -> int:
        return self.out_channels * math.prod(self.patch_size)
