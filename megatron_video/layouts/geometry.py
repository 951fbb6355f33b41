"""``VideoGeometry``: the global token grid of one video sample (frames x height x width).

Its own small module so that every layer (layouts, attention, models, training) can name a sample's
shape without importing a layout or anything that communicates (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_positive_int

__all__ = ["VideoGeometry"]


@dataclass(frozen=True)
class VideoGeometry:
    """Global token grid of one sample: ``frames`` x ``height`` x ``width`` (after patchify)."""

    frames: int
    height: int
    width: int

    def __post_init__(self):
        for name in ("frames", "height", "width"):
            check_positive_int(name, getattr(self, name))

    @property
    def positions(self) -> int:
        return self.height * self.width

    @property
    def tokens(self) -> int:
        return self.frames * self.positions

    @property
    def is_image(self) -> bool:
        return self.frames == 1
