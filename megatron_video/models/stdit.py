"""ST-DiT layer with hybrid CP<->DP parallelism, as a Megatron ``TransformerLayer`` replacement.

One layer (block) on a CP group of ``P`` ranks, input and output in layout A (``[s, b, D]`` with
``s = t*n/P``: this rank's frames x all positions; see ``megatron_video.layouts.stdit``)::

    [full self-attention]   layout A, 2D (Ulysses x ring) attention    (chosen layers only)
    spatial self-attention  layout A as [(b*t/P), n]: local, no comm   (data parallel)
    cross-attention         layout A, the whole text on every rank      (no CP)
    -- frames_to_positions: 1 all-to-all --
    temporal self-attention layout B as [(b*n/P), t]: local, no comm    (data parallel)
    MLP                     layout B (pointwise)
    -- positions_to_frames: 1 all-to-all --

so a layer costs exactly 2 all-to-alls forward and 2 backward beyond its optional full attention.
Every sub-layer is ``x + gate * f(modulate(LN(x), shift, scale))`` with AdaLN-LoRA modulation of
the conditioning vector (zero-initialised: the layer starts as the identity).

Baselines (``variant``), same parameters and results, for the benchmark:
  * ``"cp_everywhere"``: spatial and temporal attention also run as 2D attention in layout A, with
    same-frame / same-position masks (no transitions);
  * ``"ulysses_everywhere"``: every self-attention all-to-alls q, k, v to head shards of the whole
    sequence and the output back (4 per attention, 12 per layer with full attention).

Megatron ``TransformerBlock`` calling convention (its layer call has fixed keyword slots):
  * ``hidden_states [s, b, D]`` in layout A; images (``t == 1``) are sharded by sample instead;
  * ``attention_mask``: the AdaLN conditioning vector ``[b, D]`` (ST-DiT self-attention masks are
    structural, so the slot carries the conditioning, as in NeMo's DiT layers; being a tensor it
    survives Megatron's activation recompute);
  * ``context [L, b, D_c]`` text, ``context_mask [b, L]`` (True = real token), both whole;
  * ``packed_seq_params``: a ``VideoSeqParams`` whose ``geometry`` gives the global ``(t, h, w)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention import dist_attention, masks
from megatron_video.layouts.stdit import (VideoGeometry, check_stdit_divisibility,
                                          layout_a_indices, layout_b_indices, token_thw)
from megatron_video.models.dit_blocks import (AdaLNLoRAModulation, DiTAttentionSubmodules,
                                              DiTCrossAttention, DiTCrossAttentionSubmodules,
                                              DiTSelfAttention, VideoSeqParams, attend, gated,
                                              modulate, rope_3d_angles)
from megatron_video.models.dit_layer import DiTLayerBase
from megatron_video.models.stdit_transitions import frames_to_positions, positions_to_frames
from megatron_video.parallel.comm import all_to_all, check_same_shape, group_size

__all__ = ["VARIANTS", "STDiTLayerSubmodules", "STDiTLayer", "get_stdit_layer_spec"]

VARIANTS = ("hybrid", "cp_everywhere", "ulysses_everywhere")


@dataclass
class STDiTLayerSubmodules:
    modulation: Union[ModuleSpec, type] = AdaLNLoRAModulation
    full_attention: Union[ModuleSpec, type] = None
    spatial_attention: Union[ModuleSpec, type] = None
    cross_attention: Union[ModuleSpec, type] = None
    temporal_attention: Union[ModuleSpec, type] = None
    mlp: Union[ModuleSpec, type] = None


def get_stdit_layer_spec(variant: str = "hybrid", full_attention_layers: Iterable[int] = (),
                         lora_rank: int = 256, rope_theta: Optional[float] = 10000.0,
                         context_dim: Optional[int] = None) -> ModuleSpec:
    """``ModuleSpec`` of ``STDiTLayer`` for Megatron's ``TransformerBlock`` (fanned out to every layer).

    ``full_attention_layers``: global 1-based layer numbers that also get full self-attention.
    ``rope_theta=None`` disables 3D RoPE. ``context_dim``: text embedding width (default ``D``).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant ({variant!r}) must be one of {VARIANTS}")
    attn = ModuleSpec(module=DiTSelfAttention, submodules=DiTAttentionSubmodules())
    return ModuleSpec(
        module=STDiTLayer,
        params=dict(variant=variant, full_attention_layers=tuple(full_attention_layers),
                    lora_rank=lora_rank, rope_theta=rope_theta, context_dim=context_dim),
        submodules=STDiTLayerSubmodules(
            modulation=AdaLNLoRAModulation, full_attention=attn, spatial_attention=attn,
            cross_attention=ModuleSpec(module=DiTCrossAttention,
                                       submodules=DiTCrossAttentionSubmodules()),
            temporal_attention=attn,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))),
    )


def _ulysses(q, k, v, group, pattern: str, tl: int, n: int, tag: str):
    """Ulysses-everywhere baseline: all-to-all q, k, v to head shards of the whole sequence, attend
    with ``pattern`` ("spatial" / "temporal" / "full") and all-to-all the output back (4 calls)."""
    P = group_size(group)
    for name, t_ in (("query heads", q), ("key/value heads", k)):
        if t_.shape[2] % P:
            raise ValueError(f"variant 'ulysses_everywhere': {name} per TP rank ({t_.shape[2]}) "
                             f"must be divisible by cp_size ({P})")
    q, k, v = (all_to_all(x, group, scatter_dim=2, gather_dim=1, tag=f"{tag}.{nm}")
               for x, nm in ((q, "q"), (k, "k"), (v, "v")))
    b, S, h, d = q.shape
    t = tl * P

    def to_pattern(x):
        if pattern == "spatial":
            return x.reshape(b * t, n, x.shape[2], d)
        if pattern == "temporal":
            return x.reshape(b, t, n, x.shape[2], d).transpose(1, 2).reshape(b * n, t, x.shape[2], d)
        return x

    o = attend(to_pattern(q), to_pattern(k), to_pattern(v))
    if pattern == "temporal":
        o = o.reshape(b, n, t, h, d).transpose(1, 2)
    o = o.reshape(b, S, h, d)
    return all_to_all(o, group, scatter_dim=1, gather_dim=2, tag=f"{tag}.o")


class STDiTLayer(DiTLayerBase):
    """One ST-DiT block; see the module docstring for the layouts and the call convention."""

    sequence_parallel_reason = "its tokens are laid out by frames and positions, not split over TP"
    cp_order_note = "; layout A and the 2D attention would disagree on which frames a rank holds"

    def __init__(self, config: TransformerConfig, submodules: STDiTLayerSubmodules,
                 layer_number: int = 1, pg_collection=None, vp_stage: Optional[int] = None,
                 variant: str = "hybrid", full_attention_layers: Iterable[int] = (),
                 lora_rank: int = 256, rope_theta: Optional[float] = 10000.0,
                 context_dim: Optional[int] = None):
        if variant not in VARIANTS:
            raise ValueError(f"variant ({variant!r}) must be one of {VARIANTS}")
        super().__init__(config, layer_number, vp_stage)
        self.variant = variant
        self.rope_theta = rope_theta

        has_full = self.layer_number in set(full_attention_layers)
        self.sublayers = (["full"] if has_full else []) + ["spatial", "cross", "temporal", "mlp"]
        self.modulation = self._build_modulation(submodules.modulation, 3 * len(self.sublayers),
                                                 lora_rank)
        self.full_attention = (self._build_attention(submodules.full_attention) if has_full
                               else None)
        self.spatial_attention = self._build_attention(submodules.spatial_attention)
        self.cross_attention = self._build_cross_attention(submodules.cross_attention, context_dim)
        self.temporal_attention = self._build_attention(submodules.temporal_attention)
        self.mlp = self._build_mlp(submodules.mlp)

    # -- helpers ------------------------------------------------------------------------------
    @property
    def cp_group(self):
        return None if self.groups is None else self.groups.cp_group

    def _angles(self, global_index, geometry: VideoGeometry, head_dim: int):
        if self.rope_theta is None:
            return None
        return rope_3d_angles(token_thw(global_index, geometry), head_dim, self.rope_theta)

    def _self_attention(self, module: DiTSelfAttention, x, pattern: str, geometry: VideoGeometry,
                        layout: str):
        """Attention of ``x`` (``[b, t/P, n, D]`` in layout A or ``[b, m, t, D]`` in layout B)."""
        b, d1, d2, D = x.shape
        t, n, P = geometry.frames, geometry.positions, self._cp()[0]
        if geometry.is_image:  # whole samples on every rank; A and B hold the same n tokens
            index = torch.arange(n)
        else:
            rank = 0 if self.groups is None else self.groups.cp_rank
            index = (layout_a_indices if layout == "A" else layout_b_indices)(rank, t, n, P)
        q, k, v = module.qkv(x.reshape(b, d1 * d2, D), self._angles(index, geometry, module.head_dim))
        if pattern == "full" and (P == 1 or geometry.is_image):
            o = attend(q, k, v)
        elif pattern != "full" and (self.variant == "hybrid" or P == 1 or geometry.is_image):
            # rows of the local layout (frames in A, positions in B) are independent short sequences
            h, hkv, hd = q.shape[2], k.shape[2], q.shape[3]
            o = attend(q.reshape(b * d1, d2, h, hd), k.reshape(b * d1, d2, hkv, hd),
                       v.reshape(b * d1, d2, hkv, hd)).reshape(b, d1 * d2, h, hd)
        elif self.variant == "ulysses_everywhere":
            o = _ulysses(q, k, v, self.cp_group, pattern, d1, n, tag=f"ulysses.{pattern}")
        else:
            o = self._dist_attention(q, k, v, pattern, geometry)
        return module.project(o).reshape(b, d1, d2, D)

    def _dist_attention(self, q, k, v, pattern: str, geometry: VideoGeometry):
        """2D attention over the CP group in layout A (a contiguous chunk of the sequence); spatial
        and temporal patterns (CP-everywhere baseline) as masks on global token indices."""
        n = geometry.positions
        mask = None
        if pattern == "spatial":
            mask = masks.predicate(lambda qi, ki: qi // n == ki // n)   # same frame
        elif pattern == "temporal":
            mask = masks.predicate(lambda qi, ki: qi % n == ki % n)     # same position
        return dist_attention(q, k, v, self.groups, mask=mask, scheme="contiguous")

    # -- forward ------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[VideoSeqParams] = None, **unused):
        """``hidden_states [s, b, D]`` (layout A) -> ``([s, b, D], context)``; see the module docstring."""
        conditioning = attention_mask
        geometry = self._geometry(packed_seq_params, "the global (t, h, w)")
        if conditioning is None:
            raise ValueError("attention_mask (None) must be the AdaLN conditioning vector [b, D] "
                             "for STDiTLayer")
        P = self._cp()[0]
        t, n = geometry.frames, geometry.positions
        check_stdit_divisibility(t, P)
        tl = 1 if geometry.is_image else t // P
        s, b, D = hidden_states.shape
        if s != tl * n:
            raise ValueError(f"hidden_states sequence length ({s}) must be frames per rank ({tl}) x "
                             f"positions ({n}) for geometry {geometry} on cp_size ({P})")
        if tuple(conditioning.shape) != (b, D):
            raise ValueError(f"attention_mask (conditioning) has shape {tuple(conditioning.shape)}, "
                             f"expected [b, D] = [{b}, {D}]")
        if P > 1:
            shapes = {"hidden_states": hidden_states, "conditioning": conditioning}
            if context is not None:
                shapes["context"] = context
            check_same_shape(shapes, self.cp_group, where="STDiTLayer")

        mods = self.modulation(conditioning)
        mod = {name: mods[3 * i:3 * i + 3] for i, name in enumerate(self.sublayers)}

        def branch(name, x, f):
            shift, scale, gate = mod[name]
            return x + gated(f(modulate(self._norm(x), shift, scale)), gate)

        def attn(module, pattern, layout):
            return lambda y: self._self_attention(module, y, pattern, geometry, layout)

        x = hidden_states.transpose(0, 1).reshape(b, tl, n, D)
        if self.full_attention is not None:
            x = branch("full", x, attn(self.full_attention, "full", "A"))
        x = branch("spatial", x, attn(self.spatial_attention, "spatial", "A"))
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch("cross", x, lambda y: self.cross_attention(
                y.reshape(b, tl * n, D), ctx, context_mask).reshape(b, tl, n, D))
        if self.variant == "hybrid" or P == 1 or geometry.is_image:
            # to layout B (a local transpose when P == 1 or for images), temporal + MLP, back to A
            if P == 1:
                xb = x.transpose(1, 2)
            else:
                xb = frames_to_positions(x, self.cp_group, t, n, check_shapes=False)
            xb = branch("temporal", xb, attn(self.temporal_attention, "temporal", "B"))
            xb = branch("mlp", xb, self._mlp)
            if P == 1:
                x = xb.transpose(1, 2)
            else:
                x = positions_to_frames(xb, self.cp_group, t, n, check_shapes=False)
        else:
            x = branch("temporal", x, attn(self.temporal_attention, "temporal", "A"))
            x = branch("mlp", x, self._mlp)
        return x.reshape(b, s, D).transpose(0, 1).contiguous(), context
