"""Causal autoregressive video DiT for teacher forcing under Balanced SP (flow matching).

The input is a rank's local teacher-forcing sequence ``[clean_r ; noisy_r]`` (see
``layouts.balanced_sp`` and ``diffusion.teacher_forcing``): every token carries its own timestep
(0 on the clean half, its block's ``t`` on the noisy half), so AdaLN-LoRA modulation is per token.
Self-attention is 2D attention over the CP group with the teacher-forcing mask (an
``AttentionMask`` on attention-order positions, ``scheme="contiguous"``: the rank-major order is
the attention order); 3D RoPE uses the token's global latent frame (both halves share it) and its
spatial position; cross-attention to the whole text runs without CP; MLP; final AdaLN layer.

Layer call convention (Megatron ``TransformerBlock`` slots): ``hidden_states [s, b, D]``,
``attention_mask`` = per-token conditioning ``[s, b, D]``, ``context [L, b, D_c]``,
``context_mask [b, L]``, ``packed_seq_params`` = ``ARSeqParams`` (mask + RoPE angles).
The model follows ``TeacherForcingObjective``'s contract
``model(x [b, s, C], t [b, s], *, frame_positions, token_ids, mask, ...) -> [b, s, C]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention import dist_attention
from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.dit_blocks import (AdaLNLoRAModulation, DiTAttentionSubmodules,
                                              DiTCrossAttention, DiTCrossAttentionSubmodules,
                                              DiTSelfAttention, rope_3d_angles)
from megatron_video.models.dit_layer import DiTLayerBase
from megatron_video.models.video_dit import VideoDiT, VideoDiTConfig
from megatron_video.parallel.comm import check_same_shape

__all__ = ["ARSeqParams", "ARDiTLayerSubmodules", "ARDiTLayer", "get_ar_dit_layer_spec",
           "ARVideoDiT", "ar_rope_thw"]


@dataclass
class ARSeqParams(PackedSeqParams):
    """Per-batch attention description for ``ARDiTLayer`` (through Megatron's packed-seq slot)."""

    attention_mask: Optional[AttentionMask] = None   # on attention-order positions
    rope_angles: Optional[torch.Tensor] = None       # [s_local, head_dim/2]


@dataclass
class ARDiTLayerSubmodules:
    modulation: Union[ModuleSpec, type] = AdaLNLoRAModulation
    self_attention: Union[ModuleSpec, type] = None
    cross_attention: Union[ModuleSpec, type] = None
    mlp: Union[ModuleSpec, type] = None


def get_ar_dit_layer_spec(lora_rank: int = 256, context_dim: Optional[int] = None) -> ModuleSpec:
    """``ModuleSpec`` of ``ARDiTLayer`` for Megatron's ``TransformerBlock``."""
    return ModuleSpec(
        module=ARDiTLayer,
        params=dict(lora_rank=lora_rank, context_dim=context_dim),
        submodules=ARDiTLayerSubmodules(
            modulation=AdaLNLoRAModulation,
            self_attention=ModuleSpec(module=DiTSelfAttention, submodules=DiTAttentionSubmodules()),
            cross_attention=ModuleSpec(module=DiTCrossAttention,
                                       submodules=DiTCrossAttentionSubmodules()),
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))),
    )


def _token_modulate(x, shift, scale):
    return x * (1 + scale) + shift


class ARDiTLayer(DiTLayerBase):
    """Teacher-forcing DiT block with per-token AdaLN-LoRA; see the module docstring."""

    sequence_parallel_reason = "its sequence is already split by Balanced SP"

    def __init__(self, config: TransformerConfig, submodules: ARDiTLayerSubmodules,
                 layer_number: int = 1, pg_collection=None, vp_stage: Optional[int] = None,
                 lora_rank: int = 256, context_dim: Optional[int] = None):
        super().__init__(config, layer_number, vp_stage)
        self._build_dit_submodules(submodules, lora_rank, context_dim)

    def _attention(self, x, params: ARSeqParams):
        angles = None if params.rope_angles is None else params.rope_angles.to(x.device)
        q, k, v = self.self_attention.qkv(x, angles)
        o = dist_attention(q, k, v, self.groups, mask=params.attention_mask, scheme="contiguous")
        return self.self_attention.project(o)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[ARSeqParams] = None, **unused):
        """``hidden_states [s, b, D]`` -> ``([s, b, D], context)``; see the module docstring."""
        if not isinstance(packed_seq_params, ARSeqParams):
            raise ValueError(f"packed_seq_params ({type(packed_seq_params).__name__}) must be an "
                             f"ARSeqParams (teacher-forcing mask and RoPE angles)")
        s, b, D = hidden_states.shape
        cond = attention_mask
        if cond is None or tuple(cond.shape) != (s, b, D):
            raise ValueError(f"attention_mask (per-token conditioning) must be [s, b, D] = "
                             f"[{s}, {b}, {D}], got {None if cond is None else tuple(cond.shape)}")
        if self.groups is not None and self.groups.cp_size > 1:
            shapes = {"hidden_states": hidden_states}
            if context is not None:
                shapes["context"] = context
            check_same_shape(shapes, self.groups.cp_group, where="ARDiTLayer")
        mods = self.modulation(cond.transpose(0, 1))                       # 9 x [b, s, D]
        eps = self.config.layernorm_epsilon

        def branch(i, x, f):
            shift, scale, gate = mods[3 * i:3 * i + 3]
            return x + gate * f(_token_modulate(F.layer_norm(x, (D,), eps=eps), shift, scale))

        x = hidden_states.transpose(0, 1)
        x = branch(0, x, lambda y: self._attention(y, packed_seq_params))
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch(1, x, lambda y: self.cross_attention(y, ctx, context_mask))
        x = branch(2, x, self._mlp)
        return x.transpose(0, 1).contiguous(), context


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
                 vp_stage: Optional[int] = None):
        if config.patch_size[0] != 1:
            raise ValueError(f"patch_size ({config.patch_size}) must have a temporal patch of 1 for "
                             f"the AR DiT (a latent frame is the autoregressive unit)")
        # Same embedders, stage split and checkpoint layout as VideoDiT; only the layers differ.
        super().__init__(config, pre_process, post_process,
                         layer_spec=get_ar_dit_layer_spec(config.lora_rank, config.text_dim),
                         vp_stage=vp_stage)

    def forward(self, x: Optional[torch.Tensor], t: torch.Tensor, *, frame_positions: torch.Tensor,
                token_ids: torch.Tensor, mask: Optional[AttentionMask], caption_ids: torch.Tensor,
                caption_mask: torch.Tensor, geometry: VideoGeometry,
                drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = t.shape
        D = self.config.hidden_size
        c = self.t_embedder(t.reshape(-1) * self.config.timestep_scale).view(b, s, D)
        ctx, ctx_mask = self.text_embedder(caption_ids, caption_mask, drop)
        angles = None
        if self.config.rope_theta is not None:
            head_dim = self.config.kv_channels
            angles = rope_3d_angles(ar_rope_thw(frame_positions.cpu(), token_ids.cpu(), geometry),
                                    head_dim, self.config.rope_theta)
        hidden = None
        if self.pre_process:
            if x is None or tuple(x.shape) != (b, s, self.config.patch_dim):
                raise ValueError(f"x ({None if x is None else tuple(x.shape)}) must be [b, s_local, "
                                 f"patch_dim] = [{b}, {s}, {self.config.patch_dim}]")
            hidden = self.patch_embed(x).transpose(0, 1).contiguous()
        out = self.decoder(hidden, attention_mask=c.transpose(0, 1).contiguous(),
                           context=ctx.transpose(0, 1).contiguous(), context_mask=ctx_mask,
                           packed_seq_params=ARSeqParams(attention_mask=mask, rope_angles=angles))
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)

