"""Bucket grid for mixed lengths and shapes: aspect-ratio buckets at a latent area budget, frame
counts of the causal-VAE ``1 + 4k`` form, a token cap per clip; ``BucketGrid.plan`` maps a clip's
native ``(frames, height, width, fps)`` to its bucket and the resize / crop / frame window that
reaches it. Pure; design: docs/architecture.md, "Capabilities" 7; guide: docs/data.md, "Mixed
lengths and shapes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import List, Optional, Sequence, Tuple, Union

from ..checks import check_int
from ..layouts.placement import Clip
from ..layouts.vae_halo import num_raw_frames

__all__ = [
    "BucketConfig",
    "BucketGrid",
    "ClipPlan",
    "aspect_ratio",
    "resize_crop",
]

Ratio = Union[str, int, float]


def aspect_ratio(value: Ratio, name: str = "aspect_ratio") -> float:
    """``width / height`` of ``"W:H"`` (e.g. ``"16:9"``) or of a positive number."""
    if isinstance(value, str) and ":" in value:
        try:
            w, h = (float(v) for v in value.split(":"))
        except ValueError:
            w = h = float("nan")
        r = w / h if h else float("nan")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        r = float(value)
    else:
        r = float("nan")
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"{name} ({value!r}) must be 'W:H' or a number > 0 (width / height)")
    return r


def resize_crop(height: int, width: int, target_h: int, target_w: int) -> Tuple[int, int, int, int]:
    """``(resized_h, resized_w, top, left)``: scale ``height x width`` keeping its aspect until it
    covers ``target_h x target_w`` (the short side to the target), then centre-crop the excess of
    the other side."""
    s = max(target_h / height, target_w / width)
    nh, nw = max(target_h, round(height * s)), max(target_w, round(width * s))
    return nh, nw, (nh - target_h) // 2, (nw - target_w) // 2


@dataclass
class BucketConfig:
    """The grid (``validate`` checks every field; ``prefix`` names them, e.g. ``data.buckets.``).

    Sizes are latent units (pixels / ``spatial_stride``); the default area is 480 x 832 pixels
    (Wan's 480p) at stride 8. ``max_frames`` / ``frame_counts`` are raw frames, each ``1 + 4k``.
    """

    area: int = 60 * 104  # latent h * w budget per frame; each bucket's h * w <= area
    area_tolerance: float = 0.1  # and h * w >= (1 - area_tolerance) * area
    aspect_ratios: List[Ratio] = field(
        default_factory=lambda: ["16:9", "4:3", "1:1", "3:4", "9:16"]
    )
    max_frames: int = 129  # raw; 8 s at 16 fps
    frame_counts: Optional[List[int]] = None  # raw counts allowed; None: every 1 + 4k <= max
    fps: Optional[float] = None  # resample every clip to this rate; None: native frames
    tokens_per_microbatch: int = 65536
    max_clip_tokens: Optional[int] = None  # None: tokens_per_microbatch
    truncate: bool = True  # False: a clip longer than its bucket's frame cap raises
    patch_size: List[int] = field(default_factory=lambda: [1, 2, 2])  # (pt, ph, pw) on latents
    spatial_stride: int = 8
    temporal_stride: int = 4

    @classmethod
    def from_dict(cls, data, prefix: str = "") -> "BucketConfig":
        """From a mapping (a YAML section); unknown keys raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"{prefix.rstrip('.') or 'buckets'} ({data!r}) must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            where = prefix.rstrip(".") or "buckets"
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**data)
        cfg.validate(prefix)
        return cfg

    def validate(self, prefix: str = "") -> None:
        p = prefix
        for name in ("area", "max_frames", "tokens_per_microbatch", "spatial_stride"):
            check_int(p + name, getattr(self, name), 1)
        check_int(p + "temporal_stride", self.temporal_stride, 1)
        ps = self.patch_size
        if not isinstance(ps, (list, tuple)) or len(ps) != 3:
            raise ValueError(f"{p}patch_size ({ps!r}) must be 3 integers (pt, ph, pw)")
        for i, v in enumerate(ps):
            check_int(f"{p}patch_size[{i}]", v, 1)
        if not isinstance(self.aspect_ratios, (list, tuple)) or not self.aspect_ratios:
            raise ValueError(f"{p}aspect_ratios ({self.aspect_ratios!r}) must be a non-empty list")
        for i, r in enumerate(self.aspect_ratios):
            aspect_ratio(r, f"{p}aspect_ratios[{i}]")
        self._check_raw(p + "max_frames", self.max_frames)
        fc = self.frame_counts
        if fc is not None and (not isinstance(fc, (list, tuple)) or not fc):
            raise ValueError(f"{p}frame_counts ({fc!r}) must be a non-empty list or null")
        for i, n in enumerate(fc or []):
            self._check_raw(f"{p}frame_counts[{i}]", n)
            if n > self.max_frames:
                raise ValueError(
                    f"{p}frame_counts[{i}] ({n}) must be <= {p}max_frames ({self.max_frames})"
                )
        if self.fps is not None and not (
            isinstance(self.fps, (int, float)) and not isinstance(self.fps, bool) and self.fps > 0
        ):
            raise ValueError(f"{p}fps ({self.fps!r}) must be a number > 0 or null")
        if self.max_clip_tokens is not None:
            check_int(p + "max_clip_tokens", self.max_clip_tokens, 1)
            if self.max_clip_tokens > self.tokens_per_microbatch:
                raise ValueError(
                    f"{p}max_clip_tokens ({self.max_clip_tokens}) must be <= "
                    f"{p}tokens_per_microbatch ({self.tokens_per_microbatch})"
                )
        t = self.area_tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1:
            raise ValueError(f"{p}area_tolerance ({t!r}) must be a number in [0, 1)")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"{p}truncate ({self.truncate!r}) must be true or false")

    def _check_raw(self, name: str, n) -> None:
        st = self.temporal_stride
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (n - 1) % st:
            raise ValueError(
                f"{name} ({n!r}) must be 1 + {st}k raw frames (the causal VAE maps frame 0 to "
                f"latent 0 and frames {st}k-{st - 1}..{st}k to latent k)"
            )

    @property
    def clip_cap(self) -> int:
        return self.max_clip_tokens or self.tokens_per_microbatch


@dataclass(frozen=True)
class ClipPlan:
    """How one clip reaches its bucket. Pixels: resize to ``resized`` then crop
    ``crop = (top, left, height, width)``; time: ``num_frames`` output frames (``1 + 4(F-1)``),
    frame ``i`` = source frame ``round((frame_offset + i) * frame_step)``."""

    key: str
    bucket: int  # index into BucketGrid.shapes
    latent: Tuple[int, int, int]  # (F, h, w)
    tokens: int
    tokens_per_frame: int  # tokens of one latent frame (after patchify)
    num_frames: int  # raw frames fed to the VAE
    frame_offset: int  # output frames skipped at the start (centred temporal crop)
    frame_step: float  # source frames per output frame (1.0 without resampling)
    resized: Tuple[int, int]
    crop: Tuple[int, int, int, int]
    kept_fraction: float  # share of the native frame area inside the crop

    @property
    def is_image(self) -> bool:
        return self.num_frames == 1

    def source_frames(self) -> List[int]:
        """Source frame index of each output frame."""
        return [round((self.frame_offset + i) * self.frame_step) for i in range(self.num_frames)]

    def placement_clip(self, kind: str = "full", frames_per_block: int = 1) -> Clip:
        """The clip for ``layouts.placement`` (cost model, placement): teacher forcing doubles the
        tokens (``[clean ; noisy]``); block kinds use ``frames_per_block`` latent-frame blocks
        (in patched frames)."""
        block = self.tokens_per_frame * frames_per_block
        if kind == "teacher_forcing":
            return Clip(2 * self.tokens, kind, block)
        return Clip(self.tokens, kind, block if kind == "block_causal" else 0)


class BucketGrid:
    """The buckets of a ``BucketConfig``: ``shapes`` (latent ``(h, w)``, multiples of the patch, in
    ``aspect_ratios`` order, duplicates dropped) and ``latent_frames`` (allowed counts, ascending).
    """

    def __init__(self, config: Optional[BucketConfig] = None):
        self.config = c = config or BucketConfig()
        c.validate()
        self.patch = tuple(c.patch_size)
        shapes: List[Tuple[int, int]] = []
        for i, r in enumerate(c.aspect_ratios):
            s = self._shape(aspect_ratio(r), f"aspect_ratios[{i}] ({r!r})")
            if s not in shapes:
                shapes.append(s)
        self.shapes = tuple(shapes)
        self.latent_frames = self._latent_frames()
        biggest = max(self.tokens(f, b) for b in range(len(shapes)) for f in self.latent_frames[:1])
        if biggest > c.clip_cap:
            name = "max_clip_tokens" if c.max_clip_tokens else "tokens_per_microbatch"
            raise ValueError(
                f"{name} ({c.clip_cap}) must hold the shortest allowed clip "
                f"({self.latent_frames[0]} latent frames) of the biggest bucket ({biggest} tokens)"
            )

    def _shape(self, r: float, what: str) -> Tuple[int, int]:
        """Multiples ``(h, w)`` of ``(ph, pw)`` with ``(1 - area_tolerance) * area <= h * w <= area``
        and ``w / h`` closest to ``r`` (in log; ties: the larger area, then the smaller ``h``)."""
        _, ph, pw = self.patch
        area, lo = self.config.area, (1 - self.config.area_tolerance) * self.config.area
        best = None
        for h in range(ph, area // pw + 1, ph):
            for w in range(-(-math.ceil(lo / h - 1e-9) // pw) * pw, area // h + 1, pw):
                if w >= pw:
                    score = (abs(math.log(w / h / r)), -h * w, h)
                    best = min(best or (score, (h, w)), (score, (h, w)))
        if best is None:
            raise ValueError(
                f"area ({area}) is too small for {what}: no (h, w) multiple of the patch "
                f"({ph} x {pw}) with {lo:g} <= h * w <= area"
            )
        return best[1]

    def _latent_frames(self) -> Tuple[int, ...]:
        c, pt = self.config, self.patch[0]
        st = c.temporal_stride
        raw = c.frame_counts or range(1, c.max_frames + 1, st)
        lat = sorted({1 + (n - 1) // st for n in raw})
        lat = tuple(f for f in lat if f % pt == 0)
        if not lat:
            raise ValueError(
                f"frame_counts ({c.frame_counts}) / max_frames ({c.max_frames}) must allow a latent "
                f"frame count divisible by patch_size[0] ({pt})"
            )
        return lat

    def tokens_per_frame(self, bucket: int) -> int:
        h, w = self.shapes[bucket]
        return (h // self.patch[1]) * (w // self.patch[2])

    def tokens(self, latent_frames: int, bucket: int) -> int:
        return latent_frames // self.patch[0] * self.tokens_per_frame(bucket)

    def bucket_of(self, height: int, width: int) -> int:
        """The bucket that keeps the most of a ``height x width`` frame (the closest aspect ratio;
        ties: the lower index)."""
        r = width / height
        return min(range(len(self.shapes)), key=lambda b: (_crop_loss(r, self.shapes[b]), b))

    def plan(
        self,
        key,
        frames: int,
        height: int,
        width: int,
        fps: Optional[float] = None,
        shape: Optional[Sequence[int]] = None,
    ) -> ClipPlan:
        """Map one clip (native raw ``frames``, ``height x width`` pixels, ``fps``) to its bucket;
        ``shape``: an explicit latent ``(h, w)`` (must be a bucket). Rules: docs/data.md,
        "Mixed lengths and shapes"; bad input raises ``ValueError`` naming ``key``."""
        who = f"clip {key!r}"
        for name, v in (("frames", frames), ("height", height), ("width", width)):
            check_int(f"{who}: {name}", v, 1)
        bucket = self.bucket_of(height, width) if shape is None else self._explicit(who, shape)
        avail, step = self._resampled(who, frames, fps)
        F = self._frames(who, 1 + (avail - 1) // self.config.temporal_stride, bucket)
        n = num_raw_frames(F, self.config.temporal_stride)
        h, w = self.shapes[bucket]
        th, tw = h * self.config.spatial_stride, w * self.config.spatial_stride
        nh, nw, top, left = resize_crop(height, width, th, tw)
        return ClipPlan(
            key=str(key),
            bucket=bucket,
            latent=(F, h, w),
            tokens=self.tokens(F, bucket),
            tokens_per_frame=self.tokens_per_frame(bucket),
            num_frames=n,
            frame_offset=(avail - n) // 2,
            frame_step=step,
            resized=(nh, nw),
            crop=(top, left, th, tw),
            kept_fraction=(th * tw) / (nh * nw),
        )

    def _explicit(self, who: str, shape) -> int:
        s = tuple(shape) if isinstance(shape, (list, tuple)) else shape
        if s not in self.shapes:
            raise ValueError(
                f"{who}: shape ({shape!r}) must be one of the grid's latent (h, w) buckets "
                f"{list(self.shapes)}"
            )
        return self.shapes.index(s)

    def _resampled(self, who: str, frames: int, fps) -> Tuple[int, float]:
        """``(frames available at the target rate, source frames per output frame)``."""
        target = self.config.fps
        if target is None or frames == 1:
            return frames, 1.0
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise ValueError(f"{who}: fps ({fps!r}) must be a number > 0 to resample to {target}")
        step = fps / target
        return math.floor((frames - 1) / step + 1e-9) + 1, step

    def _frames(self, who: str, avail: int, bucket: int) -> int:
        """The largest allowed latent frame count <= ``avail`` whose tokens fit the clip cap."""
        cap = self.config.clip_cap
        fits = [f for f in self.latent_frames if self.tokens(f, bucket) <= cap]
        best = [f for f in fits if f <= avail]
        if not best:
            raise ValueError(
                f"{who}: {avail} latent frame(s) must reach the shortest allowed count "
                f"({self.latent_frames[0]} latent = "
                f"{num_raw_frames(self.latent_frames[0], self.config.temporal_stride)} raw frames)"
            )
        if not self.config.truncate and avail > fits[-1]:
            raise ValueError(
                f"{who}: {avail} latent frames must be at most the longest clip of bucket "
                f"{self.shapes[bucket]} ({fits[-1]} latent frames: max_frames "
                f"{self.config.max_frames}, max_clip_tokens {cap}) when truncate is false"
            )
        return best[-1]

    def plan_many(
        self, records: Sequence[dict], errors: Optional[List[Tuple[str, str]]] = None
    ) -> List[ClipPlan]:
        """``plan`` of each metadata record (``num_frames``, ``height``, ``width``, ``fps``, ``key``
        as ``prepare`` writes them; the key defaults to the record's index). With ``errors`` (a
        list), a bad clip is appended as ``(key, message)`` and left out instead of raising."""
        out = []
        for i, r in enumerate(records):
            key = r.get("key", i)
            try:
                missing = [k for k in ("num_frames", "height", "width") if k not in r]
                if missing:
                    raise ValueError(f"clip {key!r}: record lacks {missing}")
                out.append(self.plan(key, r["num_frames"], r["height"], r["width"], r.get("fps")))
            except ValueError as e:
                if errors is None:
                    raise
                errors.append((str(key), str(e)))
        return out

    def histogram(self, plans: Sequence[ClipPlan]) -> List[dict]:
        """Per bucket: latent and pixel shape, clips, images, mean / max tokens, mean kept share."""
        rows = []
        for b, (h, w) in enumerate(self.shapes):
            ps = [p for p in plans if p.bucket == b]
            rows.append(
                dict(
                    bucket=b,
                    latent_hw=[h, w],
                    pixels_hw=[h * self.config.spatial_stride, w * self.config.spatial_stride],
                    clips=len(ps),
                    images=sum(p.is_image for p in ps),
                    mean_tokens=sum(p.tokens for p in ps) / len(ps) if ps else 0.0,
                    max_tokens=max((p.tokens for p in ps), default=0),
                    mean_kept=sum(p.kept_fraction for p in ps) / len(ps) if ps else 0.0,
                )
            )
        return rows


def _crop_loss(r: float, shape: Tuple[int, int]) -> float:
    """Share of a ``w / h = r`` frame cropped away to reach ``shape``'s aspect."""
    a = r / (shape[1] / shape[0])
    return 1.0 - min(a, 1.0 / a)
