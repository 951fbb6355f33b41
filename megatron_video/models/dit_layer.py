"""Shared constructor plumbing of the DiT layers (``VideoDiTLayer``, ``STDiTLayer``, ``ARDiTLayer``).

``DiTLayerBase`` refuses Megatron's sequence parallelism (the sequence is already split over the
CP group), resolves the global layer number, fetches the megatron_video parallel groups and checks
them against Megatron's context parallelism. It also builds sub-modules from a layer's
``ModuleSpec`` submodules with the shared keyword arguments; each layer still assigns its own
attributes, in its own order, so parameter names (state-dict keys) belong to the layer.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (BaseTransformerLayer,
                                                         get_transformer_layer_offset)

from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.parallel.comm import group_rank
from megatron_video.parallel.topology import get_video_parallel_groups

__all__ = ["DiTLayerBase"]


class DiTLayerBase(MegatronModule, BaseTransformerLayer):
    """Base of the DiT layers; subclasses set the two class-level error-message fragments."""

    # why ``config.sequence_parallel`` cannot be used (completes "... is not supported by X: ")
    sequence_parallel_reason: str = "its sequence is already split by context parallelism"
    # appended to the CP rank-order error
    cp_order_note: str = ""

    def __init__(self, config: TransformerConfig, layer_number: int = 1,
                 vp_stage: Optional[int] = None):
        super().__init__(config=config)
        if config.sequence_parallel:
            raise ValueError(f"config.sequence_parallel (True) is not supported by "
                             f"{type(self).__name__}: {self.sequence_parallel_reason}")
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage)
        # None without megatron_video parallel groups (then CP must be 1)
        self.groups = get_video_parallel_groups(check_initialized=False)
        cp = parallel_state.get_context_parallel_world_size()
        if self.groups is None and cp > 1:
            raise RuntimeError(f"context_parallel_size ({cp}) > 1 but megatron_video parallel groups "
                               "are not initialised: call init_video_parallel(...) first")
        if self.groups is not None and group_rank(self.groups.cp_group) != self.groups.cp_rank:
            raise RuntimeError("the CP group's rank order differs from the CP index order"
                               + self.cp_order_note)

    # -- sub-module builders (shared keyword arguments) ----------------------------------------
    def _build_modulation(self, spec, num_chunks: int, lora_rank: int):
        return build_module(spec, config=self.config, num_chunks=num_chunks, lora_rank=lora_rank)

    def _build_attention(self, spec):
        return build_module(spec, config=self.config, layer_number=self.layer_number)

    def _build_cross_attention(self, spec, context_dim: Optional[int]):
        return build_module(spec, config=self.config, layer_number=self.layer_number,
                            context_dim=context_dim)

    def _build_mlp(self, spec):
        return build_module(spec, config=self.config, ffn_hidden_size=self.config.ffn_hidden_size)

    def _build_dit_submodules(self, submodules, lora_rank: int, context_dim: Optional[int]) -> None:
        """``modulation`` (9 chunks), ``self_attention``, ``cross_attention``, ``mlp``, in order."""
        self.modulation = self._build_modulation(submodules.modulation, 9, lora_rank)
        self.self_attention = self._build_attention(submodules.self_attention)
        self.cross_attention = self._build_cross_attention(submodules.cross_attention, context_dim)
        self.mlp = self._build_mlp(submodules.mlp)

    # -- shared forward helpers ---------------------------------------------------------------
    def _cp(self) -> Tuple[int, int]:
        """``(cp_size, cp_rank)``; ``(1, 0)`` without video parallel groups."""
        if self.groups is None:
            return 1, 0
        return self.groups.cp_size, self.groups.cp_rank

    def _geometry(self, packed_seq_params, what: str) -> VideoGeometry:
        """The global token grid carried by ``packed_seq_params`` (a ``VideoSeqParams``)."""
        geometry = getattr(packed_seq_params, "geometry", None)
        if not isinstance(geometry, VideoGeometry):
            raise ValueError(f"packed_seq_params ({type(packed_seq_params).__name__}) must be a "
                             f"VideoSeqParams with a VideoGeometry; {type(self).__name__} needs {what}")
        return geometry

    def _norm(self, x):
        return F.layer_norm(x, x.shape[-1:], eps=self.config.layernorm_epsilon)

    def _mlp(self, x):
        # Megatron's linear layers take 3-D activations (their weight-gradient GEMM flattens 3-D)
        out, bias = self.mlp(x.reshape(x.shape[0], -1, x.shape[-1]))
        out = out if bias is None else out + bias
        return out.reshape(x.shape)
