"""Work and memory counters of the engine (forward and backward)."""

from __future__ import annotations

from dataclasses import dataclass

from ...ops.rules import EMPTY, FULL, PARTIAL


@dataclass
class EngineStats:
    """Work and memory counters of the engine (forward and backward), accumulated over calls.

    ``steps`` blocks were planned (``steps_skipped`` had no visible pair at all); their tile grids
    held ``tiles`` tiles of which ``tiles_skipped`` EMPTY, ``tiles_full`` FULL, ``tiles_partial``
    PARTIAL; ``kernel_calls`` fused-kernel calls ran. ``max_mask_elements`` is the largest mask
    evaluated or allocated at once, ``max_score_elements`` the largest explicit score matrix
    (``"math"`` backend), both per (batch, head).
    """

    steps: int = 0
    steps_skipped: int = 0
    tiles: int = 0
    tiles_skipped: int = 0
    tiles_full: int = 0
    tiles_partial: int = 0
    kernel_calls: int = 0
    bwd_steps: int = 0
    bwd_steps_skipped: int = 0
    bwd_tiles: int = 0
    bwd_tiles_skipped: int = 0
    bwd_kernel_calls: int = 0
    max_mask_elements: int = 0
    max_score_elements: int = 0
    mask_seconds: float = 0.0

    def _mask(self, n: int) -> None:
        self.max_mask_elements = max(self.max_mask_elements, int(n))

    def _scores(self, n: int) -> None:
        self.max_score_elements = max(self.max_score_elements, int(n))

    def _plan(self, direction: str, plan) -> None:
        """Count one ring step's block (None: a step whose K/V never reach this rank, routed
        away because none of its queries may attend them: skipped, no tiles)."""
        p = "" if direction == "fwd" else "bwd_"
        setattr(self, p + "steps", getattr(self, p + "steps") + 1)
        if plan is None:
            setattr(self, p + "steps_skipped", getattr(self, p + "steps_skipped") + 1)
            return
        setattr(self, p + "steps_skipped", getattr(self, p + "steps_skipped") + int(not plan.calls))
        setattr(self, p + "tiles", getattr(self, p + "tiles") + plan.num_tiles)
        setattr(self, p + "tiles_skipped", getattr(self, p + "tiles_skipped") + plan.counts[EMPTY])
        setattr(self, p + "kernel_calls", getattr(self, p + "kernel_calls") + len(plan.calls))
        if direction == "fwd":
            self.tiles_full += plan.counts[FULL]
            self.tiles_partial += plan.counts[PARTIAL]
