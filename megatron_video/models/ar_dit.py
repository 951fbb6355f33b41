"""Causal autoregressive video DiT for teacher forcing under Balanced SP (flow matching).

The input is a rank's local teacher-forcing sequence ``[clean_r ; noisy_r]`` (see
``layouts.balanced_sp`` and ``diffusion.teacher_forcing``): every token carries its own timestep
(0 on the clean half, its block's ``t`` on the noisy half), so AdaLN-LoRA modulation is per token.
Self-attention is 2D attention over the CP group with the teacher-forcing mask (an
``AttentionMask`` on attention-order positions, ``scheme="contiguous"``: the rank-major order is
the attention order); 3D RoPE uses the token's global latent frame (both halves share it) and its
spatial position; cross-attention to the whole text runs without CP; MLP; final AdaLN layer.

Layer call convention (``models.video_dit``): ``hidden_states [s, b, D]``, ``context [L, b,
D_c]``, ``context_mask [b, L]`` and ``params`` a ``DiTParams`` with the per-token conditioning
``[s, b, D]``, the teacher-forcing ``attention_mask`` (given to the 2D core attention per call)
and the RoPE ``rotary_pos_emb``.
The model follows ``TeacherForcingObjective``'s contract
``model(x [b, s, C], t [b, s], *, frame_positions, token_ids, mask, ...) -> [b, s, C]``.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.dit_blocks import rope_3d_angles, rope_embedding
from megatron_video.models.dit_layer import DiTLayerBase, DiTLayerSubmodules, DiTParams
from megatron_video.models.video_dit import (VideoDiT, VideoDiTConfig, check_layer_backend,
                                             full_attention_layer_spec)
from megatron_video.parallel.comm import check_same_shape

__all__ = ["ARDiTLayer", "get_ar_dit_layer_spec",
           "ARVideoDiT", "ar_rope_thw"]


def get_ar_dit_layer_spec(lora_rank: int = 256, context_dim: Optional[int] = None,
                          backend: str = "local") -> ModuleSpec:
    """``ModuleSpec`` of ``ARDiTLayer`` for Megatron's ``TransformerBlock`` (``backend`` as
    ``get_video_dit_layer_spec``); the self-attention core is the 2D attention, which takes the
    teacher-forcing mask per call."""
    return full_attention_layer_spec(ARDiTLayer, dict(lora_rank=lora_rank), context_dim, backend)


def _token_modulate(x, shift, scale):
    return x * (1 + scale) + shift


class ARDiTLayer(DiTLayerBase):
    """Teacher-forcing DiT block with per-token AdaLN-LoRA; see the module docstring."""

    sequence_parallel_reason = "its sequence is already split by Balanced SP"

    def __init__(self, config: TransformerConfig, submodules: DiTLayerSubmodules,
                 layer_number: int = 1, lora_rank: int = 256, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self._build_modulation(submodules.modulation, 9, lora_rank)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                params: Optional[DiTParams] = None, rotary_pos_emb=None, attention_bias=None,
                packed_seq_params=None, **unused):
        """``hidden_states [s, b, D]`` -> ``([s, b, D], context)``; see the module docstring."""
        params = self._check_params(params, "per-token conditioning, teacher-forcing mask, RoPE", dict(
            attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params))
        s, b, D = hidden_states.shape
        cond = params.conditioning
        if not isinstance(cond, torch.Tensor) or tuple(cond.shape) != (s, b, D):
            raise ValueError(f"params.conditioning (per-token) must be [s, b, D] = [{s}, {b}, {D}], "
                             f"got {tuple(getattr(cond, 'shape', ())) or None}")
        if self.groups is not None and self.groups.cp_size > 1:
            shapes = {"hidden_states": hidden_states}
            if context is not None:
                shapes["context"] = context
            check_same_shape(shapes, self.groups.cp_group, where="ARDiTLayer")
        mods = self.modulation(cond)                                   # 9 x [s, b, D]
        rope = params.rotary_pos_emb
        if rope is not None:
            rope = rope.to(hidden_states.device)

        def branch(i, x, norm, f):
            shift, scale, gate = mods[3 * i:3 * i + 3]
            return x + gate * f(_token_modulate(norm(x), shift, scale))

        def attention(y):
            return self.self_attention(y, attention_mask=params.attention_mask,
                                       rotary_pos_emb=rope)[0]

        x = hidden_states
        x = branch(0, x, self.input_layernorm, attention)
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch(1, x, self.pre_cross_attn_layernorm,
                       lambda y: self.cross_attention(y.transpose(0, 1), ctx,
                                                      context_mask).transpose(0, 1))
        x = branch(2, x, self.pre_mlp_layernorm, self._mlp)
        return x.contiguous(), context


def ar_rope_thw(frame_positions: torch.Tensor, token_ids: torch.Tensor,
                geometry: VideoGeometry) -> torch.Tensor:
    """``[s, 3]`` (latent frame, row, column) of teacher-forcing tokens; both halves share them."""
    spatial = token_ids % geometry.positions
    return torch.stack([frame_positions, spatial // geometry.width, spatial % geometry.width], dim=-1)


class ARVideoDiT(VideoDiT):
    """Causal AR DiT on a Balanced SP teacher-forcing sequence (see the module docstring).

    ``forward(x, t, *, frame_positions, token_ids, mask, caption_ids, caption_mask, geometry,
    drop=None)``: ``x [b, s_local, patch_dim]`` (first stage), ``t [b, s_local]`` per-token flow
    timesteps, ``frame_positions / token_ids [s_local]`` from the layout, ``mask`` the
    teacher-forcing ``AttentionMask``, ``geometry`` the latent token grid ``(F, H', W')``.
    Returns the velocity ``[b, s_local, patch_dim]`` on the last stage, hidden states otherwise.
    """

    def __init__(self, config: VideoDiTConfig, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, layer_spec: Optional[ModuleSpec] = None):
        if config.patch_size[0] != 1:
            raise ValueError(f"patch_size ({config.patch_size}) must have a temporal patch of 1 for "
                             f"the AR DiT (a latent frame is the autoregressive unit)")
        # Same embedders, stage split and checkpoint layout as VideoDiT; only the layers differ.
        if layer_spec is None:
            check_layer_backend(config.layer_backend)
            layer_spec = get_ar_dit_layer_spec(config.lora_rank, config.text_dim,
                                               backend=config.layer_backend)
        super().__init__(config, pre_process, post_process, layer_spec=layer_spec,
                         vp_stage=vp_stage)

    def forward(self, x: Optional[torch.Tensor], t: torch.Tensor, *, frame_positions: torch.Tensor,
                token_ids: torch.Tensor, mask: Optional[AttentionMask], caption_ids: torch.Tensor,
                caption_mask: torch.Tensor, geometry: VideoGeometry,
                drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = t.shape
        D = self.config.hidden_size
        c = self.t_embedder(t.reshape(-1) * self.config.timestep_scale).view(b, s, D)
        ctx, ctx_mask = self.text_embedder(caption_ids, caption_mask, drop)
        rope = None
        if self.config.rope_theta is not None:
            head_dim = self.config.kv_channels
            rope = rope_embedding(rope_3d_angles(
                ar_rope_thw(frame_positions.cpu(), token_ids.cpu(), geometry), head_dim,
                self.config.rope_theta))
        hidden = None
        if self.pre_process:
            if x is None or tuple(x.shape) != (b, s, self.config.patch_dim):
                raise ValueError(f"x ({None if x is None else tuple(x.shape)}) must be [b, s_local, "
                                 f"patch_dim] = [{b}, {s}, {self.config.patch_dim}]")
            hidden = self.patch_embed(x).transpose(0, 1).contiguous()
        params = DiTParams(conditioning=c.transpose(0, 1).contiguous(), geometry=geometry,
                           attention_mask=mask, rotary_pos_emb=rope)
        out = self.decoder(hidden, params, context=ctx.transpose(0, 1).contiguous(),
                           context_mask=ctx_mask)
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)

