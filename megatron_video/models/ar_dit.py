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
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.ar_dit_layer import ARDiTLayer  # noqa: F401  (re-exported)
from megatron_video.models.dit_blocks import rope_3d_angles, rope_embedding
from megatron_video.models.dit_layer import DiTParams
from megatron_video.models.dit_layer_specs import check_layer_backend, get_ar_dit_layer_spec  # noqa: F401  (re-exported)
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
        frame_positions: torch.Tensor,
        token_ids: torch.Tensor,
        mask: Optional[AttentionMask],
        caption_ids: torch.Tensor,
        caption_mask: torch.Tensor,
        geometry: VideoGeometry,
        drop: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
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
