"""Layer specs of the Wan transformer (beside the model, as Megatron keeps its GPT specs).

``get_wan_layer_spec(config, backend=None)``: the ``ModuleSpec`` of ``WanLayer`` with Megatron's
slots: Wan's fp32-island norms, self-attention whose ``core_attention`` is the 2D attention over
the contiguous CP split (``models.specs.with_2d_attention`` may swap it, e.g. for a mask),
cross-attention without CP (with the I2V image branch when ``config.added_kv_proj_dim`` is set)
and Megatron's MLP with GELU-tanh. ``backend`` ``"local"`` (Megatron-core linears) or ``"te"``
(TransformerEngine linears; the norms stay Wan's).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.models.dit_layer import DiTLayerSubmodules
from megatron_video.models.dit_layer_specs import (
    dit_backend_modules,
    dit_mlp_spec,
    full_2d_attention,
)
from megatron_video.models.wan.layer import (
    WanCrossAttention,
    WanCrossAttentionSubmodules,
    WanLayer,
    WanLayerNorm,
    WanModulation,
    WanSelfAttention,
    WanSelfAttentionSubmodules,
)

__all__ = ["get_wan_layer_spec", "wan_self_attention_spec", "wan_cross_attention_spec"]


def wan_self_attention_spec(core_attention=None, backend: str = "local") -> ModuleSpec:
    """``WanSelfAttention`` with ``core_attention`` (default: 2D attention, contiguous split)."""
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=WanSelfAttention,
        params=dict(attn_mask_type=AttnMaskType.no_mask),
        submodules=WanSelfAttentionSubmodules(
            linear_qkv=m["column"],
            core_attention=core_attention or full_2d_attention(),
            linear_proj=m["row"],
        ),
    )


def wan_cross_attention_spec(backend: str = "local") -> ModuleSpec:
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=WanCrossAttention,
        submodules=WanCrossAttentionSubmodules(
            linear_q=m["column"],
            linear_kv=m["column"],
            linear_kv_img=m["column"],
            linear_proj=m["row"],
        ),
    )


def get_wan_layer_spec(
    config=None, backend: Optional[str] = None, *, cross_attn_norm: Optional[bool] = None
) -> ModuleSpec:
    """``ModuleSpec`` of ``WanLayer``; ``cross_attn_norm`` / ``backend`` default to the config's
    (``WanConfig.cross_attn_norm``, ``layer_backend``)."""
    if cross_attn_norm is None:
        cross_attn_norm = True if config is None else config.cross_attn_norm
    if backend is None:
        backend = "local" if config is None else config.layer_backend
    norm2 = (
        ModuleSpec(module=WanLayerNorm, params=dict(elementwise_affine=True))
        if cross_attn_norm
        else IdentityOp
    )
    return ModuleSpec(
        module=WanLayer,
        submodules=DiTLayerSubmodules(
            input_layernorm=WanLayerNorm,
            self_attention=wan_self_attention_spec(backend=backend),
            pre_cross_attn_layernorm=norm2,
            cross_attention=wan_cross_attention_spec(backend),
            pre_mlp_layernorm=WanLayerNorm,
            mlp=dit_mlp_spec(backend),
            modulation=WanModulation,
        ),
    )
