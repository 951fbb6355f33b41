"""ST-DiT layer with hybrid CP<->DP parallelism, a Megatron ``TransformerLayer``.

Layout A (``[s, b, D]``, this rank's frames x all positions; ``layouts.stdit``) for the optional
full attention (2D, over the CP group), spatial attention (local rows of one frame) and
cross-attention; one all-to-all to layout B (all frames of this rank's positions) for temporal
attention (local rows of one position) and the MLP; one all-to-all back. Each sub-layer is
AdaLN-LoRA gated. Its specs (the variants): ``models.dit_layer_specs.get_stdit_layer_spec``;
design: docs/architecture.md, "Megatron integration".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention import masks
from megatron_video.attention.megatron import LocalDotProductAttention
from megatron_video.attention.stdit_transitions import frames_to_positions, positions_to_frames
from megatron_video.layouts.stdit import (
    VideoGeometry,
    check_stdit_divisibility,
    layout_a_indices,
    layout_b_indices,
    token_thw,
)
from megatron_video.models.dit_blocks import (
    DiTSelfAttention,
    attend,
    rope_3d_angles,
    rope_embedding,
)
from megatron_video.models.dit_layer import (
    DiTLayerBase,
    DiTLayerSubmodules,
    DiTParams,
    adaln_branch,
)

__all__ = ["VARIANTS", "STDiTLayerSubmodules", "STDiTLayer"]

# The ST-DiT variants ``models.dit_layer_specs.get_stdit_layer_spec`` builds (by core attention).
VARIANTS = ("hybrid", "cp_everywhere", "ulysses_everywhere")


@dataclass
class STDiTLayerSubmodules(DiTLayerSubmodules):
    """Megatron's layer slots plus ST-DiT's own attentions. ``input_layernorm`` / ``full_attention``
    (optional full self-attention, its ``core_attention`` the 2D attention that
    ``with_2d_attention`` swaps), ``pre_spatial_attn_layernorm`` / ``spatial_attention``,
    ``pre_cross_attn_layernorm`` / ``cross_attention``, ``pre_temporal_attn_layernorm`` /
    ``temporal_attention``, ``pre_mlp_layernorm`` / ``mlp``, ``modulation``. Megatron's
    ``self_attention`` slot stays ``IdentityOp``."""

    full_attention: Union[ModuleSpec, type] = None
    pre_spatial_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    spatial_attention: Union[ModuleSpec, type] = None
    pre_temporal_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    temporal_attention: Union[ModuleSpec, type] = None


class STDiTLayer(DiTLayerBase):
    """One ST-DiT block (see the module docstring for the layouts).

    ``forward(hidden_states [s, b, D], context=[L, b, D_c], context_mask=[b, L], params=DiTParams)``
    -> ``([s, b, D], context)``: ``hidden_states`` in layout A (images, ``t == 1``, are sharded by
    sample instead), text whole, ``params`` the conditioning ``[b, D]`` and the global geometry.
    The spec's core attentions choose the variant: a ``LocalDotProductAttention`` core runs its
    attention on the rows the layer cuts (and temporal attention in layout B); any other core
    (2D, Ulysses) runs over the CP group in layout A with same-frame / same-position masks.
    """

    sequence_parallel_reason = "its tokens are laid out by frames and positions, not split over TP"
    cp_order_note = "; layout A and the 2D attention would disagree on which frames a rank holds"
    params_what = "the AdaLN conditioning and the global (t, h, w)"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: STDiTLayerSubmodules,
        layer_number: int = 1,
        full_attention_layers: Iterable[int] = (),
        lora_rank: int = 256,
        rope_theta: Optional[float] = 10000.0,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.rope_theta = rope_theta

        has_full = self.layer_number in set(full_attention_layers)
        self.sublayers = (["full"] if has_full else []) + ["spatial", "cross", "temporal", "mlp"]
        self._build_modulation(submodules.modulation, 3 * len(self.sublayers), lora_rank)
        self.full_attention = self._build(submodules.full_attention) if has_full else None
        norm = dict(
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )
        self.pre_spatial_attn_layernorm = build_module(
            submodules.pre_spatial_attn_layernorm, **norm
        )
        self.spatial_attention = self._build(submodules.spatial_attention)
        self.pre_temporal_attn_layernorm = build_module(
            submodules.pre_temporal_attn_layernorm, **norm
        )
        self.temporal_attention = self._build(submodules.temporal_attention)

    # -- helpers ------------------------------------------------------------------------------
    @property
    def cp_group(self):
        return None if self.groups is None else self.groups.cp_group

    def _on_local_rows(self, module: DiTSelfAttention, geometry: VideoGeometry) -> bool:
        """Whether ``module`` attends on the local rows the layer cuts (its core is local, or
        there is nothing to communicate: CP 1 or images, sharded by sample)."""
        return (
            isinstance(module.core_attention, LocalDotProductAttention)
            or self._cp()[0] == 1
            or geometry.is_image
        )

    def _self_attention(
        self, module: DiTSelfAttention, x, pattern: str, geometry: VideoGeometry, layout: str
    ):
        """Attention of ``x`` (``[b, t/P, n, D]`` in layout A or ``[b, m, t, D]`` in layout B)."""
        b, d1, d2, D = x.shape
        t, n, P = geometry.frames, geometry.positions, self._cp()[0]
        hd = module.head_dim
        angles = None
        if self.rope_theta is not None:
            if geometry.is_image:  # whole samples on every rank; A and B hold the same n tokens
                index = torch.arange(n)
            else:
                rank = 0 if self.groups is None else self.groups.cp_rank
                index = (layout_a_indices if layout == "A" else layout_b_indices)(rank, t, n, P)
            angles = rope_3d_angles(token_thw(index, geometry), hd, self.rope_theta).to(x.device)
        mask = None
        if pattern != "full" and self._on_local_rows(module, geometry):
            # rows of the local layout (frames in A, positions in B) are independent short sequences
            rows = x.reshape(b * d1, d2, D)
            if angles is not None:
                angles = angles.reshape(d1, d2, -1).expand(b, -1, -1, -1).reshape(b * d1, d2, -1)
        else:
            rows = x.reshape(b, d1 * d2, D)
            if pattern != "full":  # same frame / same position, on global token ids
                mask = masks.video_rows(n, pattern)
        if (
            geometry.is_image
            and P > 1
            and not isinstance(module.core_attention, LocalDotProductAttention)
        ):
            # images are sharded by sample: their attention is local, whatever the core would do
            o = module.project(attend(*module.qkv(rows, angles)))
        else:
            rope = None
            if angles is not None:
                rope = rope_embedding(angles.transpose(0, 1) if angles.dim() == 3 else angles)
            o, _ = module(rows.transpose(0, 1), attention_mask=mask, rotary_pos_emb=rope)
            o = o.transpose(0, 1)
        return o.reshape(b, d1, d2, D)

    # -- forward ------------------------------------------------------------------------------
    def _check_inputs(self, hidden_states, context, params: DiTParams) -> VideoGeometry:
        """The geometry of ``params``, checked against ``hidden_states`` (layout A), the CP size
        and the conditioning."""
        if params.packed is not None:
            raise ValueError(
                f"params.packed ({params.packed!r}) is not supported by STDiTLayer: ST-DiT's "
                f"layouts A / B need a regular frame grid on every CP rank (whole frames of one "
                f"sample per rank); packed micro-batches run on VideoDiT's full attention"
            )
        geometry = self._geometry(params, "the global (t, h, w)")
        P = self._cp()[0]
        t, n = geometry.frames, geometry.positions
        check_stdit_divisibility(t, P)
        tl = 1 if geometry.is_image else t // P
        s, b, D = hidden_states.shape
        if s != tl * n:
            raise ValueError(
                f"hidden_states sequence length ({s}) must be frames per rank ({tl}) x "
                f"positions ({n}) for geometry {geometry} on cp_size ({P})"
            )
        conditioning = self._check_conditioning(
            params.conditioning,
            (b, D),
            "params.conditioning must be the AdaLN conditioning vector [b, D]",
        )
        self._check_same_shapes(
            hidden_states=hidden_states, conditioning=conditioning, context=context
        )
        return geometry

    def _forward(self, hidden_states, context, context_mask, params: DiTParams):
        """``hidden_states [s, b, D]`` (layout A) -> ``([s, b, D], context)``; see the module
        docstring."""
        geometry = self._check_inputs(hidden_states, context, params)
        P = self._cp()[0]
        t, n = geometry.frames, geometry.positions
        tl = 1 if geometry.is_image else t // P
        s, b, D = hidden_states.shape
        mods = self.modulation(params.conditioning)
        index = {name: i for i, name in enumerate(self.sublayers)}

        def branch(name, x, norm, f):
            return adaln_branch(x, mods, index[name], norm, f)

        def attn(module, pattern, layout):
            return lambda y: self._self_attention(module, y, pattern, geometry, layout)

        def temporal_and_mlp(x, layout):
            norm = self.pre_temporal_attn_layernorm
            x = branch("temporal", x, norm, attn(self.temporal_attention, "temporal", layout))
            return branch("mlp", x, self.pre_mlp_layernorm, self._mlp)

        x = hidden_states.transpose(0, 1).reshape(b, tl, n, D)
        if self.full_attention is not None:
            x = branch("full", x, self.input_layernorm, attn(self.full_attention, "full", "A"))
        x = branch(
            "spatial",
            x,
            self.pre_spatial_attn_layernorm,
            attn(self.spatial_attention, "spatial", "A"),
        )
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch(
                "cross",
                x,
                self.pre_cross_attn_layernorm,
                lambda y: self.cross_attention(y.reshape(b, tl * n, D), ctx, context_mask).reshape(
                    b, tl, n, D
                ),
            )
        if not self._on_local_rows(self.temporal_attention, geometry):
            x = temporal_and_mlp(x, "A")
        elif P == 1:  # layout B is a local transpose
            x = temporal_and_mlp(x.transpose(1, 2), "B").transpose(1, 2)
        else:  # to layout B, temporal + MLP, back to A
            xb = frames_to_positions(x, self.cp_group, t, n, check_shapes=False)
            xb = temporal_and_mlp(xb, "B")
            x = positions_to_frames(xb, self.cp_group, t, n, check_shapes=False)
        return x.reshape(b, s, D).transpose(0, 1).contiguous(), context
