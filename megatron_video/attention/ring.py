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

from ..parallel.comm import RingExchange, record_skipped
from . import engine, kernels
from .engine import EngineStats as RingStats
from .engine import id_runs
from .masks import AttentionMask
from .plans import PLANS

__all__ = ["RingStats", "RingPlan", "RingRoutes", "id_runs", "ring_attention", "ring_routes"]


@dataclass(frozen=True)
class RingRoutes:
    """How far each ring rank's K/V travel (pure function of the ids and the mask).

    The K/V of ring rank ``j`` visit ``j+1, j+2, ...`` (hop ``i`` is rank ``(j+i) % R``). ``keep[j]``:
    the positions of ``j``'s keys that some other ring rank's queries may attend (None: all), the
    only ones that leave ``j``; ``last[j]``: the last hop that needs them (0: they never leave);
    ``first[j]``: the first such hop (``R``: none), where their dK/dV partial sums start to travel
    home (hop ``R``) the same way. A send is skipped only if no later hop needs what it carries.
    """

    keep: tuple
    last: tuple
    first: tuple

    def kv_leaves(self, j: int, hop: int, ring_size: int) -> bool:
        """K/V of ``j`` go from hop ``hop`` to ``hop + 1``."""
        return hop < ring_size - 1 and hop + 1 <= self.last[j]

    def grads_leave(self, j: int, hop: int) -> bool:
        """dK/dV partial sums of ``j`` go from hop ``hop`` to ``hop + 1`` (``R``: home)."""
        return self.first[j] <= hop


def ring_routes(ids: Sequence[torch.Tensor], mask: Optional[AttentionMask]) -> RingRoutes:
    """``RingRoutes`` of ring ranks holding ``ids[j]`` (global ids) under ``mask``."""
    R = len(ids)
    keep, last, first = [], [], []
    for j in range(R):
        hops, used, every = [], torch.zeros(ids[j].numel(), dtype=torch.bool), False
        for i in range(1, R):
            need = None if mask is None else mask.keys_needed(ids[(j + i) % R], ids[j])
            if need is None or bool(need.any()):
                hops.append(i)
                every = every or need is None
                used = used if need is None else used | need
        whole = not hops or every or bool(used.all())
        keep.append(None if whole else torch.nonzero(used).flatten())
        last.append(max(hops, default=0))
        first.append(min(hops, default=R))
    return RingRoutes(tuple(keep), tuple(last), tuple(first))


@dataclass
class RingPlan:
    """Everything rank-specific that ring attention needs; ``ids[j]`` = global ids of ring rank j.

    ``backend`` is the engine's kernel family (``engine.engine_backend``), ``tile`` its tile size;
    ``blocks[j]`` the engine plan of this rank's queries against the keys of ring rank ``j`` that
    reach it (``routes``; None: none do), and ``ids_key`` what determines ``ids`` (hashable;
    ``None``: the plans are not kept in the cache). Both are built here when not given.
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
    blocks: Optional[Sequence[Optional[engine.BlockPlan]]] = None
    ids_key: Optional[tuple] = None
    device: str = "cpu"
    # K/V are this call's own copies (gathered by the all-to-all / reordered): the backward may
    # drop them once they are on the ring, instead of autograd keeping them to its end
    release_kv: bool = False
    routes: Optional[RingRoutes] = None

    def __post_init__(self):
        if self.blocks is None or self.routes is None:
            self.routes, self.blocks = ring_block_plans(
                self.ids_key,
                self.ids,
                self.ring_rank,
                self.mask,
                self.tile,
                self.backend,
                self.device,
                self.stats,
            )

    def block(self, j: int) -> Optional[engine.BlockPlan]:
        """The engine plan of this rank's queries against the keys of ring rank ``j`` it gets."""
        return self.blocks[j]


def _on_device(routes: RingRoutes, device: str) -> RingRoutes:
    """``routes`` with its kept positions on ``device`` (copied once per plan: indexing device
    tensors with host indices would copy them on every ring step)."""
    if device == "cpu" or all(x is None for x in routes.keep):
        return routes
    keep = tuple(None if x is None else x.to(device) for x in routes.keep)
    return RingRoutes(keep, routes.last, routes.first)


def _reached_plans(ids, ring_rank, mask, tile, backend, stats, device="cpu"):
    routes = ring_routes(ids, mask)
    R, r = len(ids), ring_rank
    blocks = []
    for j, k_ids in enumerate(ids):
        hop = (r - j) % R
        if hop > routes.last[j]:  # never reaches this rank: nothing its queries may attend
            blocks.append(None)
            continue
        if hop and routes.keep[j] is not None:
            k_ids = k_ids[routes.keep[j]]
        blocks.append(engine.plan_for(ids[r], k_ids, mask, tile, backend, stats))
    return _on_device(routes, str(device)), tuple(blocks)


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
    """``(routes, plans)``: the ring's ``RingRoutes`` and the engine plans of ring rank
    ``ring_rank``'s queries against the keys of every ring rank that reach it, one cache entry for
    the whole ring (``ids_key`` None: built, not kept)."""
    debug = engine.debug_enabled()
    key = (
        None
        if ids_key is None
        else ("ring", ids_key, ring_rank, mask, tile, backend, str(device), debug)
    )
    return PLANS.get(
        key, lambda: _reached_plans(ids, ring_rank, mask, tile, backend, stats, device)
    )


def _kv_buffers(like: torch.Tensor, n: int, count: int = 2, dtype=None) -> list:
    shape = (like.shape[0], n, *like.shape[2:])
    return [torch.empty(shape, dtype=dtype or like.dtype, device=like.device) for _ in range(count)]


def _kv_exchange(
    plan: RingPlan, i: int, cur, like, full: int, extra_send=(), extra_recv=(), direction="fwd"
):
    """Post step ``i``'s ring exchange: the K/V held (origin ``r - i``) when a later hop needs
    them (only the kept keys; at hop 0 cut from the full block), plus ``extra_*``; skipped sends
    and receives are counted on each side. Returns the exchange and whether K/V arrive."""
    R, r, routes = plan.ring_size, plan.ring_rank, plan.routes
    j, j_in = (r - i) % R, (r - 1 - i) % R
    kv_out = routes.kv_leaves(j, i, R)
    kv_in = routes.kv_leaves(j_in, i, R)
    send = list(extra_send)
    if kv_out:
        keep = routes.keep[j] if i == 0 else None
        send = [x.index_select(1, keep) if keep is not None else x for x in cur] + send
    recv = list(extra_recv)
    if kv_in:
        recv = _kv_buffers(like, _kept(routes, j_in, full)) + recv
    if i < R - 1:
        record_skipped(plan.group, 2 * (not kv_out), 2 * (not kv_in), f"{plan.tag}.kv", direction)
    if R == 1:
        return None, kv_in  # a ring of one: nothing moves, no group needed
    tag = f"{plan.tag}.kv" if direction == "fwd" else f"{plan.tag}.bwd"
    ex = RingExchange(
        send, plan.group, 1, tag=tag, direction=direction, recv=recv, device=like.device
    )  # posted even when nothing moves (pads: every ring rank joins each batch)
    return ex, kv_in


def _ring_forward(q, k, v, plan: RingPlan):
    out = lse = (
        None  # accumulators [b, h, s, d], [b, h, s]: the first block's output when it can be
    )
    R, r = plan.ring_size, plan.ring_rank
    cur = [k.contiguous(), v.contiguous()]  # P2P buffers must be dense; [] once K/V stop here
    for i in range(R):
        j = (r - i) % R
        # posted before this block's compute: overlap
        ex, kv_in = _kv_exchange(plan, i, cur, k, k.shape[1]) if i < R - 1 else (None, False)
        bp = plan.block(j)
        if plan.stats is not None:
            plan.stats._plan("fwd", bp)
        if bp is not None:
            if i > 0 and out is None:
                out, lse = engine.accumulators(q)
            out, lse = engine.block_forward(
                out,
                lse,
                q,
                cur[0],
                cur[1],
                bp,
                plan.softmax_scale,
                plan.backend,
                plan.stats,
                fresh=i == 0,
            )
        recv = ex.wait() if ex is not None else []
        cur = recv[:2] if kv_in else []
    if out is None:  # one ring rank, no visible pair
        out, lse = engine.accumulators(q)
    return out.to(q.dtype), lse


def _block_grads(plan: RingPlan, j: int, dq, dout, q, cur, out, lse):
    """``(dq, dk, dv)`` after block ``j`` (dk / dv over the keys held, K/V heads, accumulation
    dtype; zeros when no query attends them)."""
    h, hk = q.shape[2], cur[0].shape[2]
    bp = plan.block(j)
    dk = dv = None
    if bp is not None:
        if plan.stats is not None:
            plan.stats._plan("bwd", bp)
        dq, dk, dv = engine.block_backward(
            dq,
            None,
            None,
            dout,
            q,
            cur[0],
            cur[1],
            out,
            lse,
            bp,
            plan.softmax_scale,
            plan.backend,
            plan.stats,
            fresh=True,
        )
    dk = engine.grad_zeros(cur[0], h) if dk is None else dk  # q's heads; reduced below
    dv = engine.grad_zeros(cur[1], h) if dv is None else dv
    return dq, kernels._reduce_kv(dk, hk), kernels._reduce_kv(dv, hk)


def _kept(routes: RingRoutes, j: int, full: int) -> int:
    """Keys of ring rank ``j`` that leave it (``full``: all of its block)."""
    return full if routes.keep[j] is None else routes.keep[j].numel()


def _grads_home(plan: RingPlan, travel: list, home_in: bool, own: list, like, n: int, acc):
    """The last hop of the backward: ``travel`` (dK, dV partial sums of the previous ring rank's
    block) leave, and this rank's own arrive (``home_in``: ``n`` kept keys) and are added to
    ``own``. dK first, then dV, so that one part of each is in flight at a time. Returns ``own``."""
    keep = plan.routes.keep[plan.ring_rank]
    for part in range(2):
        ex = RingExchange(
            travel[part : part + 1],
            plan.group,
            1,
            tag=f"{plan.tag}.bwd",
            direction="bwd",
            recv=_kv_buffers(like, n, count=1, dtype=acc) if home_in else [],
            device=like.device,
        )
        if travel:
            travel[part] = None  # the exchange holds it until sent
        home = ex.wait()
        ex = None
        if home_in and keep is None:
            own[part].add_(home[0])
        elif home_in:
            own[part].index_add_(1, keep, home[0])
        del home
    return own


def _ring_backward(dout, q, kv: list, out, lse, plan: RingPlan):
    """``kv = [k, v]``, emptied here: the only references left are the ring's own. K/V travel as
    in the forward; the dK/dV partial sums of each block follow one hop behind from the first hop
    that needs it, and go home after the last (``RingRoutes``)."""
    R, r, routes = plan.ring_size, plan.ring_rank, plan.routes
    k_dtype = kv[0].dtype
    acc = kernels.accumulation_dtype(k_dtype)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # exp(s - inf) = 0 for dead rows
    dout = dout.transpose(1, 2).to(q.dtype)  # [b, h, s, d] view, like out
    cur = [x.contiguous() for x in kv]
    kv.clear()
    full = cur[0].shape[1]
    # shape / dtype / device of k without its storage (a view would keep K alive to the end)
    like = cur[0].new_empty((cur[0].shape[0], 0, *cur[0].shape[2:]))
    dq = None  # the first kernel gradient that covers all rows becomes it (no zero fill)
    own = None  # (dk, dv) this rank's queries contributed to its own block (step 0)
    travel = []  # partial (dk, dv) of the block computed at the previous step, to pass on
    for i in range(R):
        j = (r - i) % R
        tr_in = i >= 1 and routes.grads_leave(j, i - 1)  # partial sums of block j, from r - 1
        tr_recv = _kv_buffers(like, _kept(routes, j, full), dtype=acc) if tr_in else []
        if i >= 2:  # where an unrouted ring sends partial sums on (from step 2 on)
            record_skipped(plan.group, 2 * (not travel), 2 * (not tr_in), f"{plan.tag}.bwd", "bwd")
        ex, kv_in = _kv_exchange(plan, i, cur, like, full, travel, tr_recv, direction="bwd")
        travel = []
        dk = dv = None
        if cur:
            dq, dk, dv = _block_grads(plan, j, dq, dout, q, cur, out, lse)
        elif plan.stats is not None:
            plan.stats._plan("bwd", None)
        recv = ex.wait() if ex is not None else []
        ex = None
        cur, recv = (recv[:2], recv[2:]) if kv_in else ([], recv)
        if i == 0:
            own = (dk, dv)
        elif tr_in:  # received partial sums belong to block j (rank r-1 computed it last step)
            travel = [recv[0].add_(dk), recv[1].add_(dv)] if dk is not None else recv
        elif routes.grads_leave(j, i):
            travel = [dk, dv]
        del dk, dv, recv
    home_in = R > 1 and routes.grads_leave(r, R - 1)
    if R > 1:
        record_skipped(plan.group, 2 * (not travel), 2 * (not home_in), f"{plan.tag}.bwd", "bwd")
    dq = engine.grad_zeros(q, q.shape[2]) if dq is None else dq
    dq = dq.to(q.dtype)  # before the last hop: no accumulation-dtype dQ beside the partial sums
    if R > 1:  # last hop: the finished partial sums go home (every ring rank posts: pads)
        own = _grads_home(plan, travel, home_in, list(own), like, _kept(routes, r, full), acc)
        travel = []
    return dq, own[0].to(k_dtype), own[1].to(k_dtype)


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
