"""Fixed-shape micro-batches placed by token (DESIGN.md capability 11, "Any length at any CP"):
the full-attention families (``video_dit``, ``wan`` T2V / TI2V) at a CP size that does not divide
the clip's token frames (Wan's 21 latent frames at CP 2, 4, 8, 16), and the AR families
(``ar_dit``, ``wan_ar``: teacher-forcing clips ``[clean ; noisy]``) where Balanced SP does not
divide (latent frames not a multiple of CP x ``frames_per_block``: LongLive's 7 blocks of 3).

The micro-batch's ``b`` clips (one fixed shape) become ONE packed sequence (``PackedVideo``,
batch 1: each clip its own attention document and caption), padded to a multiple of ``2·CP`` and
placed over ``U x R`` by ``plan_placement`` -- the machinery of mixed shapes
(``batches.packed``), so a frame may be cut between ranks anywhere. Padding attends nothing, is
never attended and carries no loss (hence no gradient); RoPE and timesteps follow each token's
global id. Each rank reads (or decodes and encodes) only the latent frames its tokens lie on.

Values equal the contiguous fixed-shape path's: the draws of ``fixed.clip_draws`` per clip (same
clip index), the loss ``sum over loss tokens / the micro-batch's loss tokens`` (scale 1, as the
fixed objectives), I2V first-frame tokens (``diffusion.ti2v``) clean with timestep 0 and no loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_video.diffusion.packed import packed_teacher_forcing_inputs
from megatron_video.layouts.packed_video import PackedVideo, VideoClip
from megatron_video.models.embedders import patchify

from ..config import Config
from .fixed import FixedBatchMaker, clip_draws
from .packed import PackedMicroBatch
from .protocol import RankCoords

__all__ = ["PlacedMicroBatch", "PlacedBatchMaker", "tokens_placed"]


def tokens_placed(config: Config, family) -> bool:
    """Whether ``config``'s fixed-shape clips are placed by token (this module) rather than as
    whole frames per CP rank: a full-attention family (not ST-DiT) whose token frames
    (``latent frames / patch_size[0]``) ``context_parallel_size`` does not divide, or an AR family
    whose blocks do not split evenly (latent frames not a multiple of CP x frames_per_block)."""
    from ..config import token_grid_of

    cp = config.parallel.context_parallel_size
    if cp == 1 or family.packed_kind is None or family.layer_type != "full":  # VLMs: no layer_type
        return False
    unit = cp * (config.model.frames_per_block if family.autoregressive else 1)
    return token_grid_of(config)[0] % unit != 0


@dataclass
class PlacedMicroBatch(PackedMicroBatch):
    """``PackedMicroBatch`` of one fixed shape plus first-frame conditioning (TI2V)."""

    i2v: Optional[torch.Tensor] = None  # [C] bool per clip
    condition: Optional[torch.Tensor] = None  # [1, s] bool: clean, t = 0, no loss (I2V frame 0)
    tf_mix: bool = (
        False  # teacher forcing: x clean in both copies, mixed with noise by the objective
    )


class PlacedBatchMaker(FixedBatchMaker):
    """``FixedBatchMaker`` (clips, ledger, draws) whose micro-batches are placed by token; see the
    module docstring. ``layout`` must be None (full attention)."""

    def __init__(self, config: Config, coords: RankCoords, kind: str = "full", log=None, **kw):
        if kw.get("layout") is not None:
            raise ValueError("layout (Balanced SP) must be None for token placement")
        super().__init__(config, coords, **kw)
        self.log = log  # where the first micro-batch's placement and imbalance are printed
        self.U, self.R = coords.ulysses_size, coords.ring_size
        self.kind, fpb = kind, config.model.frames_per_block if kind == "teacher_forcing" else 1
        self.clip = VideoClip(*self.grid, kind=kind, frames_per_block=fpb)
        self.blocks = self.grid[0] // fpb if kind == "teacher_forcing" else 0
        self._plans = {}

    def step_batches(self, step: int):
        mbs = list(super().step_batches(step))
        if self.log is not None and mbs:
            self.log(self.describe(mbs[0]))
            self.log = None
        return iter(mbs)

    def describe(self, mb) -> str:
        """The start-up line: why tokens are placed, the plan and its imbalance."""
        c, p = self.config, self.config.parallel
        unit = "latent frames" if self.kind == "full" else "blocks of latent frames"
        return (
            f"[megatron-video] model.family {c.model.family!r}: {self.grid[0]} token frames "
            f"({unit}) do not split evenly over parallel.context_parallel_size "
            f"({p.context_parallel_size}): placed by token; micro-batch of {len(mb.clip_ids)} "
            f"clip(s), {mb.plan.summary()}"
        )

    def placed(self, b: int):
        """``(packed, plan, local ids)`` of a micro-batch of ``b`` clips on this CP rank."""
        if b not in self._plans:
            cp = self.coords.cp_size
            packed = PackedVideo((self.clip,) * b).padded_to(2 * cp)
            plan = packed.plan(self.U, self.R, placement=self.config.parallel.placement)
            local = packed.local_ids(plan.placement, cp, self.coords.cp_rank)
            self._plans[b] = (packed, plan, local)
        return self._plans[b]

    def _clip_latents(self, key, ranges) -> torch.Tensor:
        """``[z, F, h, w]`` of one clip: the latent frames of ``ranges`` read, the others zero."""
        if not ranges:
            return torch.zeros(self.config.vae.latent_channels, self.F, self.h, self.w)
        encode = getattr(self.source, "encode", None)
        if encode is not None:
            return encode([key], ranges)[0]
        return self.source.latents(key, ranges)

    def _cleans(self, keys: Sequence, packed: PackedVideo, local) -> List[torch.Tensor]:
        pt, C = self.patch[0], self.clip.frame_tokens
        out = []
        for key, runs in zip(keys, packed.frame_ranges(local)):
            if not self.need_latents:
                out.append(torch.zeros(C, self.patch_dim))
                continue
            lat = self._clip_latents(key, [(a * pt, b * pt) for a, b in runs])
            out.append(patchify(lat[None].float() * self.latent_scale, self.patch)[0])
        return out

    @property
    def patch_dim(self) -> int:
        pt, ph, pw = self.patch
        return self.config.vae.latent_channels * pt * ph * pw

    def micro_batch(self, step: int, keys: Sequence) -> PlacedMicroBatch:
        """This CP rank's share of the micro-batch of clips ``keys`` at ``step``."""
        cfg, keys = self.config, list(keys)
        packed, plan, local = self.placed(len(keys))
        indices = [self.index[k] for k in keys]
        C, nb = self.patch_dim, self.blocks
        draws = [clip_draws(cfg, step, i, self.num_tokens, C, nb) for i in indices]
        i2v = torch.tensor([d[4] for d in draws], dtype=torch.bool)
        ids = torch.arange(packed.seq_len)
        clip, thw = packed.clip_of(ids), packed.token_thw(ids)
        cond = (clip >= 0) & (thw[:, 0] == 0) & i2v[clip.clamp(min=0)]  # I2V first frames
        cleans = self._cleans(keys, packed, local)
        if self.kind == "teacher_forcing":
            cond &= packed.side(ids) == 1  # the noisy copy of frame 0 (the clean one has no loss)
            x, t, noise = self._tf_inputs(packed, cleans, draws, cond)
            target, condition = torch.zeros_like(x), None
        else:
            x, noise = packed.pack(cleans)[None], packed.pack([d[0] for d in draws])[None]
            t, target, condition = torch.cat([d[2] for d in draws]), torch.zeros_like(x), cond
        n_loss = len(keys) * self.num_tokens - int(i2v.sum()) * self.grid[1] * self.grid[2]
        captions, mask = self._caption_tensors(keys)
        tf = self.kind == "teacher_forcing"
        return PlacedMicroBatch(
            clip_ids=keys,
            packed=packed,
            placement=plan.placement,
            plan=plan,
            local=local,
            x=x[:, local],
            noise=noise[:, local],
            target=target[:, local],
            t=t[:, local] if tf else t,
            sigma=torch.cat([d[1] for d in draws]),
            caption_ids=captions,
            caption_mask=mask,
            drop=torch.tensor([d[3] for d in draws], dtype=torch.bool),
            loss_mask=packed.loss_mask(local)[None] & ~cond[local][None],
            num_loss_tokens=max(1, n_loss),
            scale=1.0,
            i2v=i2v,
            condition=condition[local][None] if condition is not None and i2v.any() else None,
            tf_mix=tf,
        )

    def _tf_inputs(self, packed: PackedVideo, cleans, draws, cond):
        """``(x, t, noise)`` of every clip's ``[clean ; noisy]``: ``x`` the clean latent in both
        copies, ``noise`` on the noisy copy only, per-token ``t`` (0 on the clean copy and on the
        I2V clips' noisy frame 0, ``diffusion.ti2v``); the objective mixes ``(1 - t) x + t noise``
        (``objectives.PackedObjective``, ``tf_mix``) in its own dtype, as the Balanced SP path."""
        noises = [d[0] for d in draws]
        _, t, _ = packed_teacher_forcing_inputs(packed, cleans, noises, [d[2] for d in draws])
        x = packed.pack([torch.cat([c, c]) for c in cleans])[None]
        noise = packed.pack([torch.cat([torch.zeros_like(n), n]) for n in noises])[None]
        t[0, cond] = 0.0
        return x, t, noise

    def _caption_tensors(self, keys: Sequence):
        if self.config.data.text_embed_dim is not None:
            pairs = [self.source.text(k) for k in keys]
            return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
        return self.tokenizer.encode_batch([self.source.caption(k) for k in keys])

    def held_out(self) -> "PlacedBatchMaker":
        import copy

        held = copy.deepcopy(self.config)
        held.data.seed += 1
        return PlacedBatchMaker(
            held,
            self.coords,
            self.kind,
            vae=self.vae,
            latent_scale=self.latent_scale,
            source=self.source,
        )
