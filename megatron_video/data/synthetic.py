"""The embedded default data: procedural videos of a moving, bouncing, colour-changing shape, each
fully determined by ``(seed, index)``, with captions over a small fixed vocabulary
(``CaptionTokenizer`` over ``models.embedders.VOCAB``; no model hub).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..models.embedders import PAD, UNK, VOCAB

__all__ = [
    "COLORS",
    "SHAPES",
    "SIZES",
    "DIRECTIONS",
    "ShapeAttributes",
    "sample_attributes",
    "render_video",
    "caption_for",
    "CaptionTokenizer",
    "ProceduralVideoDataset",
    "shard_indices",
]

# RGB in [0, 1]; mapped to [-1, 1] when rendering.
COLORS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.2),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "cyan": (0.1, 0.9, 0.9),
    "magenta": (0.9, 0.15, 0.9),
    "white": (1.0, 1.0, 1.0),
    "orange": (1.0, 0.55, 0.05),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = {"small": 0.12, "large": 0.2}  # radius as a fraction of min(H, W)
# Unit direction (dx, dy) in pixel coordinates (y grows downwards).
DIRECTIONS = {
    "left to right": (1.0, 0.0),
    "right to left": (-1.0, 0.0),
    "top to bottom": (0.0, 1.0),
    "bottom to top": (0.0, -1.0),
}
_BACKGROUND = -1.0


@dataclass(frozen=True)
class ShapeAttributes:
    """Everything a sample is rendered from. Positions and speed are in pixels (per frame)."""

    shape: str
    size: str
    color_start: str
    color_end: str
    direction: Optional[str]  # None for images (T = 1)
    radius: float
    x0: float
    y0: float
    speed: float


def sample_attributes(
    seed: int, index: int, *, num_frames: int, height: int, width: int
) -> ShapeAttributes:
    """Deterministic attributes of sample ``index`` under ``seed``."""
    _check_geometry(num_frames, height, width)
    rng = np.random.default_rng([seed, index])
    shape = SHAPES[rng.integers(len(SHAPES))]
    size = tuple(SIZES)[rng.integers(len(SIZES))]
    names = tuple(COLORS)
    color_start = names[rng.integers(len(names))]
    # Half the videos change colour; images never do (there is no time to change over).
    changes = num_frames > 1 and rng.random() < 0.5
    color_end = (
        names[(names.index(color_start) + 1 + rng.integers(len(names) - 1)) % len(names)]
        if changes
        else color_start
    )
    direction = tuple(DIRECTIONS)[rng.integers(len(DIRECTIONS))] if num_frames > 1 else None
    radius = max(1.5, SIZES[size] * min(height, width))
    (xlo, xhi), (ylo, yhi) = _bounds(radius, width), _bounds(radius, height)
    x0, y0 = rng.uniform(xlo, xhi), rng.uniform(ylo, yhi)
    speed = 0.0
    if direction is not None:
        dx, dy = DIRECTIONS[direction]
        lo, hi = (xlo, xhi) if dx else (ylo, yhi)
        # Start in the half the shape moves away from, so the first frames move as the caption says.
        half = 0.5 * (hi - lo)
        start = rng.uniform(lo, lo + half) if dx + dy > 0 else rng.uniform(hi - half, hi)
        x0, y0 = (start, y0) if dx else (x0, start)
        speed = rng.uniform(0.04, 0.08) * (width if dx else height)
    return ShapeAttributes(
        shape,
        size,
        color_start,
        color_end,
        direction,
        float(radius),
        float(x0),
        float(y0),
        float(speed),
    )


def _check_geometry(num_frames: int, height: int, width: int) -> None:
    if num_frames < 1:
        raise ValueError(f"num_frames ({num_frames}) must be >= 1")
    for name, v in (("height", height), ("width", width)):
        if v < 8:
            raise ValueError(f"{name} ({v}) must be >= 8")


def _bounds(radius: float, extent: int) -> tuple[float, float]:
    return radius, extent - 1 - radius


def _reflect(p: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Fold unbounded positions into ``[lo, hi]`` (elastic bounces off both walls)."""
    span = hi - lo
    q = np.mod(p - lo, 2 * span)
    return lo + np.where(q > span, 2 * span - q, q)


def render_video(attrs: ShapeAttributes, *, num_frames: int, height: int, width: int) -> Tensor:
    """Render ``attrs`` as a ``[3, T, H, W]`` float32 video in ``[-1, 1]``."""
    _check_geometry(num_frames, height, width)
    t = np.arange(num_frames, dtype=np.float64)
    dx, dy = DIRECTIONS[attrs.direction] if attrs.direction is not None else (0.0, 0.0)
    cx = _reflect(attrs.x0 + dx * attrs.speed * t, *_bounds(attrs.radius, width))
    cy = _reflect(attrs.y0 + dy * attrs.speed * t, *_bounds(attrs.radius, height))
    ddx = np.arange(width, dtype=np.float64)[None, None, :] - cx[:, None, None]
    ddy = np.arange(height, dtype=np.float64)[None, :, None] - cy[:, None, None]
    r = attrs.radius
    if attrs.shape == "circle":
        mask = ddx**2 + ddy**2 <= r**2
    elif attrs.shape == "square":
        mask = np.maximum(np.abs(ddx), np.abs(ddy)) <= 0.85 * r  # about the circle's area
    elif attrs.shape == "triangle":
        mask = (ddy >= -r) & (ddy <= r) & (np.abs(ddx) <= 0.5 * (ddy + r))  # apex up, base 2r
    elif attrs.shape == "diamond":
        mask = np.abs(ddx) + np.abs(ddy) <= r
    else:
        raise ValueError(f"attrs.shape ({attrs.shape!r}) must be one of {SHAPES}")
    c0, c1 = np.array(COLORS[attrs.color_start]), np.array(COLORS[attrs.color_end])
    frac = t / max(num_frames - 1, 1)
    color = (c0[None] + frac[:, None] * (c1 - c0)[None]) * 2.0 - 1.0  # [T, 3] in [-1, 1]
    video = _BACKGROUND + mask[None] * (color.T[:, :, None, None] - _BACKGROUND)
    return torch.from_numpy(video.astype(np.float32))


def caption_for(attrs: ShapeAttributes) -> str:
    """Caption from the attributes, e.g. "a small red circle bouncing left to right, turning blue"."""
    words = ["a", attrs.size, attrs.color_start, attrs.shape]
    if attrs.direction is not None:
        words += ["bouncing", attrs.direction]
    if attrs.color_end != attrs.color_start:
        words[-1] += ","
        words += ["turning", attrs.color_end]
    return " ".join(words)


class CaptionTokenizer:
    """Word-level tokenizer over ``VOCAB``: ids padded to ``max_len`` plus a bool mask of real tokens."""

    def __init__(self, max_len: int = 16, vocab: Sequence[str] = VOCAB):
        if max_len < 1:
            raise ValueError(f"max_len ({max_len}) must be >= 1")
        if len(set(vocab)) != len(vocab) or vocab[0] != PAD or UNK not in vocab:
            raise ValueError(
                f"vocab must hold unique words, start with {PAD!r} and contain {UNK!r}"
            )
        self.max_len = max_len
        self.vocab = tuple(vocab)
        self._ids = {w: i for i, w in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> tuple[Tensor, Tensor]:
        words = re.findall(r"[a-z]+|,", text.lower())
        if len(words) > self.max_len:
            raise ValueError(
                f"caption length ({len(words)} tokens) must be <= max_len ({self.max_len}): "
                f"{text!r}"
            )
        ids = torch.zeros(self.max_len, dtype=torch.long)
        ids[: len(words)] = torch.tensor(
            [self._ids.get(w, self._ids[UNK]) for w in words], dtype=torch.long
        )
        mask = torch.zeros(self.max_len, dtype=torch.bool)
        mask[: len(words)] = True
        return ids, mask

    def encode_batch(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        pairs = [self.encode(t) for t in texts]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def decode(self, ids: Tensor, mask: Tensor) -> str:
        return " ".join(self.vocab[int(i)] for i, m in zip(ids, mask) if m).replace(" ,", ",")


class ProceduralVideoDataset(torch.utils.data.Dataset):
    """``num_samples`` procedural videos; item ``i`` is a dict with ``video [3, T, H, W]``, ``caption``,
    ``caption_ids [L]``, ``caption_mask [L]`` and ``index``.

    ``image_fraction`` of the samples (chosen deterministically from ``(seed, index)``) are images
    (``T = 1``) for mixed image/video packing; such batches need a packing collate, not the default one.

    Each sample: a shape (circle, square, triangle, diamond) of a size, starting colour, optional
    end colour and direction bounces off the walls on a black background; videos are float32 in
    ``[-1, 1]``. The caption is built from the same attributes ("a small red circle bouncing left to
    right, turning blue"), tokenised to fixed-length ids plus a mask.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        num_frames: int = 17,
        height: int = 32,
        width: int = 32,
        seed: int = 0,
        caption_len: int = 16,
        image_fraction: float = 0.0,
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples ({num_samples}) must be >= 1")
        if not 0.0 <= image_fraction <= 1.0:
            raise ValueError(f"image_fraction ({image_fraction}) must be in [0, 1]")
        _check_geometry(num_frames, height, width)
        self.num_samples, self.num_frames, self.height, self.width = (
            num_samples,
            num_frames,
            height,
            width,
        )
        self.seed, self.image_fraction = seed, image_fraction
        self.tokenizer = CaptionTokenizer(caption_len)

    def __len__(self) -> int:
        return self.num_samples

    def frames_of(self, index: int) -> int:
        # A separate stream from the attributes so changing image_fraction does not reshuffle them.
        is_image = np.random.default_rng([self.seed, index, 1]).random() < self.image_fraction
        return 1 if is_image else self.num_frames

    def attributes(self, index: int) -> ShapeAttributes:
        self._check_index(index)
        return sample_attributes(
            self.seed, index, num_frames=self.frames_of(index), height=self.height, width=self.width
        )

    def __getitem__(self, index: int) -> dict:
        attrs = self.attributes(index)
        video = render_video(
            attrs, num_frames=self.frames_of(index), height=self.height, width=self.width
        )
        caption = caption_for(attrs)
        ids, mask = self.tokenizer.encode(caption)
        return {
            "video": video,
            "caption": caption,
            "caption_ids": ids,
            "caption_mask": mask,
            "index": index,
        }

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index ({index}) must be in [0, {self.num_samples})")


def check_dp_rank(dp_rank: int, dp_size: int) -> None:
    """``ValueError`` unless ``0 <= dp_rank < dp_size`` (the data-parallel split of every reader)."""
    if dp_size < 1:
        raise ValueError(f"dp_size ({dp_size}) must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size={dp_size})")


def shard_indices(
    num_samples: int, dp_rank: int, dp_size: int, *, seed: Optional[int] = None, epoch: int = 0
) -> list[int]:
    """Indices for data-parallel rank ``dp_rank``: a (seeded, per-epoch) permutation, strided by rank.

    Ranks get disjoint subsets whose union is ``range(num_samples)``; sizes differ by at most one
    (callers that need equal step counts drop the tail). ``seed=None`` keeps the natural order.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples ({num_samples}) must be >= 0")
    check_dp_rank(dp_rank, dp_size)
    if seed is None:
        order = torch.arange(num_samples)
    else:
        order = torch.randperm(
            num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        )
    return order[dp_rank::dp_size].tolist()
