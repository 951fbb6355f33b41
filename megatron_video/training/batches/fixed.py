"""Fixed-shape micro-batches: a config without ``data.buckets`` is a grid of ONE bucket
(``clips.fixed_grid``) with one clip per micro-batch sequence. The clips come from the same
``ClipSource`` as mixed shapes (procedural, shards, raw energon clips) and each step's clips from
the same ``data.ledger.StepSampler``, so the sample ledger is the data state and a run resumes
exactly at any data-parallel size (docs/reliability.md).

Per micro-batch of this DP rank: each CP rank reads only the latent frames its tokens hold
(``segments``; the Balanced SP layout's clean + noisy copy reads each frame once), a raw source
decoding and encoding only their halo windows (VAE inside the SP partition). Injected noise,
timesteps / sigmas and the CFG drop are drawn per clip from generators seeded by
``(train.seed, step, clip index)`` over the clip's whole token sequence, then sliced to the rank's
tokens, so any layout sees the values of one process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from megatron_video.data.ledger import SampleLedger, StepSampler
from megatron_video.data.synthetic import CaptionTokenizer
from megatron_video.diffusion.edm import EDMConfig, sample_sigma
from megatron_video.diffusion.flow_matching import sample_timesteps
from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.models.embedders import patchify

from ..config import Config
from ..ti2v import i2v_probability_of
from .protocol import LedgerSteps, RankCoords

__all__ = ["MicroBatch", "FixedBatchMaker", "sample_generator", "clip_draws", "rank_token_ids"]


def sample_generator(*key: int) -> torch.Generator:
    """A generator seeded by a tuple of non-negative integers (independent streams per key)."""
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed & ((1 << 63) - 1))


def clip_draws(config: Config, step: int, index: int, tokens: int, channels: int, blocks: int):
    """``(noise [tokens, channels], sigma [1], t, drop, i2v)`` of clip ``index`` at ``step``:
    ``t`` is ``[blocks]`` per AR block (``blocks`` > 0) or ``[1]`` per clip; ``i2v`` (drawn last,
    so the others do not depend on it) with ``ti2v.i2v_probability_of``. The one place both
    makers draw them, so fixed and packed batches of a clip agree."""
    d = config.diffusion
    g = sample_generator(config.train.seed, step, index)
    noise = torch.randn(tokens, channels, generator=g)
    edm = EDMConfig(sigma_data=d.sigma_data, p_mean=d.p_mean, p_std=d.p_std)
    sigma = sample_sigma((1,), edm, generator=g)
    flow = dict(shift=d.flow_shift, distribution=d.flow_distribution)
    t = sample_timesteps((1, blocks) if blocks else (1,), generator=g, **flow)
    t = t[0] if blocks else t
    drop = bool(torch.rand(1, generator=g) < d.cfg_dropout)
    i2v = bool(torch.rand(1, generator=g) < i2v_probability_of(config))
    return noise, sigma, t, drop, i2v


def rank_token_ids(
    grid, cp_rank: int, cp_size: int, layout: Optional[BalancedSPLayout] = None
) -> torch.Tensor:
    """Global ids (in the sample's frame-major clean token sequence) of this rank's clean tokens;
    ``grid``: the ``(T, H, W)`` token grid."""
    if layout is not None:
        half = layout.local_len // 2
        return layout.local_global_ids(cp_rank)[:half]
    s = grid[0] * grid[1] * grid[2] // cp_size
    return torch.arange(cp_rank * s, (cp_rank + 1) * s)


@dataclass
class MicroBatch:
    indices: List[int]  # clip indices (the sampler's sorted clip ids)
    captions: List[str]
    caption_ids: torch.Tensor  # [b, L] ids, or [b, L, data.text_embed_dim] precomputed embeddings
    caption_mask: torch.Tensor  # [b, L]
    drop: torch.Tensor  # [b] bool: train with the null caption
    clean: Optional[torch.Tensor]  # [b, s_local, patch_dim] (None where the stage needs none)
    noise: Optional[torch.Tensor]  # like clean
    sigma: Optional[torch.Tensor]  # [b] (EDM)
    t: Optional[torch.Tensor]  # [b] (flow, full-sequence models) or [b, blocks] (AR)
    i2v: Optional[torch.Tensor] = None  # [b] bool: first latent frame = the clean image (TI2V)


class FixedBatchMaker(LedgerSteps):
    """This rank's fixed-shape micro-batches (``BatchSource``). ``source``: a
    ``clips.ClipSource`` (default: ``clips.clip_source(config, vae)``); ``layout``: the Balanced
    SP layout (AR families) or None (frame order, contiguous token shares)."""

    def __init__(
        self,
        config: Config,
        coords: RankCoords,
        *,
        vae=None,
        latent_scale: float = 1.0,
        layout: Optional[BalancedSPLayout] = None,
        source=None,
    ):
        from .clips import clip_source, fixed_latent_shape

        self.config, self.coords, self.vae = config, coords, vae
        self.latent_scale, self.layout = float(latent_scale), layout
        self.need_latents = coords.need_latents
        self.patch = tuple(config.model.patch_size)
        self.F, self.h, self.w = fixed_latent_shape(config)
        pt, ph, pw = self.patch
        self.grid = (self.F // pt, self.h // ph, self.w // pw)
        self.num_tokens = self.grid[0] * self.grid[1] * self.grid[2]
        self.token_ids = rank_token_ids(self.grid, coords.cp_rank, coords.cp_size, layout)
        if layout is not None:
            self.segments = layout.rank_segments(coords.cp_rank)
        else:
            n = self.F // coords.cp_size
            self.segments = [(coords.cp_rank * n, (coords.cp_rank + 1) * n)]
        self.frames = torch.cat([torch.arange(a, b) for a, b in self.segments])  # latent frames
        self.source = source if source is not None else clip_source(config, vae)
        self.ids = list(self.source.ids)
        self._check_grids()
        self.index = {k: i for i, k in enumerate(sorted(self.ids))}
        self.tokenizer = CaptionTokenizer(config.data.caption_len)
        t = config.train
        self.micro = t.micro_batch_size
        gbs = t.global_batch_size or self.micro * coords.dp_size
        self.num_microbatches = gbs // (self.micro * coords.dp_size)
        self.sampler = self._sampler(None)
        self._before: Optional[str] = None

    def _check_grids(self) -> None:
        want = (self.F, self.h, self.w)
        for k in self.ids:
            got = tuple(self.source.latent_grid(k))
            if got != want:
                from ..config import vae_geometry

                d, g = self.config.data, vae_geometry(self.config)
                raise ValueError(
                    f"clip {k!r}: latent grid {list(got)} must be {list(want)} (data.num_frames "
                    f"{d.num_frames}, data.height {d.height}, data.width {d.width} in pixels over "
                    f"the VAE's strides {g.temporal_stride} / {g.spatial_stride} of {g.source}: "
                    f"set vae.diffusers to the VAE the shards were encoded with; rule: without "
                    f"data.buckets every clip has the one fixed shape)"
                )

    def _sampler(self, ledger: Optional[SampleLedger]) -> StepSampler:
        n = len(self.ids)
        return StepSampler(
            self.ids,
            [1] * n,
            [1.0] * n,
            dp_size=self.coords.dp_size,
            num_microbatches=self.num_microbatches,
            tokens_per_microbatch=self.micro,
            seed=self.config.data.seed,
            ledger=ledger,
            drop_last=True,
        )

    # -- BatchSource ------------------------------------------------------------------------
    def held_out(self) -> "FixedBatchMaker":
        """The same rank over the same clips, drawing from ``data.seed + 1`` (evaluation)."""
        held = copy.deepcopy(self.config)
        held.data.seed += 1
        return FixedBatchMaker(
            held,
            self.coords,
            vae=self.vae,
            latent_scale=self.latent_scale,
            layout=self.layout,
            source=self.source,
        )

    def step_batches(self, step: int) -> Iterator[MicroBatch]:
        batch = self._draw(step)
        return iter([self.micro_batch(step, list(b)) for b in batch.bins[self.coords.dp_rank]])

    # -- the micro-batch ---------------------------------------------------------------------
    def micro_batch(self, step: int, keys: Sequence) -> MicroBatch:
        """This CP rank's share of the micro-batch of clips ``keys`` at ``step``."""
        cfg = self.config
        indices = [self.index[k] for k in keys]
        captions = [self.source.caption(k) for k in keys]
        if cfg.data.text_embed_dim is not None:
            pairs = [self.source.text(k) for k in keys]
            ids, mask = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
        else:
            ids, mask = self.tokenizer.encode_batch(captions)
        C = cfg.vae.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]
        blocks = self.layout.num_blocks if self.layout is not None else 0
        draws = [clip_draws(cfg, step, i, self.num_tokens, C, blocks) for i in indices]
        clean = noise = None
        if self.need_latents:
            lat = self._latents(keys).index_select(2, self.frames)
            clean = patchify(lat.float() * self.latent_scale, self.patch)
            noise = torch.stack([d[0].index_select(0, self.token_ids) for d in draws])
        return MicroBatch(
            indices=indices,
            captions=captions,
            caption_ids=ids,
            caption_mask=mask,
            drop=torch.tensor([d[3] for d in draws], dtype=torch.bool),
            clean=clean,
            noise=noise,
            sigma=torch.cat([d[1] for d in draws]),
            t=torch.stack([d[2] for d in draws]) if blocks else torch.cat([d[2] for d in draws]),
            i2v=torch.tensor([d[4] for d in draws], dtype=torch.bool),
        )

    def _latents(self, keys: Sequence) -> torch.Tensor:
        """``[b, z, F, h, w]`` of the clips: this rank's frames read, the others zero."""
        ranges = [tuple(s) for s in self.segments]
        encode = getattr(self.source, "encode", None)
        if encode is not None:
            return encode(list(keys), ranges)
        return torch.stack([self.source.latents(k, ranges) for k in keys])
