"""Per-rank micro-batches: raw clips -> this CP rank's halo window(s) -> VAE latents -> patch tokens.

Every rank builds its own micro-batches, nothing is broadcast; a micro-batch is a pure function of
``(seed, step, micro-batch index, data-parallel rank)`` (``BatchMaker``), so a resumed run sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_video.data.synthetic import CaptionTokenizer, ProceduralVideoDataset
from megatron_video.data.video_windows import encode_rank_latents
from megatron_video.diffusion.edm import EDMConfig, sample_sigma
from megatron_video.diffusion.flow_matching import sample_timesteps
from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.layouts.vae_halo import halo_window
from megatron_video.models.embedders import patchify
from megatron_video.models.vae_halo_probe import encoder_halo
from megatron_video.ops.halo import halo_scatter

from .config import Config, latent_shape, token_grid_of

__all__ = ["MicroBatch", "BatchMaker", "sample_generator", "rank_token_ids"]


def sample_generator(*key: int) -> torch.Generator:
    """A generator seeded by a tuple of non-negative integers (independent streams per key)."""
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed & ((1 << 63) - 1))


def rank_token_ids(
    config: Config, cp_rank: int, cp_size: int, layout: Optional[BalancedSPLayout] = None
) -> torch.Tensor:
    """Global ids (in the sample's frame-major clean token sequence) of this rank's clean tokens."""
    if layout is not None:
        half = layout.local_len // 2
        return layout.local_global_ids(cp_rank)[:half]
    T, H, W = token_grid_of(config)
    s = T * H * W // cp_size
    return torch.arange(cp_rank * s, (cp_rank + 1) * s)


@dataclass
class MicroBatch:
    indices: List[int]
    captions: List[str]
    caption_ids: torch.Tensor  # [b, L] ids, or [b, L, data.text_embed_dim] precomputed embeddings
    caption_mask: torch.Tensor  # [b, L]
    drop: torch.Tensor  # [b] bool: train with the null caption
    clean: Optional[torch.Tensor]  # [b, s_local, patch_dim] (None where the stage needs none)
    noise: Optional[torch.Tensor]  # like clean
    sigma: Optional[torch.Tensor]  # [b] (EDM)
    t: Optional[torch.Tensor]  # [b] (flow, full-sequence models) or [b, blocks] (AR)


class _ShardClips:
    """Sequential clips of one data-parallel rank from WebDataset shards (cycled)."""

    def __init__(self, shards: str, dp_rank: int, dp_size: int):
        from megatron_video.data.shards import ShardReader

        self.reader = ShardReader(shards, dp_rank=dp_rank, dp_size=dp_size, split="samples")
        self.pos, self.it = 0, None

    def get(self, position: int) -> dict:
        if self.it is None or position < self.pos:
            self.it, self.pos = iter(self.reader), 0
        while True:
            try:
                sample = next(self.it)
            except StopIteration:  # next epoch
                self.it = iter(self.reader)
                sample = next(self.it, None)
                if sample is None:
                    raise ValueError(
                        "data.shards: this data-parallel rank's share of the shards is empty"
                    ) from None
            self.pos += 1
            if self.pos - 1 == position:
                return sample


class _EnergonClips:
    """This rank's windows from an energon dataset (``data.energon_video``), batch by batch."""

    def __init__(self, config: Config, windows, dp_rank: int, dp_size: int):
        from megatron_video.data.energon_video import video_window_loader

        d = config.data
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.loader, self.task_encoder = video_window_loader(
            d.path,
            windows,
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            batch_size=config.train.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=d.seed,
        )
        self.it = None

    def next_batch(self, n: int) -> list:
        if self.it is None:
            self.it = iter(self.loader)
        batch = next(self.it)
        if len(batch) != n:
            raise ValueError(f"energon batch holds {len(batch)} samples; the micro-batch needs {n}")
        return batch

    def state_json(self) -> str:
        from megatron_video.data.energon_video import state_to_json

        return json.dumps(
            {
                "dp_rank": self.dp_rank,
                "dp_size": self.dp_size,
                "skipped": self.task_encoder.skipped,
                "loader": state_to_json(self.loader.save_state_rank()),
            }
        )

    def restore_json(self, text: Optional[str]) -> None:
        from megatron_video.data.energon_video import state_from_json

        if text is None:
            raise ValueError(
                "checkpoint holds no data-loader state for this rank (saved without "
                "data.source=energon?); the energon order cannot be resumed"
            )
        blob = json.loads(text)
        if (blob["dp_rank"], blob["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(
                f"data-loader state was saved by dp rank {blob['dp_rank']} of {blob['dp_size']}; "
                f"this rank is {self.dp_rank} of {self.dp_size} (energon resumes with the same "
                f"data-parallel size)"
            )
        if self.it is not None:
            raise ValueError(
                "the energon loader already started; restore its state before the first batch"
            )
        self.loader.restore_state_rank(state_from_json(blob["loader"]))
        self.task_encoder.skipped = int(blob.get("skipped", 0))


class BatchMaker:
    """Builds this rank's micro-batches.

    ``segments``: the latent frame ranges this CP rank holds (local order). ``vae`` / ``latent_scale``
    from ``vae_stage.load_vae``; ``need_latents=False`` (middle pipeline stages) skips the clips.

    * Samples: data-parallel rank ``d`` takes global samples ``((step*M + m)*DP + d)*b + j`` (mod
      the dataset size) of the procedural dataset, or the next ones of its share of WebDataset
      shards.
    * Encoding starts inside the SP partition: the rank reads only its raw window(s) from the clip
      (the procedural source renders the clip first and cuts the windows with
      ``ops.halo_scatter``) and encodes them with the left halo (``encode_rank_latents``), keeping
      exactly its latent frames.
    * Injected noise: drawn per sample over the WHOLE token sequence from a generator seeded by
      ``(seed, step, sample)``, then sliced to the rank's tokens, so any parallel layout sees the
      same noise as one process; timesteps / sigmas and the CFG drop decision are drawn the same
      way.
    """

    def __init__(
        self,
        config: Config,
        *,
        vae,
        latent_scale: float,
        cp_rank: int,
        cp_size: int,
        dp_rank: int,
        dp_size: int,
        layout: Optional[BalancedSPLayout] = None,
        need_latents: bool = True,
    ):
        self.config, self.vae, self.latent_scale = config, vae, float(latent_scale)
        self.cp_rank, self.cp_size, self.dp_rank, self.dp_size = cp_rank, cp_size, dp_rank, dp_size
        self.layout, self.need_latents = layout, need_latents
        self.patch = tuple(config.model.patch_size)
        self.F, self.h, self.w = latent_shape(config)
        self.grid = token_grid_of(config)
        self.num_tokens = self.grid[0] * self.grid[1] * self.grid[2]
        self.token_ids = rank_token_ids(config, cp_rank, cp_size, layout)
        if layout is not None:
            self.segments = layout.rank_segments(cp_rank)
        else:
            n = self.F // cp_size
            self.segments = [(cp_rank * n, (cp_rank + 1) * n)]
        need = encoder_halo(vae.encoder, temporal_stride=4) if vae is not None else 0
        self.halo = config.vae.halo_latents if config.vae.halo_latents is not None else need
        self.windows = [
            halo_window(a, b, self.halo, 4, True, rank=cp_rank) for a, b in self.segments
        ]
        d = config.data
        self.tokenizer = CaptionTokenizer(d.caption_len)
        self.dataset = ProceduralVideoDataset(
            d.num_samples,
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            seed=d.seed,
            caption_len=d.caption_len,
        )
        self.shards = _ShardClips(d.shards, dp_rank, dp_size) if d.source == "shards" else None
        self._text = {}  # position -> precomputed (caption embeddings, mask) of shard samples
        self.energon = None
        if d.source == "energon":
            self.energon = _EnergonClips(config, self.windows, dp_rank, dp_size)
        t = config.train
        self.micro = t.micro_batch_size
        gbs = t.global_batch_size or self.micro * dp_size
        self.num_microbatches = gbs // (self.micro * dp_size)
        self.edm = EDMConfig(
            sigma_data=config.diffusion.sigma_data,
            p_mean=config.diffusion.p_mean,
            p_std=config.diffusion.p_std,
        )

    # -- samples ---------------------------------------------------------------------------
    def sample_positions(self, step: int, microbatch: int) -> List[int]:
        base = (
            (step * self.num_microbatches + microbatch) * self.dp_size + self.dp_rank
        ) * self.micro
        return [base + j for j in range(self.micro)]

    def _clip(
        self, position: int
    ) -> Tuple[int, str, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(index, caption, raw video [3, T, H, W] or None, latents [z, F, h, w] or None)``."""
        d = self.config.data
        if self.shards is None:
            index = position % d.num_samples
            attrs = self.dataset.attributes(index)
            from megatron_video.data.synthetic import caption_for, render_video

            video = None
            if self.need_latents:
                video = render_video(attrs, num_frames=d.num_frames, height=d.height, width=d.width)
            return index, caption_for(attrs), video, None
        # this data-parallel rank's own running sample number (its share of the shards)
        s = self.shards.get(
            (position // self.micro // self.dp_size) * self.micro + position % self.micro
        )
        key = s["key"]
        if "video" in s:
            v = s["video"].float()
            if tuple(v.shape) != (3, d.num_frames, d.height, d.width):
                raise ValueError(
                    f"shard sample {key!r}: video shape {tuple(v.shape)} must be "
                    f"[3, data.num_frames={d.num_frames}, {d.height}, {d.width}]"
                )
            return position, s["caption"], v, None
        lat = s["latent"].float()
        want = (self.config.vae.latent_channels, self.F, self.h, self.w)
        if tuple(lat.shape) != want:
            raise ValueError(
                f"shard sample {key!r}: latent shape {tuple(lat.shape)} must be {list(want)}"
            )
        if d.text_embed_dim is not None:  # precomputed caption embeddings travel with the latent
            emb, tm = s.get("text_emb"), s.get("text_mask")
            if (
                emb is None
                or tm is None
                or tuple(emb.shape) != (d.caption_len, d.text_embed_dim)
                or tuple(tm.shape) != (d.caption_len,)
            ):
                raise ValueError(
                    f"shard sample {key!r}: data.text_embed_dim ({d.text_embed_dim}) needs "
                    f"text_emb [data.caption_len={d.caption_len}, {d.text_embed_dim}] and text_mask; "
                    f"got {None if emb is None else tuple(emb.shape)}"
                )
            self._text[position] = (emb.float(), tm.bool())
        return position, s["caption"], None, lat

    def _local_latents(
        self, videos: Sequence[Optional[torch.Tensor]], latents: Sequence[Optional[torch.Tensor]]
    ) -> torch.Tensor:
        """This rank's latent frames ``[b, z, F_local, h, w]`` (scaled to unit variance)."""
        z = self.config.vae.latent_channels
        if latents[0] is not None:  # pre-encoded shards: keep the rank's frames
            frames = torch.cat([torch.arange(a, b) for a, b in self.segments])
            return torch.stack(list(latents)).index_select(2, frames) * self.latent_scale
        batch = torch.stack(list(videos))
        packed = halo_scatter(
            batch, [w.window for w in self.windows], "bcthw"
        )  # one pass, C++ when built
        raws = [packed.window(i) for i in range(len(self.windows))]
        with torch.no_grad():
            moments = encode_rank_latents(self.vae.encoder, raws, self.windows)
        return moments[:, :z] * self.latent_scale

    def _window_latents(self, raws: List[torch.Tensor]) -> torch.Tensor:
        """Latents of raw windows decoded per rank (energon): encoded with the halo, scaled."""
        with torch.no_grad():
            moments = encode_rank_latents(self.vae.encoder, raws, self.windows)
        return moments[:, : self.config.vae.latent_channels] * self.latent_scale

    # -- loader state (checkpointed) -----------------------------------------------------------
    def data_state(self) -> Optional[str]:
        """This rank's loader state as JSON (energon), or None (the other sources are stateless)."""
        return self.energon.state_json() if self.energon is not None else None

    def restore_data_state(self, text: Optional[str]) -> None:
        if self.energon is not None:
            self.energon.restore_json(text)

    # -- the micro-batch ---------------------------------------------------------------------
    def micro_batch(self, step: int, microbatch: int) -> MicroBatch:
        """Micro-batch ``microbatch`` of training step ``step`` of this data-parallel rank."""
        return self.from_positions(self.sample_positions(step, microbatch), step)

    def from_positions(self, positions: Sequence[int], step: int) -> MicroBatch:
        """The micro-batch of the given global sample positions (e.g. from Megatron-LM's sampler);
        ``step`` seeds the injected noise together with the position. With ``data.source=energon``
        the clips are the loader's next batch (this rank's windows only; its state is checkpointed)."""
        cfg = self.config
        seed = cfg.train.seed
        indices, captions, videos, latents = [], [], [], []
        windows = None
        if self.energon is not None:
            batch = self.energon.next_batch(len(positions))
            indices = list(positions)
            captions = [s.caption for s in batch]
            windows = [torch.stack([s.windows[i] for s in batch]) for i in range(len(self.windows))]
        for pos in positions if self.energon is None else ():
            idx, cap, video, lat = self._clip(pos)
            indices.append(idx)
            captions.append(cap)
            videos.append(video)
            latents.append(lat)
        if (
            self.config.data.text_embed_dim is not None
            and self.energon is None
            and self.shards is not None
        ):
            pairs = [self._text.pop(p) for p in positions]
            ids, mask = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
        else:
            ids, mask = self.tokenizer.encode_batch(captions)
        C = cfg.vae.latent_channels * self.patch[0] * self.patch[1] * self.patch[2]
        noise, sig, ts, drop = [], [], [], []
        flow = dict(shift=cfg.diffusion.flow_shift, distribution=cfg.diffusion.flow_distribution)
        for pos in positions:
            g = sample_generator(seed, step, pos)
            n = torch.randn(self.num_tokens, C, generator=g)
            noise.append(n.index_select(0, self.token_ids))
            sig.append(sample_sigma((1,), self.edm, generator=g))
            if self.layout is not None:
                ts.append(sample_timesteps((1, self.layout.num_blocks), generator=g, **flow))
            else:
                ts.append(sample_timesteps((1,), generator=g, **flow))
            drop.append(bool(torch.rand(1, generator=g) < cfg.diffusion.cfg_dropout))
        clean = None
        if self.need_latents:
            clean = patchify(
                self._window_latents(windows)
                if windows is not None
                else self._local_latents(videos, latents),
                self.patch,
            )
        return MicroBatch(
            indices=indices,
            captions=captions,
            caption_ids=ids,
            caption_mask=mask,
            drop=torch.tensor(drop, dtype=torch.bool),
            clean=clean,
            noise=torch.stack(noise) if self.need_latents else None,
            sigma=torch.cat(sig),
            t=torch.cat(ts),
        )

    def step_batches(self, step: int) -> Iterator[MicroBatch]:
        return iter([self.micro_batch(step, m) for m in range(self.num_microbatches)])
