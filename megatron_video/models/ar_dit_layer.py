"""``ARDiTLayer``: the teacher-forcing DiT block with per-token AdaLN-LoRA, a Megatron
``TransformerLayer``. Self-attention is 2D attention over the CP group with the teacher-forcing
mask (given per call in ``DiTParams``); cross-attention to the whole text without CP; MLP. Its
spec: ``models.dit_layer_specs.get_ar_dit_layer_spec``; the model: ``models.ar_dit``.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.models.dit_layer import DiTLayerBase, DiTLayerSubmodules, DiTParams

__all__ = ["ARDiTLayer"]


def _token_modulate(x, shift, scale):
    return x * (1 + scale) + shift


class ARDiTLayer(DiTLayerBase):
    """Teacher-forcing DiT block with per-token AdaLN-LoRA.

    ``forward(hidden_states [s, b, D], context=[L, b, D_c], context_mask=[b, L], params=DiTParams)``
    with ``params.conditioning [s, b, D]`` per token, ``params.attention_mask`` the teacher-forcing
    ``AttentionMask`` and ``params.rotary_pos_emb`` the RoPE -> ``([s, b, D], context)``.

    A packed micro-batch (``params.packed``, teacher-forcing clips, batch 1): the same, with
    ``params.placement`` passed to the core attention and cross-attention to the packed captions
    ``[num_clips·L, 1, D_c]`` masked per clip.
    """

    sequence_parallel_reason = "its sequence is already split by Balanced SP"
    params_what = "per-token conditioning, teacher-forcing mask, RoPE"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DiTLayerSubmodules,
        layer_number: int = 1,
        lora_rank: int = 256,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, **kwargs)
        self._build_modulation(submodules.modulation, 9, lora_rank)

    def _forward(self, hidden_states, context, context_mask, params: DiTParams):
        """``hidden_states [s, b, D]`` -> ``([s, b, D], context)``; see the class docstring."""
        s, b, D = hidden_states.shape
        cond = self._check_conditioning(
            params.conditioning, (s, b, D), "params.conditioning (per-token) must be [s, b, D]"
        )
        text_mask, extra = None, {}
        if params.packed is not None:
            _, clip = self._packed_tokens(params, hidden_states, "teacher_forcing")
            text_mask = self._packed_text_mask(params, clip, context, context_mask)
            context_mask, extra = None, dict(placement=params.placement)
        self._check_same_shapes(params.packed, hidden_states=hidden_states, context=context)
        mods = self.modulation(cond)  # 9 x [s, b, D]
        rope = params.rotary_pos_emb
        if rope is not None:
            rope = rope.to(hidden_states.device)

        def branch(i, x, norm, f):
            shift, scale, gate = mods[3 * i : 3 * i + 3]
            return x + gate * f(_token_modulate(norm(x), shift, scale))

        def attention(y):
            return self.self_attention(
                y, attention_mask=params.attention_mask, rotary_pos_emb=rope, **extra
            )[0]

        x = hidden_states
        x = branch(0, x, self.input_layernorm, attention)
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch(
                1,
                x,
                self.pre_cross_attn_layernorm,
                lambda y: self.cross_attention(
                    y.transpose(0, 1), ctx, context_mask, text_mask, params.attention_mask
                ).transpose(0, 1),
            )
        x = branch(2, x, self.pre_mlp_layernorm, self._mlp)
        return x.contiguous(), context
