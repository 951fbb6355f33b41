"""Plan reuse: one bounded LRU cache of engine plans, shared by every layer, ring step, micro-batch
and the backward. A key holds only what determines a plan without reading device data: the layout
(or the local block's lengths), the mask (an immutable value), the tile, the kernel family, the
device and the debug flag; anything that changes gives a new key, hence a fresh plan.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

__all__ = ["PlanCache", "PLANS", "DEFAULT_MAXSIZE"]

DEFAULT_MAXSIZE = 128


class PlanCache:
    """LRU map ``key -> plan`` of at most ``maxsize`` entries; ``builds`` / ``hits`` count them."""

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize ({maxsize!r}) must be a positive int")
        self.maxsize = maxsize
        self._plans: "OrderedDict[Hashable, object]" = OrderedDict()
        self.builds = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key) -> bool:
        return key in self._plans

    def get(self, key: Optional[Hashable], build: Callable[[], object]):
        """The plan under ``key``, built by ``build()`` on a miss (key None: built, not kept)."""
        if key is not None and key in self._plans:
            self._plans.move_to_end(key)
            self.hits += 1
            return self._plans[key]
        plan = build()
        self.builds += 1
        if key is not None:
            self._plans[key] = plan
            while len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        """Drop every plan and reset the counters."""
        self._plans.clear()
        self.builds = self.hits = 0


PLANS = PlanCache()
