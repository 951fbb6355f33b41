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
from megatron_video.diffusion.ti2v import (
    check_first_frame_patch,
    condition,
    condition_inputs,
    condition_loss_tokens,
)
from megatron_video.layouts.stdit import VideoGeometry

from .batches.fixed import MicroBatch

__all__ = [
    "EDMObjective",
    "FlowObjective",
    "TeacherForcing",
    "WanFlowObjective",
    "WanTeacherForcing",
    "WAN_NUM_TIMESTEPS",
    "PackedObjective",
]


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


# ----------------------------------------------------------------------------------------------
# Wan (training/families/wan.py): the same flow matching, Wan's model interface
# ----------------------------------------------------------------------------------------------
WAN_NUM_TIMESTEPS = 1000.0  # Wan's scheduler: the model takes the timestep t * 1000


def wan_text(mb: MicroBatch) -> Tensor:
    """The text Wan attends to: the precomputed caption embeddings ``[b, L, text_dim]`` with padded
    positions zeroed (Wan's UMT5 convention) and all zeros for CFG-dropped samples."""
    emb = mb.caption_ids
    if not torch.is_floating_point(emb) or emb.dim() != 3:
        raise ValueError(
            f"caption_ids ({tuple(emb.shape)}, {emb.dtype}) must be precomputed text embeddings "
            f"[b, L, text_dim] (data.text_embed_dim; `megatron-video precompute --text-encoder`)"
        )
    keep = mb.caption_mask.to(emb.dtype)[..., None] * (~mb.drop).to(emb.dtype)[:, None, None]
    return emb * keep


def wan_to_patchify_order(output: Tensor, patch, channels: int) -> Tensor:
    """Wan's ``proj_out`` channel order ``(pt, ph, pw, C)`` -> ``embedders.patchify``'s
    ``(C, pt, ph, pw)``, so the loss compares like with like."""
    b, s, _ = output.shape
    x = output.reshape(b, s, *patch, channels)
    return x.permute(0, 1, 5, 2, 3, 4).reshape(b, s, -1)


class WanFlowObjective(FlowObjective):
    """Wan T2V / TI2V: ``FlowObjective`` (``x_t = (1 - t) x0 + t eps``, velocity ``eps - x0``, t
    drawn shifted by ``diffusion.flow_shift`` in ``batches.fixed.FixedBatchMaker``) with Wan's
    interface: timestep ``1000 t`` (per token when ``per_token``, Wan 2.2 TI2V), the text from
    ``wan_text``. ``i2v``: the micro-batch's I2V samples (``mb.i2v``) are conditioned on their
    first latent frame (``diffusion.ti2v``: clean, timestep 0, no loss; per-token timesteps);
    ``cp_rank`` places this rank's contiguous token share."""

    def __init__(
        self,
        geometry: VideoGeometry,
        patch,
        channels: int,
        per_token: bool,
        cp: int,
        cp_rank: int = 0,
        i2v: bool = False,
    ):
        super().__init__(geometry)
        self.patch, self.channels, self.per_token = tuple(patch), channels, per_token
        self.s_local = geometry.tokens // cp
        self.first = None  # [s_local] bool: this rank's tokens of latent frame 0 (I2V)
        if i2v:
            check_first_frame_patch(self.patch)
            ids = torch.arange(cp_rank * self.s_local, (cp_rank + 1) * self.s_local)
            self.first = ids < geometry.positions

    def _cond(self, mb: MicroBatch):
        return None if self.first is None else condition(mb.i2v, self.first)

    def model_call(self, mb: MicroBatch, first_stage: bool) -> Tuple[tuple, dict]:
        (tokens, t, *_), _ = super().model_call(mb, first_stage)
        t = WAN_NUM_TIMESTEPS * t
        if self.per_token or self.first is not None:
            t = t[:, None].expand(-1, self.s_local).contiguous()
            tokens, t = condition_inputs(self._cond(mb), tokens, mb.clean, t)
        return (tokens, t, wan_text(mb), self.geometry), {}

    def loss(self, output: Tensor, mb: MicroBatch) -> Tensor:
        output = wan_to_patchify_order(output, self.patch, self.channels)
        if self.first is None:
            return super().loss(output, mb)
        target = fm_target(mb.clean, mb.noise)
        per_element = (output.to(_acc(target)) - target.to(_acc(target))) ** 2
        n = condition_loss_tokens(mb.i2v, self.tokens_per_sample, self.geometry.positions)
        return reduce_token_loss(per_element, ~self._cond(mb).to(output.device), n)


class WanTeacherForcing(TeacherForcing):
    """``wan_ar``: ``TeacherForcing`` (``[clean_r ; noisy_r]`` on the Balanced SP layout,
    per-block timesteps, the teacher-forcing mask) with Wan's interface: per-token timestep
    ``1000 t``, RoPE ids from the layout's frame positions, the mask to the 2D attention.
    ``i2v``: in the I2V samples the noisy copy of latent frame 0 (on the rank the layout gives
    it) is the clean latent with timestep 0 and no loss (``diffusion.ti2v``)."""

    def __init__(self, layout, groups, geometry: VideoGeometry, patch, channels: int, i2v=False):
        super().__init__(layout, groups, geometry)
        self.patch, self.channels = tuple(patch), channels
        self.first = None  # [L] bool: the noisy copy's tokens of latent frame 0 (I2V)
        if i2v:
            check_first_frame_patch(self.patch)
            self.first = self.tf.frame_positions == 0
            self.first[: self.half] = False  # the clean copy: timestep 0, no loss already

    def _cond(self, mb: MicroBatch):
        return None if self.first is None else condition(mb.i2v, self.first)

    def model_call(self, mb: MicroBatch, first_stage: bool) -> Tuple[tuple, dict]:
        (x, t), kw = super().model_call(mb, first_stage)
        if self.first is not None:
            clean = None if x is None else torch.cat([mb.clean, mb.clean], dim=1)
            x, t = condition_inputs(self._cond(mb), x, clean, t)
        g = self.geometry
        positions = kw["frame_positions"] * g.positions + kw["token_ids"] % g.positions
        return (x, WAN_NUM_TIMESTEPS * t, wan_text(mb), g), dict(
            attention_mask=kw["mask"], positions=positions
        )

    def loss(self, output: Tensor, mb: MicroBatch) -> Tensor:
        output = wan_to_patchify_order(output, self.patch, self.channels)
        if self.first is None:
            return super().loss(output, mb)
        target = fm_target(mb.clean, mb.noise)
        acc = _acc(target)
        per_element = (output[:, self.half :].to(acc) - target.to(acc)) ** 2
        keep = ~self._cond(mb)[:, self.half :].to(output.device)
        L = self.layout
        n = condition_loss_tokens(mb.i2v, L.num_loss_tokens, L.tokens_per_frame)
        return reduce_token_loss(per_element, keep, n)


# ----------------------------------------------------------------------------------------------
# Packed micro-batches of mixed-shape clips (data.buckets; training/batches/packed.py)
# ----------------------------------------------------------------------------------------------
class PackedObjective:
    """The packed micro-batch of one CP rank (``batches.packed.PackedMicroBatch``) through the
    family's packed model call; the loss share ``sum over this rank's loss tokens / loss tokens
    of the global step``, times ``mb.scale`` (undoes Megatron's micro-batch / DDP averaging; 0 for
    a dummy micro-batch). ``objective``: ``flow`` / ``edm`` (full clips) or ``teacher_forcing``;
    ``wan``: Wan's interface (timestep ``1000 t``, text from ``wan_text``, output channel order)."""

    def __init__(self, objective: str, sigma_data: float = 1.0, wan=None):
        self.objective, self.sigma_data = objective, sigma_data
        self.wan = wan  # (patch, latent channels) for the Wan families, else None

    def _noisy_edm(self, mb):
        from megatron_video.models.packed import per_clip_to_tokens

        clip = mb.packed.clip_of(mb.local.cpu()).to(mb.x.device)
        scal = [s.to(mb.x.dtype) for s in edm_scalings(mb.sigma.double(), self.sigma_data)]
        c_skip, c_out, c_in, _ = (per_clip_to_tokens(s, clip)[None, :, None] for s in scal)
        sigma = per_clip_to_tokens(mb.sigma.to(mb.x.dtype), clip)[None, :, None]
        w = per_clip_to_tokens(edm_loss_weight(mb.sigma.to(_acc(mb.x)), self.sigma_data), clip)
        return mb.x + sigma * mb.noise, c_skip, c_out, c_in, w[None]

    def model_call(self, mb, first_stage: bool) -> Tuple[tuple, dict]:
        if self.objective == "teacher_forcing":
            x, t = mb.x, mb.t
            if getattr(mb, "tf_mix", False):  # batches.placed: mixed here, in the model's dtype
                x = fm_interpolate(mb.x, mb.noise, mb.t.to(mb.x.dtype))
        elif self.objective == "edm":
            x_noisy, _, _, c_in, _ = self._noisy_edm(mb)
            x, t = c_in * x_noisy, edm_scalings(mb.sigma.double(), self.sigma_data)[3].float()
        else:
            clip = mb.packed.clip_of(mb.local.cpu()).to(mb.x.device)
            from megatron_video.models.packed import per_clip_to_tokens

            t_tok = per_clip_to_tokens(mb.t.to(mb.x.dtype), clip)[None]
            x, t = fm_interpolate(mb.x, mb.noise, t_tok), mb.t
            cond = getattr(mb, "condition", None)  # I2V first frames (batches.placed)
            if cond is not None:
                x, t = condition_inputs(cond.to(mb.x.device), x, mb.x, t_tok)
        x = x if first_stage else None
        if self.wan is not None:
            return (x, WAN_NUM_TIMESTEPS * t, wan_text(mb), mb.packed), dict(placement=mb.placement)
        if self.objective == "teacher_forcing":
            kw = dict(caption_ids=mb.caption_ids, caption_mask=mb.caption_mask)
            return (x, t), dict(kw, geometry=mb.packed, drop=mb.drop, placement=mb.placement)
        return (x, t, mb.caption_ids, mb.caption_mask, mb.packed), dict(
            drop=mb.drop, placement=mb.placement
        )

    def loss(self, output: Tensor, mb) -> Tensor:
        from megatron_video.diffusion.packed import packed_token_loss

        if self.wan is not None:
            output = wan_to_patchify_order(output, *self.wan)
        weight = None
        if self.objective == "teacher_forcing":
            pred, target = output, mb.target
            if getattr(mb, "tf_mix", False):  # the velocity on the noisy copy (loss_mask: only it)
                target = fm_target(mb.x, mb.noise)
        elif self.objective == "edm":
            x_noisy, c_skip, c_out, _, weight = self._noisy_edm(mb)
            pred, target = c_skip * x_noisy + c_out * output.to(x_noisy.dtype), mb.x
        else:
            pred, target = output, fm_target(mb.x, mb.noise)
        share = packed_token_loss(pred, target, mb.loss_mask, mb.num_loss_tokens, weight)
        return share * mb.scale
