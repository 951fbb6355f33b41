"""Exact ring attention over a P2P ring (the inter-node level of 2D attention).

Each of the ``R`` ring ranks holds a shard of Q and of K/V together with the GLOBAL token ids of
every ring rank's shard (a pure function of the layout, so no ids travel). At step ``i`` rank ``r``
attends its queries to the K/V block of ring rank ``j = (r - i) mod R`` while the next block is
already in flight (posted before the compute). Partial results merge in float32 (float64 for
float64 inputs) by their log-sum-exp. Each step's mask is derived from the global ids of its Q and
KV shards; a step is cut into a grid of sub-blocks, one per pair of runs of consecutive ids (two
runs per shard for the zigzag layout), and every sub-block whose mask is empty is skipped (no
compute) and counted in :class:`RingStats`.

Backward (custom autograd): K/V travel the ring again; each rank computes its block's dK/dV from the
saved global ``out`` and ``lse`` and the partial sums ride along with the K/V messages, one step
behind, until the last hop brings them home to their owners (``R-1`` hops of K/V and ``R-1`` of
dK/dV accumulators, float32 for low precision inputs). Only one exchange is in flight at a time, so
P2P tags never interleave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..parallel.comm import RingExchange
from . import kernels
from .masks import EMPTY, FULL, AttentionMask

__all__ = ["RingStats", "RingPlan", "id_runs", "step_blocks", "ring_attention"]


@dataclass
class RingStats:
    """Work counters of ring attention (forward and backward), accumulated over calls.

    A ring step's block is cut into ``blocks`` sub-blocks (Q runs x KV runs); ``blocks_skipped`` of
    them were fully masked and not computed; ``steps_skipped`` steps had no visible key at all.
    """

    steps: int = 0
    steps_skipped: int = 0
    blocks: int = 0
    blocks_skipped: int = 0
    bwd_steps: int = 0
    bwd_steps_skipped: int = 0
    bwd_blocks: int = 0
    bwd_blocks_skipped: int = 0

    def _add(self, direction: str, cells: Sequence[Tuple[slice, slice, int]]) -> None:
        p = "" if direction == "fwd" else "bwd_"
        skipped = sum(1 for c in cells if c[2] == EMPTY)
        setattr(self, p + "steps", getattr(self, p + "steps") + 1)
        setattr(self, p + "steps_skipped", getattr(self, p + "steps_skipped") + int(skipped == len(cells)))
        setattr(self, p + "blocks", getattr(self, p + "blocks") + len(cells))
        setattr(self, p + "blocks_skipped", getattr(self, p + "blocks_skipped") + skipped)


def id_runs(ids: torch.Tensor) -> List[slice]:
    """Slices of maximal runs of consecutive ids (``ids[p+1] == ids[p] + 1``), pure."""
    n = ids.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(ids[1:] != ids[:-1] + 1).flatten() + 1).tolist()
    edges = [0] + breaks + [n]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def step_blocks(q_ids: torch.Tensor, k_ids: torch.Tensor,
                mask: Optional[AttentionMask]) -> List[Tuple[slice, slice, int]]:
    """The sub-blocks ``(q_slice, k_slice, status)`` of one ring step (pure).

    The grid is Q runs x KV runs; a whole block that is FULL or EMPTY is computed (or skipped) as
    one piece but still reports its grid cells, so counts do not depend on the shortcut.
    """
    q_runs, k_runs = id_runs(q_ids), id_runs(k_ids)
    whole = FULL if mask is None else mask.block_status(q_ids, k_ids)
    if whole in (FULL, EMPTY):
        return [(qs, ks, whole) for qs in q_runs for ks in k_runs]
    return [(qs, ks, mask.block_status(q_ids[qs], k_ids[ks])) for qs in q_runs for ks in k_runs]


def _pieces(cells, n_q: int, n_k: int):
    """What to compute: the whole block at once when every cell is FULL, else each non-empty cell."""
    if cells and all(c[2] == FULL for c in cells):
        return [(slice(0, n_q), slice(0, n_k), FULL)]
    return [c for c in cells if c[2] != EMPTY]


@dataclass
class RingPlan:
    """Everything rank-specific that ring attention needs; ``ids[j]`` = global ids of ring rank j."""

    group: object
    ring_rank: int
    ring_size: int
    ids: List[torch.Tensor]
    mask: Optional[AttentionMask]
    softmax_scale: float
    backend: str = "auto"
    stats: Optional[RingStats] = None
    tag: str = "ring"

    def cells(self, j: int):
        return step_blocks(self.ids[self.ring_rank], self.ids[j], self.mask)

    def dense(self, j: int, qs: slice, ks: slice, status: int):
        if status == FULL:
            return None
        return self.mask.dense(self.ids[self.ring_rank][qs], self.ids[j][ks])


def _merge(out_acc, lse_acc, o, lse):
    """Online-softmax merge of a partial result into the accumulators (in place)."""
    new = torch.logaddexp(lse_acc, lse)
    shift = torch.where(torch.isneginf(new), 0.0, new)  # rows still without keys stay 0 / -inf
    w_old = torch.exp(lse_acc - shift).transpose(1, 2)[..., None]
    w_new = torch.exp(lse - shift).transpose(1, 2)[..., None]
    out_acc.mul_(w_old).add_(o.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


def _ring_forward(q, k, v, plan: RingPlan):
    b, n_q, h, _ = q.shape
    acc = kernels.accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((b, h, n_q), float("-inf"), dtype=acc, device=q.device)
    R, r = plan.ring_size, plan.ring_rank
    cur_k, cur_v = k.contiguous(), v.contiguous()  # P2P buffers must be dense
    for i in range(R):
        j = (r - i) % R
        ex = (RingExchange([cur_k, cur_v], plan.group, 1, tag=f"{plan.tag}.kv", direction="fwd")
              if i < R - 1 else None)  # posted before this block's compute: overlap
        cells = plan.cells(j)
        if plan.stats is not None:
            plan.stats._add("fwd", cells)
        for qs, ks, st in _pieces(cells, n_q, cur_k.shape[1]):
            o, l = kernels.attention_forward(q[:, qs], cur_k[:, ks], cur_v[:, ks], plan.dense(j, qs, ks, st),
                                             plan.softmax_scale, plan.backend)
            _merge(out[:, qs], lse[:, :, qs], o, l)
        if ex is not None:
            cur_k, cur_v = ex.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    n_q, acc = q.shape[1], kernels.accumulation_dtype(q.dtype)
    R, r = plan.ring_size, plan.ring_rank
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur_k, cur_v = k.contiguous(), v.contiguous()
    own = None      # (dk, dv) this rank's queries contributed to its own block (step 0)
    travel = None   # partial (dk, dv) of the block computed at the previous step, to pass on
    for i in range(R):
        j = (r - i) % R
        send = ([cur_k, cur_v] if i < R - 1 else []) + (list(travel) if travel is not None else [])
        ex = RingExchange(send, plan.group, 1, tag=f"{plan.tag}.bwd", direction="bwd") if send else None
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        cells = plan.cells(j)
        if plan.stats is not None:
            plan.stats._add("bwd", cells)
        for qs, ks, st in _pieces(cells, n_q, cur_k.shape[1]):
            g = kernels.attention_backward(dout[:, qs], q[:, qs], cur_k[:, ks], cur_v[:, ks], out[:, qs],
                                           lse[:, :, qs], plan.dense(j, qs, ks, st),
                                           plan.softmax_scale, plan.backend)
            dq[:, qs] += g[0]
            dk[:, ks] += g[1]
            dv[:, ks] += g[2]
        recv = ex.wait() if ex is not None else []
        if i < R - 1:
            cur_k, cur_v = recv[:2]
            recv = recv[2:]
        if i == 0:
            own = (dk, dv)
        else:
            # The partial sums received now belong to block j (rank r-1 computed it last step).
            travel = (dk + recv[0], dv + recv[1]) if recv else (dk, dv)
    if travel is not None:  # last hop: the finished partial sums go home to their owner
        home = RingExchange(list(travel), plan.group, 1, tag=f"{plan.tag}.bwd", direction="bwd").wait()
        own = (own[0] + home[0], own[1] + home[1])
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan)
        return dq, dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> torch.Tensor:
    """Exact attention of the local queries over the K/V of every ring rank (``[b, s, h, d]``)."""
    return _RingAttention.apply(q, k, v, plan)
