"""Enumerate layouts, cost them, rank them, and say why the runner-up loses.

Legality is the caller's (``legal(layout) -> None or the rule it breaks``: the training config's
own validators, ``training/planning.py``), so no divisibility rule is restated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from .cost import Cluster, Layout, ModelShape, StepCost, step_cost
from .hardware import Hardware

__all__ = ["Plan", "candidate_layouts", "search", "why_slower", "format_table"]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    gpus: int, gpus_per_node: int, num_layers: int, micro_batch_sizes=(1, 2, 4), fsdp=(False, True)
) -> Iterator[Layout]:
    """Every TP x PP x (Ulysses x ring) x DP x recompute x micro-batch size x FSDP (``fsdp``: the
    choices; only where DP x CP > 1) whose product is ``gpus``; TP and Ulysses stay inside a
    node."""
    for tp in _divisors(min(gpus, gpus_per_node)):
        if gpus % tp:
            continue
        for pp in _divisors(num_layers):
            if pp > 64 or (gpus // tp) % pp:
                continue
            rest = gpus // (tp * pp)
            for cp in _divisors(rest):
                for u in _divisors(cp):
                    if tp * u > gpus_per_node:
                        continue
                    shards = [f for f in fsdp if rest > 1 or not f]
                    for rc in (False, True):
                        for mb in micro_batch_sizes:
                            for f in shards:
                                yield Layout(tp, pp, rest // cp, u, cp // u, rc, mb, f)


@dataclass
class Plan:
    """All legal layouts, costed and sorted (fitting first, then by step throughput)."""

    costs: List[StepCost]
    illegal: List[tuple]  # (layout, the rule it breaks)

    @property
    def fitting(self) -> List[StepCost]:
        return [c for c in self.costs if c.fits]


def search(
    shape: ModelShape,
    cluster: Cluster,
    hw: Hardware,
    legal: Callable[[Layout], Optional[str]],
    micro_batch_sizes=(1, 2, 4),
    fsdp=(False, True),
) -> Plan:
    costs, illegal = [], []
    for lay in candidate_layouts(
        cluster.gpus, cluster.gpus_per_node, shape.num_layers, micro_batch_sizes, fsdp
    ):
        why = legal(lay)
        if why is not None:
            illegal.append((lay, why))
            continue
        costs.append(step_cost(shape, lay, cluster, hw))
    costs.sort(key=lambda c: (not c.fits, -c.tokens_per_s_per_gpu, c.mem_bytes))
    # a tie within TIE of the best: fewer model-parallel ranks (TP x CP x PP) first, then memory —
    # the same predicted speed with less communication whose fixed costs the model leaves out
    if costs and costs[0].fits:
        top = costs[0].tokens_per_s_per_gpu * (1 - TIE)
        n = sum(1 for c in costs if c.fits and c.tokens_per_s_per_gpu >= top)
        costs[:n] = sorted(costs[:n], key=lambda c: (_model_parallel(c.layout), c.mem_bytes))
    return Plan(costs, illegal)


TIE = 0.01


def _model_parallel(lay: Layout) -> int:
    return lay.tp * lay.cp * lay.pp


def why_slower(best: StepCost, other: StepCost) -> str:
    """One sentence: the cost where ``other`` loses most GPU-time per token against ``best``."""

    def per_token(c: StepCost, k: str) -> float:  # GPU-seconds of cost k per token
        return c.parts.get(k, 0.0) * c.gpus / c.tokens_per_step

    k = max(best.parts, key=lambda k: per_token(other, k) - per_token(best, k))
    loss = 1 - other.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
    return (
        f"{other.layout.name()} has {loss:.0%} fewer tokens/s/GPU, mostly {k}: "
        f"{per_token(other, k) * 1e3:.3g} vs {per_token(best, k) * 1e3:.3g} GPU-ms per token"
    )


def format_table(costs: List[StepCost], top: int = 5) -> str:
    head = (
        f"{'layout':<34}{'step s':>9}{'tok/s/GPU':>11}{'TFLOP/s/GPU':>13}{'MFU':>7}"
        f"{'mem GiB':>9}  dominant"
    )
    rows = [head]
    for c in costs[:top]:
        rows.append(
            f"{c.layout.name():<34}{c.step_s:>9.3g}{c.tokens_per_s_per_gpu:>11.4g}"
            f"{c.tflops_per_gpu:>13.4g}{c.mfu:>7.1%}{c.mem_gib:>9.1f}  {c.dominant}"
        )
    return "\n".join(rows)
