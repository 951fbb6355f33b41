"""Wan (diffusers' ``WanTransformer3DModel``) on Megatron: the model (``model``; its ``config``, the
layer ``layer`` and its specs ``wan_layer_specs``, ``embedders``, RoPE ``rope``), diffusers interop
(``interop``: ``from_diffusers``, ``diffusers_forward``), the weight mapping (``mapping``) and
checkpoint conversion (``convert``). See docs/wan.md."""

from megatron_video.models.wan.config import WanConfig
from megatron_video.models.wan.interop import diffusers_forward, from_diffusers
from megatron_video.models.wan.model import WanModel
from megatron_video.models.wan.wan_layer_specs import get_wan_layer_spec

__all__ = ["from_diffusers", "diffusers_forward", "WanConfig", "WanModel", "get_wan_layer_spec"]
