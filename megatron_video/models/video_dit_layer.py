"""``VideoDiTLayer``: the full-attention DiT block (2D self-attention over the CP group, cross-
attention to the whole text without CP, MLP, each AdaLN-gated), a Megatron ``TransformerLayer``.
Its spec: ``models.dit_layer_specs.get_video_dit_layer_spec``; design: docs/architecture.md,
"Megatron integration".
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.layouts.stdit import VideoGeometry, token_thw
from megatron_video.models.dit_blocks import rope_3d_angles, rope_embedding
from megatron_video.models.dit_layer import (
    DiTLayerBase,
    DiTLayerSubmodules,
    DiTParams,
    adaln_branch,
    token_adaln_branch,
)
from megatron_video.models.packed import packed_attention_mask, packed_rope, per_clip_to_tokens

__all__ = ["VideoDiTLayer"]


class VideoDiTLayer(DiTLayerBase):
    """Full-attention DiT block: 2D self-attention, cross-attention, MLP, each AdaLN-gated.

    A Megatron ``TransformerLayer``: ``input_layernorm`` / ``self_attention`` (its
    ``core_attention`` the 2D attention), ``pre_cross_attn_layernorm`` / ``cross_attention``,
    ``pre_mlp_layernorm`` / ``mlp``, plus ``modulation`` (9 chunks).
    ``forward(hidden_states [s, b, D], context=[L, b, D_c], context_mask=[b, L], params=DiTParams)``
    -> ``([s, b, D], context)`` with ``params.conditioning [b, D]`` and ``params.geometry``.

    A packed micro-batch (``params.packed``, batch 1, full-attention clips): conditioning per clip
    ``[num_clips, D]`` (modulation gathered per token by its clip), RoPE on each token's own clip
    grid, the clips' document mask and ``params.placement`` passed to the core attention, and
    cross-attention to the packed captions ``[num_clips·L, 1, D_c]`` masked per clip.
    """

    sequence_parallel_reason = "its sequence is already split by context parallelism"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DiTLayerSubmodules,
        layer_number: int = 1,
        lora_rank: int = 256,
        rope_theta: Optional[float] = 10000.0,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, **kwargs)
        self._build_modulation(submodules.modulation, 9, lora_rank)
        self.rope_theta = rope_theta

    def _rope(self, s: int, geometry: VideoGeometry, device):
        if self.rope_theta is None:
            return None
        _, rank = self._cp()
        ids = torch.arange(rank * s, (rank + 1) * s)
        angles = rope_3d_angles(
            token_thw(ids, geometry), self.self_attention.head_dim, self.rope_theta
        )
        return rope_embedding(angles).to(device)

    def _forward(self, hidden_states, context, context_mask, params: DiTParams):
        """``hidden_states [s, b, D]`` (contiguous CP shard) -> ``([s, b, D], context)``."""
        if params.packed is not None:
            return self._forward_packed(hidden_states, context, context_mask, params)
        geometry = self._geometry(params, "the global token grid")
        s, b, D = hidden_states.shape
        P, _ = self._cp()
        if s * P != geometry.tokens:
            raise ValueError(
                f"hidden_states sequence length ({s}) x cp_size ({P}) must equal the "
                f"tokens of geometry {geometry} ({geometry.tokens})"
            )
        conditioning = self._check_conditioning(
            params.conditioning, (b, D), "params.conditioning must be [b, D]"
        )
        self._check_same_shapes(
            hidden_states=hidden_states, conditioning=conditioning, context=context
        )
        mods = self.modulation(conditioning)
        rope = self._rope(s, geometry, hidden_states.device)

        def attention(y):  # [b, s, D] in and out; the attention modules take Megatron's [s, b, D]
            out, _ = self.self_attention(y.transpose(0, 1), rotary_pos_emb=rope)
            return out.transpose(0, 1)

        x = hidden_states.transpose(0, 1)
        x = adaln_branch(x, mods, 0, self.input_layernorm, attention)
        if context is not None:
            ctx = context.transpose(0, 1)
            x = adaln_branch(
                x,
                mods,
                1,
                self.pre_cross_attn_layernorm,
                lambda y: self.cross_attention(y, ctx, context_mask),
            )
        x = adaln_branch(x, mods, 2, self.pre_mlp_layernorm, self._mlp)
        return x.transpose(0, 1).contiguous(), context

    def _forward_packed(self, hidden_states, context, context_mask, params: DiTParams):
        """A packed micro-batch: ``hidden_states [s, 1, D]`` (this CP rank's ids of
        ``params.placement``) -> ``([s, 1, D], context)``; see the class docstring."""
        ids, clip = self._packed_tokens(params, hidden_states, "full")
        s, _, D = hidden_states.shape
        n = params.packed.num_clips
        conditioning = self._check_conditioning(
            params.conditioning,
            (n, D),
            "params.conditioning (per clip, packed) must be [num_clips, D]",
        )
        text_mask = self._packed_text_mask(params, clip, context, context_mask)
        self._check_same_shapes(
            params.packed, hidden_states=hidden_states, conditioning=conditioning, context=context
        )
        mods = [per_clip_to_tokens(m, clip)[:, None] for m in self.modulation(conditioning)]
        rope = params.rotary_pos_emb
        if rope is None and self.rope_theta is not None:
            rope = packed_rope(params.packed, ids, self.self_attention.head_dim, self.rope_theta)
        rope = None if rope is None else rope.to(hidden_states.device)
        mask = params.attention_mask
        if mask is None:
            mask = packed_attention_mask(params.packed)

        def attention(y):  # Megatron's [s, 1, D]
            return self.self_attention(
                y, attention_mask=mask, rotary_pos_emb=rope, placement=params.placement
            )[0]

        def cross(y):
            out = self.cross_attention(y.transpose(0, 1), context.transpose(0, 1), None, text_mask)
            return out.transpose(0, 1)

        x = token_adaln_branch(hidden_states, mods, 0, self.input_layernorm, attention)
        if context is not None:
            x = token_adaln_branch(x, mods, 1, self.pre_cross_attn_layernorm, cross)
        x = token_adaln_branch(x, mods, 2, self.pre_mlp_layernorm, self._mlp)
        return x.contiguous(), context
