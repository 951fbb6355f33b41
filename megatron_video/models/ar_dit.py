"""Causal autoregressive video DiT for teacher forcing under Balanced SP (flow matching).

``ARVideoDiT`` is the ``VideoDiT`` shell with ``ARDiTLayer`` layers (``models.ar_dit_layer``) on
a rank's local teacher-forcing sequence ``[clean_r ; noisy_r]`` (``layouts.balanced_sp``,
``diffusion.teacher_forcing``): per-token timesteps, the teacher-forcing mask and 3D RoPE from the
token's global latent frame. It follows ``TeacherForcingObjective``'s contract
``model(x [b, s, C], t [b, s], *, frame_positions, token_ids, mask, ...) -> [b, s, C]``.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.ar_dit_layer import ARDiTLayer  # noqa: F401  (re-exported)
from megatron_video.models.dit_blocks import rope_3d_angles, rope_embedding
from megatron_video.models.dit_layer import DiTParams
from megatron_video.models.dit_layer_specs import check_layer_backend, get_ar_dit_layer_spec  # noqa: F401  (re-exported)
from megatron_video.models.packed import pack_context, packed_attention_mask, packed_rope
from megatron_video.models.video_dit import VideoDiT, VideoDiTConfig

__all__ = ["ARVideoDiT", "ar_rope_thw"]


def ar_rope_thw(
    frame_positions: torch.Tensor, token_ids: torch.Tensor, geometry: VideoGeometry
) -> torch.Tensor:
    """``[s, 3]`` (latent frame, row, column) of teacher-forcing tokens; both halves share them."""
    spatial = token_ids % geometry.positions
    return torch.stack(
        [frame_positions, spatial // geometry.width, spatial % geometry.width], dim=-1
    )


class ARVideoDiT(VideoDiT):
    """Causal AR DiT on a Balanced SP teacher-forcing sequence (see the module docstring).

    ``forward(x, t, *, frame_positions, token_ids, mask, caption_ids, caption_mask, geometry,
    drop=None)``: ``x [b, s_local, patch_dim]`` (first stage), ``t [b, s_local]`` per-token flow
    timesteps, ``frame_positions / token_ids [s_local]`` from the layout, ``mask`` the
    teacher-forcing ``AttentionMask``, ``geometry`` the latent token grid ``(F, H', W')``.
    Returns the velocity ``[b, s_local, patch_dim]`` on the last stage, hidden states otherwise.

    A packed micro-batch (docs/architecture.md, "Packed micro-batches in the models"):
    ``geometry`` a ``PackedVideo`` of teacher-forcing clips, ``x [1, s_local, patch_dim]`` /
    ``t [1, s_local]`` at the ids ``placement.rank_ids(cp_rank)`` (``placement`` None only at
    CP = 1), ``caption_ids / caption_mask [C, L]``, ``drop [C]``; ``frame_positions`` and
    ``token_ids`` must be None (each token's grid position comes from its clip), ``mask`` None
    (the clips' teacher-forcing mask, ``models.packed``) or an override.
    """

    def __init__(
        self,
        config: VideoDiTConfig,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        layer_spec: Optional[ModuleSpec] = None,
    ):
        if config.patch_size[0] != 1:
            raise ValueError(
                f"patch_size ({config.patch_size}) must have a temporal patch of 1 for "
                f"the AR DiT (a latent frame is the autoregressive unit)"
            )
        # Same embedders, stage split and checkpoint layout as VideoDiT; only the layers differ.
        if layer_spec is None:
            check_layer_backend(config.layer_backend)
            layer_spec = get_ar_dit_layer_spec(
                config.lora_rank, config.text_dim, backend=config.layer_backend
            )
        super().__init__(
            config, pre_process, post_process, layer_spec=layer_spec, vp_stage=vp_stage
        )

    def forward(
        self,
        x: Optional[torch.Tensor],
        t: torch.Tensor,
        *,
        frame_positions: Optional[torch.Tensor] = None,
        token_ids: Optional[torch.Tensor] = None,
        mask: Optional[AttentionMask] = None,
        caption_ids: torch.Tensor,
        caption_mask: torch.Tensor,
        geometry: VideoGeometry,
        drop: Optional[torch.Tensor] = None,
        placement: Optional[Placement] = None,
    ) -> torch.Tensor:
        if isinstance(geometry, PackedVideo):
            if frame_positions is not None or token_ids is not None:
                raise ValueError(
                    "frame_positions and token_ids must be None for a packed micro-batch "
                    "(geometry PackedVideo): each token's position comes from its clip"
                )
            return self._forward_ar_packed(
                x, t, mask, caption_ids, caption_mask, geometry, drop, placement
            )
        if frame_positions is None or token_ids is None or placement is not None:
            raise ValueError(
                "frame_positions and token_ids must be given and placement None unless "
                "geometry is a PackedVideo"
            )
        b, s = t.shape
        D = self.config.hidden_size
        c = self.t_embedder(t.reshape(-1) * self.config.timestep_scale).view(b, s, D)
        ctx, ctx_mask = self.text_embedder(caption_ids, caption_mask, drop)
        rope = None
        if self.config.rope_theta is not None:
            head_dim = self.config.kv_channels
            rope = rope_embedding(
                rope_3d_angles(
                    ar_rope_thw(frame_positions.cpu(), token_ids.cpu(), geometry),
                    head_dim,
                    self.config.rope_theta,
                )
            )
        hidden = None
        if self.pre_process:
            if x is None or tuple(x.shape) != (b, s, self.config.patch_dim):
                raise ValueError(
                    f"x ({None if x is None else tuple(x.shape)}) must be [b, s_local, "
                    f"patch_dim] = [{b}, {s}, {self.config.patch_dim}]"
                )
            hidden = self.patch_embed(x).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=c.transpose(0, 1).contiguous(),
            geometry=geometry,
            attention_mask=mask,
            rotary_pos_emb=rope,
        )
        out = self.decoder(
            hidden, params, context=ctx.transpose(0, 1).contiguous(), context_mask=ctx_mask
        )
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)

    def _forward_ar_packed(self, x, t, mask, caption_ids, caption_mask, packed, drop, placement):
        """``forward`` on a packed micro-batch of teacher-forcing clips (class docstring)."""
        ids, _ = self._packed_inputs(
            packed,
            "teacher_forcing",
            x,
            self.config.patch_dim,
            placement,
            dict(caption_ids=caption_ids, caption_mask=caption_mask, drop=drop),
            mask,
        )
        s, D = ids.numel(), self.config.hidden_size
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (1, s):
            raise ValueError(
                f"t ({tuple(getattr(t, 'shape', ())) or None}) must be the per-token timesteps "
                f"[1, s_local] = [1, {s}] of a packed micro-batch"
            )
        c = self.t_embedder(t.reshape(-1) * self.config.timestep_scale).view(1, s, D)
        ctx, ctx_mask = pack_context(*self.text_embedder(caption_ids, caption_mask, drop))
        rope = None
        if self.config.rope_theta is not None:
            rope = packed_rope(packed, ids, self.config.kv_channels, self.config.rope_theta)
        hidden = None
        if self.pre_process:
            hidden = self.patch_embed(x).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=c.transpose(0, 1).contiguous(),
            attention_mask=packed_attention_mask(packed) if mask is None else mask,
            rotary_pos_emb=rope,
            packed=packed,
            placement=placement,
        )
        out = self.decoder(hidden, params, context=ctx, context_mask=ctx_mask)
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)
