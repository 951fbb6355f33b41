"""Fixed-shape micro-batches placed by token (DESIGN.md capability 11, "Any length at any CP"):
the full-attention families (``video_dit``, ``wan`` T2V / TI2V) at a CP size that does not divide
the clip's token frames (Wan's 21 latent frames at CP 2, 4, 8, 16).

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

from megatron_video.layouts.packed_video import PackedVideo, VideoClip
from megatron_video.models.embedders import patchify

from ..config import Config
from .fixed import FixedBatchMaker, clip_draws
from .packed import PackedMicroBatch
from .protocol import RankCoords

__all__ = ["PlacedMicroBatch", "PlacedBatchMaker", "tokens_placed"]


def tokens_placed(config: Config, family) -> bool:
    """Whether ``config``'s fixed-shape clips are placed by token (this module) rather than as
    whole frames per CP rank: a full-attention, non-AR family whose token frames
    (``latent frames / patch_size[0]``) ``context_parallel_size`` does not divide."""
    from ..config import token_grid_of

    cp = config.parallel.context_parallel_size
    if family.autoregressive or family.layer_type != "full" or family.packed_kind != "full":
        return False
    return cp > 1 and token_grid_of(config)[0] % cp != 0


@dataclass
class PlacedMicroBatch(PackedMicroBatch):
    """``PackedMicroBatch`` of one fixed shape plus first-frame conditioning (TI2V)."""

    i2v: Optional[torch.Tensor] = None  # [C] bool per clip
    condition: Optional[torch.Tensor] = None  # [1, s] bool: clean, t = 0, no loss (I2V frame 0)


class PlacedBatchMaker(FixedBatchMaker):
    """``FixedBatchMaker`` (clips, ledger, draws) whose micro-batches are placed by token; see the
    module docstring. ``layout`` must be None (full attention)."""

    def __init__(self, config: Config, coords: RankCoords, **kw):
        if kw.get("layout") is not None:
            raise ValueError("layout (Balanced SP) must be None for token placement")
        super().__init__(config, coords, **kw)
        self.U, self.R = coords.ulysses_size, coords.ring_size
        self.clip = VideoClip(*self.grid, kind="full")
        self._plans = {}

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
        draws = [clip_draws(cfg, step, i, self.num_tokens, self.patch_dim, 0) for i in indices]
        i2v = torch.tensor([d[4] for d in draws], dtype=torch.bool)
        clip = packed.clip_of(local)
        first = (clip >= 0) & (packed.token_thw(local)[:, 0] == 0)
        condition = (first & i2v[clip.clamp(min=0)])[None]
        x = packed.pack(self._cleans(keys, packed, local))[None][:, local]
        noise = packed.pack([d[0] for d in draws])[None][:, local]
        ids, mask = self._caption_tensors(keys)
        n_loss = len(keys) * self.num_tokens - int(i2v.sum()) * self.grid[1] * self.grid[2]
        return PlacedMicroBatch(
            clip_ids=keys,
            packed=packed,
            placement=plan.placement,
            plan=plan,
            local=local,
            x=x,
            noise=noise,
            target=torch.zeros_like(x),
            t=torch.cat([d[2] for d in draws]),
            sigma=torch.cat([d[1] for d in draws]),
            caption_ids=ids,
            caption_mask=mask,
            drop=torch.tensor([d[3] for d in draws], dtype=torch.bool),
            loss_mask=packed.loss_mask(local)[None] & ~condition,
            num_loss_tokens=max(1, n_loss),
            scale=1.0,
            i2v=i2v,
            condition=condition if bool(i2v.any()) else None,
        )

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
            held, self.coords, vae=self.vae, latent_scale=self.latent_scale, source=self.source
        )
