"""Training objectives: glue between a micro-batch and the models (per CP rank, per stage).

The family picks one (``FamilySpec.make_objective``). Each turns a micro-batch into this rank's
model call and the output into this rank's loss SHARE: a sum over its loss tokens divided by the
GLOBAL number of loss tokens of the micro-batch, so the shares of a CP group sum to the
single-process loss (Megatron's schedule multiplies by the CP size, DDP averages over DP x CP).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from megatron_video.diffusion.edm import (
    edm_loss_weight,
    edm_scalings,
    expand_like,
    reduce_token_loss,
)
from megatron_video.diffusion.flow_matching import fm_interpolate, fm_target
from megatron_video.diffusion.teacher_forcing import TeacherForcingObjective
from megatron_video.layouts.stdit import VideoGeometry

from .data import MicroBatch

__all__ = ["EDMObjective", "FlowObjective", "TeacherForcing"]


def _acc(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class EDMObjective:
    """VideoDiT / ST-DiT with EDM: preconditioned denoiser, log-normal sigma, weight
    ``1/c_out^2``."""

    def __init__(self, sigma_data: float, geometry: VideoGeometry):
        self.sigma_data, self.geometry = sigma_data, geometry
        self.tokens_per_sample = geometry.tokens

    def _noisy(self, mb: MicroBatch) -> Tensor:
        return mb.clean + expand_like(mb.sigma, mb.clean, "sigma").to(mb.clean.dtype) * mb.noise

    def model_call(self, mb: MicroBatch, first_stage: bool) -> Tuple[tuple, dict]:
        _, _, c_in, c_noise = edm_scalings(mb.sigma.double(), self.sigma_data)
        tokens = None
        if first_stage:
            x = self._noisy(mb)
            tokens = expand_like(c_in, x, "sigma").to(x.dtype) * x
        return (tokens, c_noise.float(), mb.caption_ids, mb.caption_mask, self.geometry), dict(
            drop=mb.drop
        )

    def loss(self, output: Tensor, mb: MicroBatch) -> Tensor:
        x = self._noisy(mb)
        c_skip, c_out, _, _ = (
            expand_like(c, x, "sigma").to(x.dtype)
            for c in edm_scalings(mb.sigma.double(), self.sigma_data)
        )
        denoised = c_skip * x + c_out * output.to(x.dtype)
        w = expand_like(edm_loss_weight(mb.sigma.to(_acc(x)), self.sigma_data), x, "sigma")
        per_element = w * (denoised.to(_acc(x)) - mb.clean.to(_acc(x))) ** 2
        return reduce_token_loss(per_element, None, mb.clean.shape[0] * self.tokens_per_sample)


class FlowObjective:
    """VideoDiT / ST-DiT with flow matching: velocity ``eps - x0``."""

    def __init__(self, geometry: VideoGeometry):
        self.geometry = geometry
        self.tokens_per_sample = geometry.tokens

    def model_call(self, mb: MicroBatch, first_stage: bool) -> Tuple[tuple, dict]:
        tokens = fm_interpolate(mb.clean, mb.noise, mb.t) if first_stage else None
        return (tokens, mb.t, mb.caption_ids, mb.caption_mask, self.geometry), dict(drop=mb.drop)

    def loss(self, output: Tensor, mb: MicroBatch) -> Tensor:
        target = fm_target(mb.clean, mb.noise)
        per_element = (output.to(_acc(target)) - target.to(_acc(target))) ** 2
        return reduce_token_loss(per_element, None, mb.clean.shape[0] * self.tokens_per_sample)


class TeacherForcing:
    """AR DiT: teacher forcing on ``diffusion.teacher_forcing.TeacherForcingObjective``'s layout
    pieces -- ``[clean_r ; noisy_r]`` on the Balanced SP layout, per-block flow timesteps, the
    teacher-forcing mask; loss on the noisy half."""

    def __init__(self, layout, groups, geometry: VideoGeometry):
        self.tf = TeacherForcingObjective(layout, groups if layout.sp_size > 1 else None)
        self.layout, self.geometry = layout, geometry
        self.tokens_per_sample = (
            2 * layout.num_latent_frames * layout.tokens_per_frame
        )  # model tokens
        self.half = layout.local_len // 2

    def _inputs(self, mb: MicroBatch):
        return self.tf.build_inputs(mb.clean, mb.noise, mb.t)

    def model_call(self, mb: MicroBatch, first_stage: bool) -> Tuple[tuple, dict]:
        if first_stage:
            x, t, _ = self._inputs(mb)
        else:  # the per-token timesteps without the latents
            t_noisy = mb.t[:, self.tf.noisy_blocks]
            t, x = torch.cat([torch.zeros_like(t_noisy), t_noisy], dim=1), None
        kwargs = dict(
            frame_positions=self.tf.frame_positions,
            token_ids=self.tf.token_ids,
            mask=self.tf.mask,
            caption_ids=mb.caption_ids,
            caption_mask=mb.caption_mask,
            geometry=self.geometry,
            drop=mb.drop,
        )
        return (x, t), kwargs

    def loss(self, output: Tensor, mb: MicroBatch) -> Tensor:
        target = fm_target(mb.clean, mb.noise)
        acc = _acc(target)
        per_element = (output[:, self.half :].to(acc) - target.to(acc)) ** 2
        n = mb.clean.shape[0] * self.layout.num_loss_tokens
        return reduce_token_loss(per_element, None, n)
