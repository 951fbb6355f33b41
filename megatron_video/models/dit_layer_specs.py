"""Layer specs of the video DiTs (``ModuleSpec`` trees for Megatron's ``TransformerBlock``), as
Megatron keeps ``gpt_layer_specs.py`` beside ``gpt_model.py``: full attention, ST-DiT and AR DiT,
local or TransformerEngine linears and norms. The spec alone picks a layer's implementation (e.g.
the ST-DiT variant is its core attentions). Design: docs/architecture.md, "Megatron integration".
"""

from __future__ import annotations

import copy
from typing import Iterable, Optional

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.attention.megatron import (
    DistAttention2D,
    LocalDotProductAttention,
    UlyssesAttention,
)
from megatron_video.models.ar_dit_layer import ARDiTLayer
from megatron_video.models.dit_blocks import (
    AdaLNLoRAModulation,
    AdaLNNorm,
    DiTAttentionSubmodules,
    DiTCrossAttention,
    DiTCrossAttentionSubmodules,
    DiTSelfAttention,
)
from megatron_video.models.dit_layer import DiTLayerSubmodules, mlp_submodule
from megatron_video.models.stdit import VARIANTS, STDiTLayer, STDiTLayerSubmodules
from megatron_video.models.video_dit_layer import VideoDiTLayer

__all__ = [
    "LAYER_BACKENDS",
    "VARIANTS",
    "dit_backend_modules",
    "check_layer_backend",
    "dit_self_attention_spec",
    "dit_cross_attention_spec",
    "dit_mlp_spec",
    "full_2d_attention",
    "full_attention_layer_spec",
    "get_video_dit_layer_spec",
    "get_stdit_layer_spec",
    "get_ar_dit_layer_spec",
    "layer_spec_for",
]

LAYER_BACKENDS = ("local", "te")


# ----------------------------------------------------------------------------------------------
# Building blocks of every DiT layer spec
# ----------------------------------------------------------------------------------------------
def dit_backend_modules(backend: str = "local") -> dict:
    """The linear / norm classes of a DiT layer spec: Megatron-core's own (``"local"``, CPU and
    GPU) or TransformerEngine's (``"te"``: ``TEColumnParallelLinear`` / ``TERowParallelLinear`` /
    ``TENorm``, FP8-capable). TE classes are looked up only here, when a TE spec is asked for."""
    if backend == "local":
        return dict(column=ColumnParallelLinear, row=RowParallelLinear, norm=AdaLNNorm)
    if backend == "te":
        from megatron.core.extensions import transformer_engine as te  # optional: TE

        return dict(column=te.TEColumnParallelLinear, row=te.TERowParallelLinear, norm=te.TENorm)
    raise ValueError(f"backend ({backend!r}) must be one of {LAYER_BACKENDS}")


def check_layer_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` can build modules here (``"te"`` needs TransformerEngine)."""
    if backend not in LAYER_BACKENDS:
        raise ValueError(f"layer_backend ({backend!r}) must be one of {LAYER_BACKENDS}")
    if backend == "te":
        from megatron.core.extensions.transformer_engine import HAVE_TE  # optional: TE

        if not HAVE_TE:
            raise ValueError(
                "layer_backend ('te') needs TransformerEngine, which is not installed "
                "here; use 'local'"
            )


def dit_self_attention_spec(core_attention, backend: str = "local") -> ModuleSpec:
    """``DiTSelfAttention`` with ``core_attention`` and the backend's linears."""
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=DiTSelfAttention,
        params=dict(attn_mask_type=AttnMaskType.no_mask),
        submodules=DiTAttentionSubmodules(
            linear_qkv=m["column"], core_attention=core_attention, linear_proj=m["row"]
        ),
    )


def dit_cross_attention_spec(context_dim: Optional[int], backend: str = "local") -> ModuleSpec:
    """Cross-attention to the whole text (no CP) with the backend's linears."""
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=DiTCrossAttention,
        params=dict(context_dim=context_dim),
        submodules=DiTCrossAttentionSubmodules(
            linear_q=m["column"], linear_kv=m["column"], linear_proj=m["row"]
        ),
    )


def dit_mlp_spec(backend: str = "local"):
    m = dit_backend_modules(backend)
    return mlp_submodule(MLPSubmodules(linear_fc1=m["column"], linear_fc2=m["row"]))


def full_2d_attention() -> ModuleSpec:
    """Core attention over the whole sequence, context-parallel: 2D attention on the contiguous
    CP split the DiT models use (rank ``c`` holds tokens ``[c*s, (c+1)*s)``)."""
    return ModuleSpec(module=DistAttention2D, params=dict(scheme="contiguous"))


# ----------------------------------------------------------------------------------------------
# Full-attention layers: VideoDiT and the AR DiT
# ----------------------------------------------------------------------------------------------
def full_attention_layer_spec(
    module, params: dict, context_dim: Optional[int], backend: str = "local"
) -> ModuleSpec:
    """The submodules of a DiT layer whose self-attention is sequence-wide (2D attention core):
    norms, self-attention, cross-attention, MLP and AdaLN-LoRA modulation of ``backend``."""
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=module,
        params=params,
        submodules=DiTLayerSubmodules(
            input_layernorm=m["norm"],
            self_attention=dit_self_attention_spec(full_2d_attention(), backend),
            pre_cross_attn_layernorm=m["norm"],
            cross_attention=dit_cross_attention_spec(context_dim, backend),
            pre_mlp_layernorm=m["norm"],
            mlp=dit_mlp_spec(backend),
            modulation=AdaLNLoRAModulation,
        ),
    )


def get_video_dit_layer_spec(
    lora_rank: int = 256,
    rope_theta: Optional[float] = 10000.0,
    context_dim: Optional[int] = None,
    backend: str = "local",
) -> ModuleSpec:
    """``ModuleSpec`` of ``VideoDiTLayer`` for Megatron's ``TransformerBlock``; ``backend``
    ``"local"`` (Megatron-core linears, parameter-free AdaLN norms) or ``"te"`` (TE linears and
    norms; building modules from it needs TransformerEngine)."""
    return full_attention_layer_spec(
        VideoDiTLayer, dict(lora_rank=lora_rank, rope_theta=rope_theta), context_dim, backend
    )


def get_ar_dit_layer_spec(
    lora_rank: int = 256, context_dim: Optional[int] = None, backend: str = "local"
) -> ModuleSpec:
    """``ModuleSpec`` of ``ARDiTLayer`` for Megatron's ``TransformerBlock`` (``backend`` as
    ``get_video_dit_layer_spec``); the self-attention core is the 2D attention, which takes the
    teacher-forcing mask per call."""
    return full_attention_layer_spec(ARDiTLayer, dict(lora_rank=lora_rank), context_dim, backend)


# ----------------------------------------------------------------------------------------------
# ST-DiT
# ----------------------------------------------------------------------------------------------
def _stdit_cores(variant: str):
    """(full, spatial / temporal) core attentions of a variant: ``"hybrid"`` attends spatially /
    temporally on the rows ``STDiTLayer`` cuts (local cores, two all-to-alls per layer); the
    baselines, same parameters and results, run every attention over the CP group in layout A:
    ``"cp_everywhere"`` 2D attention with same-frame / same-position masks, ``"ulysses_everywhere"``
    ``UlyssesAttention`` over the whole CP group."""
    contiguous = dict(scheme="contiguous")
    if variant == "hybrid":
        return (
            ModuleSpec(module=DistAttention2D, params=contiguous),
            ModuleSpec(module=LocalDotProductAttention),
        )
    if variant == "cp_everywhere":
        cp = ModuleSpec(module=DistAttention2D, params=contiguous)
        return cp, cp
    uly = ModuleSpec(module=UlyssesAttention, params=contiguous)
    return uly, uly


def get_stdit_layer_spec(
    variant: str = "hybrid",
    full_attention_layers: Iterable[int] = (),
    lora_rank: int = 256,
    rope_theta: Optional[float] = 10000.0,
    context_dim: Optional[int] = None,
    backend: str = "local",
) -> ModuleSpec:
    """``ModuleSpec`` of ``STDiTLayer`` for Megatron's ``TransformerBlock`` (fanned out to every
    layer). ``variant``: one of ``VARIANTS`` (only the core attentions differ).
    ``full_attention_layers``: global 1-based layer numbers that also get full self-attention.
    ``rope_theta=None`` disables 3D RoPE. ``context_dim``: text embedding width (default ``D``).
    ``backend``: ``"local"`` or ``"te"`` (TE linears and norms), as ``get_video_dit_layer_spec``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant ({variant!r}) must be one of {VARIANTS}")
    m = dit_backend_modules(backend)
    full_core, local_core = _stdit_cores(variant)
    return ModuleSpec(
        module=STDiTLayer,
        params=dict(
            full_attention_layers=tuple(full_attention_layers),
            lora_rank=lora_rank,
            rope_theta=rope_theta,
        ),
        submodules=STDiTLayerSubmodules(
            modulation=AdaLNLoRAModulation,
            input_layernorm=m["norm"],
            full_attention=dit_self_attention_spec(full_core, backend),
            pre_spatial_attn_layernorm=m["norm"],
            spatial_attention=dit_self_attention_spec(local_core, backend),
            pre_cross_attn_layernorm=m["norm"],
            cross_attention=dit_cross_attention_spec(context_dim, backend),
            pre_temporal_attn_layernorm=m["norm"],
            temporal_attention=dit_self_attention_spec(copy.deepcopy(local_core), backend),
            pre_mlp_layernorm=m["norm"],
            mlp=dit_mlp_spec(backend),
        ),
    )


# ----------------------------------------------------------------------------------------------
# Wan: ``get_wan_layer_spec`` lives beside its model in models/wan/wan_layer_specs.py and is built
# from the slots above (dit_backend_modules, dit_mlp_spec, full_2d_attention).
# ----------------------------------------------------------------------------------------------


def layer_spec_for(config) -> ModuleSpec:
    """The layer spec a ``VideoDiTConfig`` selects (``layer_type``, ``layer_backend``, ...)."""
    check_layer_backend(config.layer_backend)
    if config.layer_type == "stdit":
        return get_stdit_layer_spec(
            config.stdit_variant,
            config.stdit_full_attention_layers,
            config.lora_rank,
            config.rope_theta,
            config.text_dim,
            backend=config.layer_backend,
        )
    return get_video_dit_layer_spec(
        config.lora_rank, config.rope_theta, config.text_dim, backend=config.layer_backend
    )
