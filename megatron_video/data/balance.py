"""Balance a global batch of clips over data-parallel ranks x micro-batches by predicted cost
(``layouts.placement.CostModel``), each micro-batch within a token budget. Pure; guide:
docs/data.md, "Mixed lengths and shapes".
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import List, Optional, Sequence, Tuple

from ..layouts.placement import Clip, CostModel, _int

__all__ = ["Assignment", "balance_clips", "clip_costs"]


def clip_costs(clips: Sequence[Clip], cost: Optional[CostModel] = None) -> List[float]:
    """``CostModel.clip`` of each clip (attention pairs after masking + linear work)."""
    cost = cost or CostModel()
    return [cost.clip(c) for c in clips]


@dataclass(frozen=True)
class Assignment:
    """``bins[d][m]``: the clip indices (ascending) of micro-batch ``m`` of DP rank ``d``;
    ``rank_cost[d]``: their summed cost; ``bin_tokens[d][m]``: their tokens."""

    bins: Tuple[Tuple[Tuple[int, ...], ...], ...]
    rank_cost: Tuple[float, ...]
    bin_tokens: Tuple[Tuple[int, ...], ...]
    tokens_per_microbatch: int

    def imbalance(self) -> float:
        """``max / mean`` of the per-rank cost (1.0 = balanced)."""
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return max(self.rank_cost) / mean if mean else 1.0


def _check(costs, tokens, dp_size, num_microbatches, budget) -> None:
    _int("dp_size", dp_size, 1)
    _int("num_microbatches", num_microbatches, 1)
    _int("tokens_per_microbatch", budget, 1)
    if len(costs) != len(tokens) or not tokens:
        raise ValueError(
            f"costs ({len(costs)}) and tokens ({len(tokens)}) must be non-empty and of equal length"
        )
    for i, (c, t) in enumerate(zip(costs, tokens)):
        if isinstance(t, bool) or not isinstance(t, Integral) or not 1 <= t <= budget:
            raise ValueError(
                f"tokens[{i}] ({t!r}) must be an integer in [1, tokens_per_microbatch={budget}]"
            )
        if isinstance(c, bool) or not isinstance(c, Real) or not c >= 0:
            raise ValueError(f"costs[{i}] ({c!r}) must be a number >= 0")


def _greedy(order, costs, tokens, D, M, budget):
    """Each clip of ``order`` into the least loaded rank with room (ties: the lower rank), there
    into its least loaded micro-batch with room (ties: the lower index); ``None`` if some clip
    fits nowhere."""
    load = [0.0] * D
    mb_load = [[0.0] * M for _ in range(D)]
    used = [[0] * M for _ in range(D)]
    bins = [[[] for _ in range(M)] for _ in range(D)]
    for i in order:
        fit = None
        for d in sorted(range(D), key=lambda r: (load[r], r)):
            room = [m for m in range(M) if used[d][m] + tokens[i] <= budget]
            if room:
                fit = d, min(room, key=lambda m: (mb_load[d][m], m))
                break
        if fit is None:
            return None
        d, m = fit
        load[d] += costs[i]
        mb_load[d][m] += costs[i]
        used[d][m] += tokens[i]
        bins[d][m].append(i)
    return bins, load, used


def balance_clips(
    costs: Sequence[float],
    tokens: Sequence[int],
    dp_size: int,
    num_microbatches: int,
    tokens_per_microbatch: int,
) -> Assignment:
    """Assign clips (``costs[i]``, ``tokens[i]``) to ``dp_size`` ranks x ``num_microbatches``
    micro-batches, each micro-batch at most ``tokens_per_microbatch`` tokens, minimising the
    largest per-rank cost: longest-processing-time first (dearest clip first, ties by index) into
    the least loaded rank with room. If a clip fits nowhere, the same rule in decreasing token
    order (first-fit-decreasing packing) is tried; if that fails too, ``ValueError``. Always
    succeeds when the clips' tokens are at most ``dp_size * num_microbatches *
    tokens_per_microbatch / 2`` and each clip at most half the budget. Pure and deterministic."""
    costs, tokens = list(costs), list(tokens)
    _check(costs, tokens, dp_size, num_microbatches, tokens_per_microbatch)
    costs, tokens = [float(c) for c in costs], [int(t) for t in tokens]
    n = range(len(costs))
    by_cost = sorted(n, key=lambda i: (-costs[i], i))
    by_tokens = sorted(n, key=lambda i: (-tokens[i], -costs[i], i))
    args = (costs, tokens, dp_size, num_microbatches, tokens_per_microbatch)
    got = _greedy(by_cost, *args) or _greedy(by_tokens, *args)
    if got is None:
        raise ValueError(
            f"tokens ({sum(tokens)} in {len(tokens)} clips) must fit dp_size ({dp_size}) x "
            f"num_microbatches ({num_microbatches}) micro-batches of tokens_per_microbatch "
            f"({tokens_per_microbatch}); greedy packing failed: give fewer clips per step"
        )
    bins, load, used = got
    return Assignment(
        bins=tuple(tuple(tuple(sorted(b)) for b in rank) for rank in bins),
        rank_cost=tuple(load),
        bin_tokens=tuple(tuple(u) for u in used),
        tokens_per_microbatch=tokens_per_microbatch,
    )
