"""Packed micro-batches of mixed-shape clips (``data.buckets``): the training data path of
capability 7 (docs/data.md, "Mixed lengths and shapes"; docs/architecture.md, "Packed
micro-batches in the models").

Each optimizer step, ``data.ledger.StepSampler`` (the same pure function on every rank) draws the
step's clips from a seeded per-epoch permutation minus the ledger's consumed clips and balances
them by cost over DP ranks x micro-batches, each within ``data.buckets.tokens_per_microbatch``.
A DP rank's micro-batch becomes one ``PackedVideo`` (padded to a multiple of ``2·CP``), placed
over the CP group's ``U x R`` by ``plan_placement``; every CP rank keeps its tokens with the
placement's ids. The clips come from a ``clips.ClipSource``: precomputed latent shards, or
raw energon clips of which each CP rank decodes and encodes only the halo windows of the latent
frames its tokens read (``clip_ranges``; other frames stay zero). Noise, timesteps / sigmas and
the CFG drop are drawn per clip from generators seeded by ``(train.seed, step, clip index)`` over
the clip's whole token grid, so any layout sees the values of one process.

Empty micro-batches (an epoch's last step can have fewer clips than DP ranks x micro-batches):
every rank still runs all its micro-batches (the schedule and the collectives stay the same on
every rank); an empty one runs a dummy one-token zero clip with loss weight 0 (no gradient, no
loss tokens, not in the ledger).

Loss: ``sum of per-token losses / loss tokens of the GLOBAL step`` (``diffusion.packed``). The
count is known on every rank (the step's assignment is), and each share is scaled by
``num_microbatches x dp_size`` to undo Megatron's per-micro-batch and DDP averaging.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_video.data.ledger import SampleLedger, StepSampler
from megatron_video.data.synthetic import CaptionTokenizer
from megatron_video.diffusion.packed import packed_teacher_forcing_inputs
from megatron_video.layouts.packed_video import PackedVideo, VideoClip
from megatron_video.layouts.placement import CostModel, Placement, PlacementPlan
from megatron_video.models.embedders import patchify

from ..config import Config, bucket_grid
from ..ti2v import i2v_probability_of
from .clips import ClipSource, ShardClipSource, clip_source, load_clip_store
from .fixed import clip_draws
from .protocol import LedgerSteps, RankCoords, checked_step_batches

__all__ = ["PackedMicroBatch", "PackedBatchMaker", "load_clip_store"]


@dataclass
class PackedMicroBatch:
    """This CP rank's share of one packed micro-batch (batch 1; ``s`` local tokens)."""

    clip_ids: List[str]
    packed: PackedVideo
    placement: Placement
    plan: PlacementPlan
    local: torch.Tensor  # [s] global ids this rank holds
    x: torch.Tensor  # [1, s, C] clean (full kinds) / [clean ; noisy] (teacher forcing)
    noise: torch.Tensor  # [1, s, C] (full kinds; zeros for teacher forcing)
    target: torch.Tensor  # [1, s, C] teacher forcing: the velocity on the noisy half
    t: torch.Tensor  # [C] per clip (full kinds) or [1, s] per token (teacher forcing)
    sigma: torch.Tensor  # [C] (EDM)
    caption_ids: torch.Tensor  # [C, L] ids or [C, L, text_embed_dim] embeddings
    caption_mask: torch.Tensor  # [C, L]
    drop: torch.Tensor  # [C] bool
    loss_mask: torch.Tensor  # [1, s]
    num_loss_tokens: int  # of the whole step (all DP ranks and micro-batches)
    scale: float  # num_microbatches x dp_size (0 for a dummy micro-batch)
    condition: Optional[torch.Tensor] = None  # [1, s] bool: I2V first-frame tokens (TI2V)


class PackedBatchMaker(LedgerSteps):
    """This rank's packed micro-batches (``step_batches(step)``) and the sample ledger (its data
    state). ``kind``: ``"full"`` (T2V) or ``"teacher_forcing"`` (the AR families). ``log``: where
    the planner's decision is printed once (rank 0), or None. The clips come from ``source``
    (``clips.ClipSource``), else from ``store`` (precomputed latents in memory), else from
    ``config.data.source`` (``clips.clip_source``: shards, or raw energon clips encoded with
    ``vae``, the trainer's causal VAE)."""

    def __init__(
        self,
        config: Config,
        coords: RankCoords,
        *,
        kind: str,
        latent_scale: float,
        log: Optional[Callable[[str], None]] = None,
        store: Optional[Dict[str, dict]] = None,
        source: Optional[ClipSource] = None,
        vae=None,
    ):
        self.config, self.coords, self.kind = config, coords, kind
        self.latent_scale, self.log = float(latent_scale), log
        p = config.parallel
        self.U, self.R, self.cp_rank = coords.ulysses_size, coords.ring_size, coords.cp_rank
        self.cp_size, self.dp_rank, self.dp_size = coords.cp_size, coords.dp_rank, coords.dp_size
        self.placement_order = p.placement
        self.patch = tuple(config.model.patch_size)
        self.fpb = config.model.frames_per_block if kind == "teacher_forcing" else 1
        t = config.train
        gbs = t.global_batch_size or t.micro_batch_size * self.dp_size
        self.num_microbatches = gbs // (t.micro_batch_size * self.dp_size)
        self.grid = bucket_grid(config)
        self.budget = self.grid.config.tokens_per_microbatch
        if source is None:
            source = ShardClipSource(store) if store is not None else clip_source(config, vae)
        self.source, self.need_latents = source, coords.need_latents
        self.ids = list(source.ids)
        self.index = {k: i for i, k in enumerate(self.ids)}
        self.clips = {k: self._video_clip(k) for k in self.ids}
        self._check_budget()
        cost = CostModel()
        self.costs = [cost.clip(self.clips[k].placement_clip()) for k in self.ids]
        self.tokenizer = CaptionTokenizer(config.data.caption_len)
        self.sampler = self._sampler(None)
        self._before: Optional[str] = None  # the ledger before the last drawn step
        self.last_step_tokens = 0
        self._logged = False

    def held_out(self) -> "PackedBatchMaker":
        """A maker for the same rank over the same clips (the same source), drawing its steps from
        ``data.seed + 1``: the evaluation draws, apart from training's."""
        held = copy.deepcopy(self.config)
        held.data.seed += 1
        return PackedBatchMaker(
            held, self.coords, kind=self.kind, latent_scale=self.latent_scale, source=self.source
        )

    # -- clips ----------------------------------------------------------------------------------
    def _video_clip(self, key: str) -> VideoClip:
        F, h, w = self.source.latent_grid(key)
        pt, ph, pw = self.patch
        if F % pt or h % ph or w % pw:
            raise ValueError(
                f"clip {key!r}: latent {F}x{h}x{w} must be divisible by model.patch_size "
                f"{list(self.patch)} (rule: the bucket grid is a multiple of the patch)"
            )
        T = F // pt
        if self.kind == "teacher_forcing" and T % self.fpb:
            raise ValueError(
                f"clip {key!r}: {T} latent frames must be a multiple of model.frames_per_block "
                f"({self.fpb}) for model.family {self.config.model.family!r} (rule: whole AR "
                f"blocks; images need frames_per_block 1)"
            )
        return VideoClip(T, h // ph, w // pw, self.kind, self.fpb)

    def _check_budget(self) -> None:
        for k in self.ids:
            n = self.clips[k].tokens
            if n > self.budget:
                raise ValueError(
                    f"data.buckets.tokens_per_microbatch ({self.budget}) must hold every clip: "
                    f"clip {k!r} has {n} tokens"
                    + (" (clean + noisy copy)" if self.kind == "teacher_forcing" else "")
                    + " (rule: a clip is never split across micro-batches)"
                )

    def _sampler(self, ledger: Optional[SampleLedger]) -> StepSampler:
        return StepSampler(
            self.ids,
            [self.clips[k].tokens for k in self.ids],
            self.costs,
            dp_size=self.dp_size,
            num_microbatches=self.num_microbatches,
            tokens_per_microbatch=self.budget,
            seed=self.config.data.seed,
            ledger=ledger,
        )

    # -- data state (the ledger, JSON) ----------------------------------------------------------
    # -- micro-batches --------------------------------------------------------------------------
    def step_batches(self, step: int) -> Iterator[PackedMicroBatch]:
        batch = self._draw(step)
        n_loss = sum(self.clips[k].loss_tokens for k in batch.clip_ids)
        # TI2V: an I2V clip's first-frame tokens carry no loss (every DP rank counts the step's)
        first = [self.clips[k].positions for k in batch.clip_ids if self._i2v(step, k)]
        n_loss -= sum(first)
        self.last_step_tokens = sum(self.clips[k].tokens for k in batch.clip_ids)
        mbs = [self.micro_batch(step, list(b), n_loss) for b in batch.bins[self.dp_rank]]
        if self.log is not None and not self._logged:
            self._logged = True
            self.log(self.describe(batch, mbs))
        return iter(mbs)

    def checked_step_batches(self, step: int, group=None) -> Iterator[PackedMicroBatch]:
        """``protocol.checked_step_batches`` of this maker."""
        return checked_step_batches(self, step, group)

    def describe(self, batch, mbs: Sequence[PackedMicroBatch]) -> str:
        """The bucket / budget summary and the first step's placement plans (printed once)."""
        images = sum(c.frames == 1 for c in self.clips.values())
        shapes = sorted({(c.frames, c.height, c.width) for c in self.clips.values()})
        lines = [
            f"[megatron-video] mixed data (data.buckets): {len(self.ids)} clips ({images} images), "
            f"{len(shapes)} token grids from {self.source.describe()}; budget {self.budget} "
            f"tokens per micro-batch, {self.num_microbatches} micro-batch(es) x DP "
            f"{self.dp_size}, CP U{self.U}xR{self.R}",
            f"[megatron-video] step {batch.step}: {len(batch.clip_ids)} clips, DP cost max/mean "
            f"{batch.assignment.imbalance():.3f}; micro-batches of DP rank {self.dp_rank}:",
        ]
        for m, mb in enumerate(mbs):
            what = "empty (dummy clip, weight 0)" if not mb.clip_ids else f"{mb.packed!r}"
            lines.append(f"[megatron-video]   micro-batch {m}: {what}; {mb.plan.summary()}")
        return "\n".join(lines)

    def clip_ranges(self, packed: PackedVideo, local: torch.Tensor) -> List[List[tuple]]:
        """Per clip of ``packed``, the latent-frame ranges ``[(a, b), ...]`` the tokens ``local``
        read (their patched frames times the temporal patch; both teacher-forcing copies of a
        frame read its latents): all a CP rank must encode of each clip."""
        pt = self.patch[0]
        return [[(a * pt, b * pt) for a, b in r] for r in packed.frame_ranges(local)]

    def _clip_tensors(self, step: int, key: Optional[str], clip: VideoClip, ranges=()):
        """``(clean [n, C], noise [n, C], t, sigma [1], drop)`` of one clip (frame-major tokens);
        ``key`` None: the dummy zero clip. ``ranges``: the latent frames this rank's tokens read
        (``clip_ranges``); a raw source encodes only those, the other frames stay zero."""
        cfg = self.config
        C = cfg.vae.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]
        n, nb = clip.frame_tokens, clip.frames // clip.frames_per_block
        if key is None:
            z = torch.zeros(n, C)
            t = torch.full((nb,) if self.kind == "teacher_forcing" else (1,), 0.5)
            return z, z.clone(), t, torch.ones(1), False, False
        if self.need_latents:
            lat = self.source.latents(key, ranges).float() * self.latent_scale
            clean = patchify(lat[None], self.patch)[0]
        else:  # a middle pipeline stage: no clip is read (its input is the previous stage's)
            clean = torch.zeros(n, C)
        tf = self.kind == "teacher_forcing"  # t: [blocks] per AR block, [1] per clip
        noise, sigma, t, drop, i2v = clip_draws(cfg, step, self.index[key], n, C, nb if tf else 0)
        return clean, noise, t, sigma, drop, i2v

    def _i2v(self, step: int, key: str) -> bool:
        """Whether clip ``key`` is an I2V clip at ``step`` (``clip_draws``' last draw, after the
        same draws as ``_clip_tensors``; False without first-frame conditioning)."""
        if i2v_probability_of(self.config) == 0:
            return False
        clip, cfg = self.clips[key], self.config
        C = cfg.vae.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]
        nb = clip.frames // clip.frames_per_block if self.kind == "teacher_forcing" else 0
        return clip_draws(cfg, step, self.index[key], clip.frame_tokens, C, nb)[4]

    def _first_frames(self, packed: PackedVideo, ids: torch.Tensor, i2v: torch.Tensor):
        """``[len(ids)]`` bool: the tokens ``ids`` of an I2V clip's latent frame 0 (teacher
        forcing: of its noisy copy; the clean copy carries no loss anyway)."""
        clip = packed.clip_of(ids)
        cond = (clip >= 0) & (packed.token_thw(ids)[:, 0] == 0) & i2v[clip.clamp(min=0)]
        if self.kind == "teacher_forcing":
            cond &= packed.side(ids) == 1
        return cond

    def _captions(self, keys: Sequence[Optional[str]]):
        d = self.config.data
        if d.text_embed_dim is not None:
            embs, masks = [], []
            for k in keys:
                if k is None:
                    embs.append(torch.zeros(d.caption_len, d.text_embed_dim))
                    masks.append(torch.zeros(d.caption_len, dtype=torch.bool))
                else:
                    emb, mask = self.source.text(k)
                    embs.append(emb)
                    masks.append(mask)
            return torch.stack(embs), torch.stack(masks)
        caps = ["" if k is None else self.source.caption(k) for k in keys]
        return self.tokenizer.encode_batch(caps)

    def micro_batch(self, step: int, keys: List[str], num_loss_tokens: int) -> PackedMicroBatch:
        """This CP rank's share of the micro-batch of clips ``keys`` (empty: the dummy rule)."""
        real = bool(keys)
        slots: List[Optional[str]] = list(keys) if real else [None]
        clips = [self.clips[k] for k in keys] if real else [VideoClip(1, 1, 1, self.kind, 1)]
        packed = PackedVideo(tuple(clips)).padded_to(2 * self.cp_size)
        plan = packed.plan(self.U, self.R, placement=self.placement_order)
        local = packed.local_ids(plan.placement, self.cp_size, self.cp_rank)
        ranges = self.clip_ranges(packed, local)
        per = [self._clip_tensors(step, k, c, r) for k, c, r in zip(slots, clips, ranges)]
        cleans, noises, ts = [p[0] for p in per], [p[1] for p in per], [p[2] for p in per]
        i2v, tf = torch.tensor([bool(p[5]) for p in per], dtype=torch.bool), self.kind != "full"
        if tf:
            x, t, target = packed_teacher_forcing_inputs(packed, cleans, noises, ts)
            if bool(i2v.any()):  # I2V: the noisy frame 0 is the clean latent at timestep 0
                held = self._first_frames(packed, torch.arange(packed.seq_len), i2v)
                x[0, held] = packed.pack([torch.cat([c, c]) for c in cleans])[held]
                t[0, held] = 0.0
            x, t, target = x[:, local], t[:, local], target[:, local]
            noise = torch.zeros_like(x)
        else:
            x, noise = packed.pack(cleans)[None][:, local], packed.pack(noises)[None][:, local]
            t, target = torch.cat(ts), torch.zeros_like(x)
        ids, mask = self._captions(slots)
        loss_mask, condition = packed.loss_mask(local)[None], None
        if bool(i2v.any()):  # I2V first frames: clean, timestep 0, no loss (diffusion.ti2v)
            cond = self._first_frames(packed, local, i2v)[None]
            loss_mask, condition = loss_mask & ~cond, None if tf else cond
        return PackedMicroBatch(
            clip_ids=list(keys),
            packed=packed,
            placement=plan.placement,
            plan=plan,
            local=local,
            x=x,
            noise=noise,
            target=target,
            t=t,
            sigma=torch.cat([p[3] for p in per]),
            caption_ids=ids,
            caption_mask=mask,
            drop=torch.tensor([p[4] for p in per], dtype=torch.bool),
            loss_mask=loss_mask,
            num_loss_tokens=max(1, num_loss_tokens),
            scale=float(self.num_microbatches * self.dp_size) if real else 0.0,
            condition=condition,
        )
