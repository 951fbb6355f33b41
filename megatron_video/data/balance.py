"""Balance a global batch of clips over data-parallel ranks x micro-batches by predicted cost
(``layouts.placement.CostModel``), each micro-batch within a token budget. Pure; guide:
docs/data.md, "Mixed lengths and shapes".
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import List, Optional, Sequence, Tuple

from ..checks import check_int
from ..layouts.placement import Clip, CostModel

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
    check_int("dp_size", dp_size, 1)
    check_int("num_microbatches", num_microbatches, 1)
    check_int("tokens_per_microbatch", budget, 1)
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


def _best_exchange(bins, load, used, costs, tokens, budget, top):
    """The move of one clip off rank ``top`` to another rank, or swap of one of its clips with a
    cheaper one, that gives the lowest max of the two ranks' loads (ties by index), within the
    budget: ``(new max, i, j or -1, m, d, m2)`` or ``None``."""
    best = None
    for m, b in enumerate(bins[top]):
        for i in b:
            for d in range(len(load)):
                if d == top:
                    continue
                for m2, b2 in enumerate(bins[d]):
                    swaps = [(j, costs[i] - costs[j], tokens[i] - tokens[j]) for j in b2]
                    for j, dc, dt in [(-1, costs[i], tokens[i])] + swaps:
                        if dc <= 0 or used[d][m2] + dt > budget or used[top][m] - dt > budget:
                            continue
                        cand = (max(load[top] - dc, load[d] + dc), i, j, m, d, m2)
                        best = cand if best is None or cand < best else best
    return best


def _refine(bins, load, used, costs, tokens, budget, rounds: int) -> None:
    """Local search after the greedy pass: while a move or swap off the most loaded rank lowers
    that pair's max, apply the best one (each step lowers the sum of squared loads, so it ends)."""
    for _ in range(rounds):
        top = max(range(len(load)), key=lambda r: (load[r], -r))
        got = _best_exchange(bins, load, used, costs, tokens, budget, top)
        if got is None or got[0] >= load[top] * (1 - 1e-12):
            return
        _, i, j, m, d, m2 = got
        dc = costs[i] - (costs[j] if j >= 0 else 0.0)
        dt = tokens[i] - (tokens[j] if j >= 0 else 0)
        bins[top][m].remove(i)
        bins[d][m2].append(i)
        if j >= 0:
            bins[d][m2].remove(j)
            bins[top][m].append(j)
        load[top], load[d] = load[top] - dc, load[d] + dc
        used[top][m], used[d][m2] = used[top][m] - dt, used[d][m2] + dt


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
    the least loaded rank with room, then moves / swaps of single clips off the most loaded rank
    while they lower it (``_refine``). If a clip fits nowhere, the greedy pass runs in decreasing
    token order (first-fit-decreasing packing); if that fails too, ``ValueError``. Always
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
    _refine(bins, load, used, costs, tokens, tokens_per_microbatch, rounds=4 * len(costs))
    return Assignment(
        bins=tuple(tuple(tuple(sorted(b)) for b in rank) for rank in bins),
        rank_cost=tuple(load),
        bin_tokens=tuple(tuple(u) for u in used),
        tokens_per_microbatch=tokens_per_microbatch,
    )
