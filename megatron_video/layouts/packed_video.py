"""A packed video micro-batch (clips of mixed frames x height x width in one sequence), as pure maps.

A micro-batch becomes ONE token sequence (batch 1) of ``seq_len`` tokens holding several clips, each
with its own latent token grid ``(frames, height, width)`` after patchify (an image is a one-frame
clip) and its own attention scope. Clip ``c`` owns the global ids ``[starts[c], starts[c] +
tokens_c)``; tokens past the last clip are padding (attend nothing, carry no loss).

Inside a clip the tokens are in the order its unpacked model uses:

* ``"full"`` (T2V): frame-major ``f·h·w + y·w + x`` (``layouts.stdit.token_thw``);
* ``"teacher_forcing"`` (the AR family): ``[clean ; noisy]``, each half frame-major over the clip's
  frames (the single-GPU order of ``layouts.balanced_sp``), blocks of ``frames_per_block`` frames.

``PackedVideo`` answers, for any global ids: the clip, the ``(t, h, w)`` on that clip's own grid
(its RoPE positions), the side (clean / noisy) and AR block, and whether the token bears loss. It
hands the placement planner its ``placement.Clip``s (teacher forcing with ``block_tokens`` = one
block of one half, so ``plan_placement`` keeps a frame's clean and noisy copy on one rank) and
packs / unpacks per-clip tensors. Design: docs/architecture.md, "Capabilities" 7 and "Packed
micro-batches in the models".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..checks import check_int
from .geometry import VideoGeometry
from .placement import Clip, CostModel, Placement, PlacementPlan, plan_placement

__all__ = ["PACKED_KINDS", "VideoClip", "PackedVideo"]

# Attention inside a clip: full (T2V) or teacher forcing (AR, ``[clean ; noisy]``).
PACKED_KINDS = ("full", "teacher_forcing")


@dataclass(frozen=True)
class VideoClip:
    """One clip of a packed micro-batch: its latent token grid after patchify and its kind."""

    frames: int
    height: int
    width: int
    kind: str = "full"
    frames_per_block: int = 1  # teacher forcing: latent frames per AR block

    def __post_init__(self):
        for name in ("frames", "height", "width", "frames_per_block"):
            check_int(name, getattr(self, name), 1)
        if self.kind not in PACKED_KINDS:
            raise ValueError(f"kind ({self.kind!r}) must be one of {PACKED_KINDS}")
        if self.kind == "teacher_forcing" and self.frames % self.frames_per_block:
            raise ValueError(
                f"frames ({self.frames}) must be a multiple of frames_per_block "
                f"({self.frames_per_block}) for a teacher-forcing clip (whole AR blocks)"
            )

    @property
    def grid(self) -> VideoGeometry:
        return VideoGeometry(self.frames, self.height, self.width)

    @property
    def positions(self) -> int:
        return self.height * self.width

    @property
    def frame_tokens(self) -> int:
        """Tokens of the clip's latent video (one copy): ``frames·height·width``."""
        return self.frames * self.positions

    @property
    def tokens(self) -> int:
        """Tokens of the clip in the packed sequence (teacher forcing: clean and noisy copy)."""
        return self.frame_tokens * (2 if self.kind == "teacher_forcing" else 1)

    @property
    def loss_tokens(self) -> int:
        """Loss-bearing tokens (teacher forcing: the noisy half)."""
        return self.frame_tokens

    def placement_clip(self) -> Clip:
        """The planner's view: tokens, kind and (teacher forcing) the tokens of one block."""
        if self.kind == "teacher_forcing":
            return Clip(self.tokens, "teacher_forcing", self.frames_per_block * self.positions)
        return Clip(self.tokens, "full")


@dataclass(frozen=True)
class PackedVideo:
    """Clips packed in order into one sequence of ``seq_len`` tokens (default: their total; the
    rest is padding). Pure and immutable; every map takes global ids (any shape, int64)."""

    clips: Tuple[VideoClip, ...]
    seq_len: Optional[int] = None

    def __post_init__(self):
        clips = tuple(self.clips)
        if not clips or not all(isinstance(c, VideoClip) for c in clips):
            raise ValueError(f"clips ({self.clips!r}) must be a non-empty sequence of VideoClip")
        total = sum(c.tokens for c in clips)
        seq_len = total if self.seq_len is None else check_int("seq_len", self.seq_len, 1)
        if seq_len < total:
            raise ValueError(
                f"seq_len ({seq_len}) must be at least the clips' {total} tokens (rule: the "
                f"packed sequence holds every clip whole, then padding)"
            )
        object.__setattr__(self, "clips", clips)
        object.__setattr__(self, "seq_len", seq_len)
        starts = torch.tensor([0] + [c.tokens for c in clips]).cumsum(0)
        object.__setattr__(self, "_bounds", starts)  # [C + 1] clip offsets (private)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_grids(
        cls,
        grids: Sequence[Tuple[int, int, int]],
        kind: str = "full",
        frames_per_block: int = 1,
        seq_len: Optional[int] = None,
    ) -> "PackedVideo":
        """Clips of one ``kind`` from ``(frames, height, width)`` grids (or ``VideoGeometry``)."""
        clips = []
        for g in grids:
            t, h, w = (g.frames, g.height, g.width) if isinstance(g, VideoGeometry) else g
            fpb = frames_per_block if kind == "teacher_forcing" else 1
            clips.append(VideoClip(t, h, w, kind, fpb))
        return cls(tuple(clips), seq_len)

    def padded_to(self, multiple: int) -> "PackedVideo":
        """The same clips with ``seq_len`` rounded up to a multiple of ``multiple`` (e.g. U·R)."""
        m = check_int("multiple", multiple, 1)
        return PackedVideo(self.clips, -(-self.seq_len // m) * m)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_clips(self) -> int:
        return len(self.clips)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(sorted({c.kind for c in self.clips}))

    @property
    def starts(self) -> Tuple[int, ...]:
        return tuple(int(x) for x in self._bounds[:-1])

    @property
    def total_tokens(self) -> int:
        return int(self._bounds[-1])

    @property
    def pad(self) -> int:
        return self.seq_len - self.total_tokens

    @property
    def cu_seqlens(self) -> List[int]:
        """Clip offsets ``[0, end_0, ..., end_{C-1}]``: one document per clip; the padding lies
        past the last offset (``attention.masks.packed``: it attends nothing and is never
        attended). ``PlacementPlan.cu_seqlens`` instead lists the padding as its own document."""
        return [int(x) for x in self._bounds]

    @property
    def num_loss_tokens(self) -> int:
        """Loss-bearing tokens of the micro-batch (full: every clip token; TF: the noisy halves)."""
        return sum(c.loss_tokens for c in self.clips)

    @property
    def digest(self) -> str:
        """Content digest (hex; the same in every process, unlike ``hash`` of strings)."""
        return hashlib.blake2b(repr(self).encode(), digest_size=8).hexdigest()

    # -- placement ------------------------------------------------------------------------------
    def placement_clips(self) -> Tuple[Clip, ...]:
        return tuple(c.placement_clip() for c in self.clips)

    def plan(
        self, ulysses_size: int, ring_size: int, cost: Optional[CostModel] = None, **kwargs
    ) -> PlacementPlan:
        """``placement.plan_placement`` of these clips over ``U x R`` CP ranks at this
        ``seq_len`` (pad first with ``padded_to(U·R)``); extra kwargs go to the planner."""
        return plan_placement(
            self.placement_clips(), ulysses_size, ring_size, cost, seq_len=self.seq_len, **kwargs
        )

    def check_placement(self, placement: Placement, cp_size: int) -> None:
        """``ValueError`` unless ``placement`` lays out this sequence over ``cp_size`` ranks."""
        if not isinstance(placement, Placement):
            raise ValueError(f"placement ({placement!r}) must be a layouts.placement.Placement")
        if placement.seq_len != self.seq_len or placement.cp_size != cp_size:
            raise ValueError(
                f"placement ({placement!r}) must cover the packed sequence's seq_len "
                f"({self.seq_len}) over cp_size ({cp_size}) ranks"
            )

    def local_ids(self, placement: Optional[Placement], cp_size: int, cp_rank: int) -> torch.Tensor:
        """Global ids CP rank ``cp_rank`` holds: ``placement.rank_ids(cp_rank)``; without a
        placement only ``cp_size == 1`` (every id in order) is defined."""
        if placement is None:
            if cp_size != 1:
                raise ValueError(
                    f"placement (None) must be given for a packed micro-batch at cp_size "
                    f"({cp_size}) > 1 (which global ids each CP rank holds)"
                )
            return torch.arange(self.seq_len)
        self.check_placement(placement, cp_size)
        return placement.rank_ids(cp_rank)

    # -- per-token identities -------------------------------------------------------------------
    def _ids(self, ids) -> torch.Tensor:
        g = torch.as_tensor(ids).long()
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= self.seq_len):
            raise ValueError(f"ids must lie in [0, seq_len ({self.seq_len}))")
        return g

    def clip_of(self, ids) -> torch.Tensor:
        """Clip index of each global id; ``-1`` for padding."""
        g = self._ids(ids)
        b = self._bounds.to(g.device)
        c = torch.searchsorted(b, g, right=True) - 1
        return torch.where(g < b[-1], c, torch.full_like(c, -1))

    def _table(self, values: Sequence[int], clip: torch.Tensor) -> torch.Tensor:
        """Per-clip ``values`` gathered at ``clip`` (padding: 1, a harmless divisor)."""
        t = torch.tensor(list(values) + [1], dtype=torch.long, device=clip.device)
        return t[torch.where(clip >= 0, clip, torch.full_like(clip, len(values)))]

    def offset(self, ids) -> torch.Tensor:
        """Position of each id inside its clip (``0`` for padding)."""
        g = self._ids(ids)
        c = self.clip_of(g)
        start = self._bounds.to(g.device)[c.clamp(min=0)]
        return torch.where(c >= 0, g - start, torch.zeros_like(g))

    def side(self, ids) -> torch.Tensor:
        """``0`` clean / ``1`` noisy (teacher forcing); ``0`` for full clips and padding."""
        c, off = self.clip_of(ids), self.offset(ids)
        half = self._table([c_.frame_tokens for c_ in self.clips], c)
        tf = self._table([int(c_.kind == "teacher_forcing") for c_ in self.clips], c)
        return torch.where((c >= 0) & (tf == 1), off // half, torch.zeros_like(off))

    def token_thw(self, ids) -> torch.Tensor:
        """``[..., 3]`` (frame, row, column) of each id on its own clip's grid (both TF halves
        share them); padding maps to ``(0, 0, 0)``."""
        c, off = self.clip_of(ids), self.offset(ids)
        half = self._table([c_.frame_tokens for c_ in self.clips], c)
        n = self._table([c_.positions for c_ in self.clips], c)
        w = self._table([c_.width for c_ in self.clips], c)
        p = (off % half) % n
        return torch.stack([(off % half) // n, p // w, p % w], dim=-1)

    def block(self, ids) -> torch.Tensor:
        """AR block of each id inside its clip (frame // frames_per_block; padding 0)."""
        fpb = self._table([c_.frames_per_block for c_ in self.clips], self.clip_of(ids))
        return self.token_thw(ids)[..., 0] // fpb

    def frame_ranges(self, ids) -> List[List[Tuple[int, int]]]:
        """Per clip, the (patched) frames its tokens among ``ids`` lie on, as sorted half-open
        runs ``[(a, b), ...]`` (both teacher-forcing halves of a frame map to that frame; ``[]``
        for a clip with no token among ``ids``; padding ignored): what a CP rank holding ``ids``
        must encode of each clip."""
        g = self._ids(ids)
        c, f = self.clip_of(g), self.token_thw(g)[..., 0]
        out: List[List[Tuple[int, int]]] = [[] for _ in self.clips]
        for ci in torch.unique(c[c >= 0]).tolist():
            runs = out[ci]
            for t in torch.unique(f[c == ci]).tolist():
                if runs and runs[-1][1] == t:
                    runs[-1] = (runs[-1][0], t + 1)
                else:
                    runs.append((t, t + 1))
        return out

    def loss_mask(self, ids) -> torch.Tensor:
        """True where the id bears loss: every token of a full clip, the noisy half of a
        teacher-forcing clip; never padding."""
        c = self.clip_of(ids)
        tf = self._table([int(c_.kind == "teacher_forcing") for c_ in self.clips], c)
        return (c >= 0) & ((tf == 0) | (self.side(ids) == 1))

    # -- packing helpers ------------------------------------------------------------------------
    def pack(self, per_clip: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """One tensor from per-clip tensors (``per_clip[c].shape[dim] == clips[c].tokens``),
        concatenated along ``dim`` and zero-padded to ``seq_len``."""
        if len(per_clip) != self.num_clips:
            raise ValueError(
                f"per_clip ({len(per_clip)} tensors) must hold one tensor per clip "
                f"({self.num_clips})"
            )
        for c, (x, clip) in enumerate(zip(per_clip, self.clips)):
            if x.shape[dim] != clip.tokens:
                raise ValueError(
                    f"per_clip[{c}].shape[{dim}] ({x.shape[dim]}) must equal the clip's "
                    f"tokens ({clip.tokens})"
                )
        parts = list(per_clip)
        if self.pad:
            shape = list(parts[0].shape)
            shape[dim] = self.pad
            parts.append(parts[0].new_zeros(shape))
        return torch.cat(parts, dim=dim)

    def unpack(self, x: torch.Tensor, dim: int = 0) -> List[torch.Tensor]:
        """Inverse of ``pack``: the per-clip slices of ``x`` along ``dim`` (padding dropped)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"x.shape[{dim}] ({x.shape[dim]}) must equal the packed seq_len ({self.seq_len})"
            )
        return [x.narrow(dim, s, c.tokens) for s, c in zip(self.starts, self.clips)]

    def __repr__(self) -> str:
        grids = ", ".join(
            f"{c.frames}x{c.height}x{c.width}"
            + ("" if c.kind == "full" else f"/tf{c.frames_per_block}")
            for c in self.clips
        )
        return f"PackedVideo([{grids}], seq_len={self.seq_len})"
