"""Exact ring attention over a P2P ring (the inter-node level of 2D attention).

At step ``i`` rank ``r`` attends its queries to ring rank ``(r - i) mod R``'s K/V (the next block in
flight meanwhile), one engine block per step, merged by log-sum-exp. The backward sends K/V round
again with the dK/dV partial sums one step behind them, home after the last hop. The block plans
come from the plan cache (``attention.plans``), shared by every layer and the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..parallel.comm import RingExchange
from . import engine, kernels
from .engine import EngineStats as RingStats
from .engine import id_runs
from .masks import AttentionMask

__all__ = ["RingStats", "RingPlan", "id_runs", "ring_attention"]


@dataclass
class RingPlan:
    """Everything rank-specific that ring attention needs; ``ids[j]`` = global ids of ring rank j.

    ``backend`` is the engine's kernel family (``engine.engine_backend``), ``tile`` its tile size;
    ``blocks[j]`` the engine plan of this rank's queries against ring rank ``j``'s keys (``None``:
    built here, uncached, e.g. for a hand-made plan) and ``ids_key`` what determines ``ids``
    (hashable; ``None``: the plans are not kept in the cache).
    """

    group: object
    ring_rank: int
    ring_size: int
    ids: List[torch.Tensor]
    mask: Optional[AttentionMask]
    softmax_scale: float
    backend: str = "sdpa"
    stats: Optional[RingStats] = None
    tag: str = "ring"
    tile: int = engine.DEFAULT_TILE
    blocks: Optional[Sequence[engine.BlockPlan]] = None
    ids_key: Optional[tuple] = None
    device: str = "cpu"
    # K/V are this call's own copies (gathered by the all-to-all / reordered): the backward may
    # drop them once they are on the ring, instead of autograd keeping them to its end
    release_kv: bool = False

    def __post_init__(self):
        if self.blocks is None:
            self.blocks = ring_block_plans(
                self.ids_key,
                self.ids,
                self.ring_rank,
                self.mask,
                self.tile,
                self.backend,
                self.device,
                self.stats,
            )

    def block(self, j: int) -> engine.BlockPlan:
        """The engine plan of this rank's queries against ring rank ``j``'s keys."""
        return self.blocks[j]


def ring_block_plans(
    ids_key,
    ids: Sequence[torch.Tensor],
    ring_rank: int,
    mask,
    tile: int,
    backend: str,
    device="cpu",
    stats=None,
) -> tuple:
    """The engine plans of ring rank ``ring_rank``'s queries against every ring rank's keys, one
    cache entry for the whole ring (``ids_key`` None: built, not kept)."""
    debug = engine._debug()
    key = (
        None
        if ids_key is None
        else ("ring", ids_key, ring_rank, mask, tile, backend, str(device), debug)
    )
    return engine.PLANS.get(
        key,
        lambda: tuple(
            engine.plan_for(ids[ring_rank], k_ids, mask, tile, backend, stats) for k_ids in ids
        ),
    )


def _ring_forward(q, k, v, plan: RingPlan):
    out = lse = (
        None  # accumulators [b, h, s, d], [b, h, s]: the first block's output when it can be
    )
    R, r = plan.ring_size, plan.ring_rank
    cur_k, cur_v = k.contiguous(), v.contiguous()  # P2P buffers must be dense
    for i in range(R):
        j = (r - i) % R
        ex = (
            RingExchange([cur_k, cur_v], plan.group, 1, tag=f"{plan.tag}.kv", direction="fwd")
            if i < R - 1
            else None
        )  # posted before this block's compute: overlap
        bp = plan.block(j)
        if plan.stats is not None:
            plan.stats._plan("fwd", bp)
        if i > 0 and out is None:
            out, lse = engine.accumulators(q)
        out, lse = engine.block_forward(
            out,
            lse,
            q,
            cur_k,
            cur_v,
            bp,
            plan.softmax_scale,
            plan.backend,
            plan.stats,
            fresh=i == 0,
        )
        if ex is not None:
            cur_k, cur_v = ex.wait()
    if out is None:  # one ring rank, no visible pair
        out, lse = engine.accumulators(q)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, kv: list, out, lse, plan: RingPlan):
    """``kv = [k, v]``, emptied here: the only references left are the ring's own."""
    R, r = plan.ring_size, plan.ring_rank
    k_like = torch.empty(
        (*kv[0].shape[:2], 0, kv[0].shape[3]), dtype=kv[0].dtype, device=kv[0].device
    )  # shape / dtype / device of k, no storage
    hk, h, k_dtype = kv[0].shape[2], q.shape[2], kv[0].dtype
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # exp(s - inf) = 0 for dead rows
    dout = dout.transpose(1, 2).to(q.dtype)  # [b, h, s, d] view, like out
    cur_k, cur_v = (x.contiguous() for x in kv)
    kv.clear()
    dq = None  # the first kernel gradient that covers all rows becomes it (no zero fill)
    own = None  # (dk, dv) this rank's queries contributed to its own block (step 0)
    travel = None  # partial (dk, dv) of the block computed at the previous step, to pass on
    for i in range(R):
        j = (r - i) % R
        send = ([cur_k, cur_v] if i < R - 1 else []) + (list(travel) if travel is not None else [])
        travel = None
        ex = (
            RingExchange(send, plan.group, 1, tag=f"{plan.tag}.bwd", direction="bwd")
            if send
            else None
        )
        del send
        bp = plan.block(j)
        if plan.stats is not None:
            plan.stats._plan("bwd", bp)
        dq, dk, dv = engine.block_backward(
            dq,
            None,
            None,
            dout,
            q,
            cur_k,
            cur_v,
            out,
            lse,
            bp,
            plan.softmax_scale,
            plan.backend,
            plan.stats,
            fresh=True,
        )
        dk = engine._grad_zeros(k_like, h) if dk is None else dk  # q's heads; reduced below
        dv = engine._grad_zeros(k_like, h) if dv is None else dv
        dk, dv = kernels._reduce_kv(dk, hk), kernels._reduce_kv(dv, hk)
        recv = ex.wait() if ex is not None else []
        ex = None
        if i < R - 1:
            cur_k, cur_v = recv[:2]
            recv = recv[2:]
        else:
            cur_k = cur_v = None  # the last block's K/V are done with: free before the home hop
        if i == 0:
            own = (dk, dv)
        else:
            # The partial sums received now belong to block j (rank r-1 computed it last step).
            travel = (dk.add_(recv[0]), dv.add_(recv[1])) if recv else (dk, dv)
        del dk, dv, recv
    if travel is not None:  # last hop: the finished partial sums go home to their owner
        ex = RingExchange(list(travel), plan.group, 1, tag=f"{plan.tag}.bwd", direction="bwd")
        travel = None
        home = ex.wait()
        ex = None
        own = (own[0].add_(home[0]), own[1].add_(home[1]))
        del home
    dq = engine._grad_zeros(q, h) if dq is None else dq
    return dq.to(q.dtype), own[0].to(k_dtype), own[1].to(k_dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _ring_forward(q, k, v, plan)  # out [b, h, s, d] in q's dtype
        if plan.release_kv:  # private K/V: held here, and dropped by the backward after step 0
            ctx.save_for_backward(q, out, lse)
            ctx.kv = [k.detach(), v.detach()]
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.transpose(1, 2)  # a view: [b, s, h, d] strides of the saved [b, h, s, d]

    @staticmethod
    def backward(ctx, dout):
        if ctx.plan.release_kv:
            (q, out, lse), kv = ctx.saved_tensors, ctx.kv
            ctx.kv = None
        else:
            q, k, v, out, lse = ctx.saved_tensors
            kv = [k, v]
        dq, dk, dv = _ring_backward(dout, q, kv, out, lse, ctx.plan)
        return dq, dk, dv, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan
) -> torch.Tensor:
    """Exact attention of the local queries over the K/V of every ring rank (``[b, s, h, d]``)."""
    return _RingAttention.apply(q, k, v, plan)
