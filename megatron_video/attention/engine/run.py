"""Running plans: ``block_forward`` / ``block_backward`` (accumulators merged through the
log-sum-exp), the plan cache lookup, the backend choice and ``local_attention`` (autograd)."""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from ...ops.rules import PARTIAL
from .. import kernels
from ..masks import AttentionMask
from ..plans import PLANS
from . import flex
from .planning import BlockPlan, check_tile, choose_tile, debug_enabled, flex_plan, plan_block
from .stats import EngineStats
from .tiles import (
    _bwd_math,
    _bwd_sdpa,
    _fwd_math,
    _fwd_sdpa,
    _heads_first,
    _merge,
    _rows,
    _runnable,
)


def _fwd_call(qt, kt, vt, plan, index, c, scale, fwd, stats, acc_dtype):
    """``(o, lse)`` of one call (``[batch, h, n, d]``, ``[batch, h, n]``), rows without keys
    zero / -inf."""
    if fwd is _fwd_math and stats is not None:
        stats._scores((c.q.stop - c.q.start) * (c.k.stop - c.k.start))
    m = (
        plan.tile_mask(c, qt.device, stats, index)
        if (c.kind == PARTIAL or fwd is _fwd_math)
        else None
    )
    n, qs, ks = c.batch, c.q_step, c.k_step
    o, lse = fwd(
        _rows(qt, c.q, 2, n, qs), _rows(kt, c.k, 2, n, ks), _rows(vt, c.k, 2, n, ks), c, m, scale
    )
    lse = lse.to(acc_dtype)
    dead = plan.dead_rows(index, qt.device) if c.kind == PARTIAL else None
    if dead is not None:  # fused kernels report lse = 0 (or NaN) for rows without keys
        lse = lse.masked_fill(dead, float("-inf"))
        o = o.masked_fill(dead[:, None], 0.0)
    return o, lse


def block_forward(
    out_acc: Optional[torch.Tensor],
    lse_acc: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    backend: str,
    stats: Optional[EngineStats] = None,
    fresh: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Attention of ``q [b, sq, h, d]`` over ``k, v [b, sk, hk, d]`` merged into the accumulators
    ``out_acc [b, h, sq, d]`` and ``lse_acc [b, h, sq]`` (accumulation dtype, in place); returns
    the accumulators.

    ``fresh``: the accumulators hold nothing yet, so a call whose rows no earlier call touched is
    written instead of merged. With ``fresh`` the accumulators may be ``None``: a first call that
    covers every row in the accumulation dtype then becomes them (no zero fill, no copy); otherwise
    they are allocated (``accumulators``). Without any call they stay as given.
    """
    if not plan.calls:
        return out_acc, lse_acc
    if out_acc is None and not fresh:
        raise ValueError("block_forward: out_acc / lse_acc may be None only with fresh=True")
    h = q.shape[2]
    if backend == "flex":
        qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
        o, lse = flex.flex_lse(qt, kt, vt, flex.block_mask(plan, q.device), scale)
        if out_acc is None:
            out_acc, lse_acc = accumulators(q)
        _merge(out_acc, lse_acc, o, lse.to(lse_acc.dtype))  # flex: -inf on rows without keys
        return out_acc, lse_acc
    qt = q.transpose(1, 2)
    acc_dtype = kernels.accumulation_dtype(q.dtype)
    kt, vt = _heads_first(k, h, False), _heads_first(v, h, False)
    fwd = _fwd_math if backend == "math" else _fwd_sdpa
    touched = []  # q rows written in this block
    for index, c in _runnable(plan, range(len(plan.calls)), q.shape[0]):
        o, lse = _fwd_call(qt, kt, vt, plan, index, c, scale, fwd, stats, acc_dtype)
        rows = c.q_rows
        if out_acc is None:
            if c.batch == 1 and rows == (0, q.shape[1]) and o.dtype == acc_dtype:
                out_acc, lse_acc = o, lse  # the kernel's fresh buffers become the accumulators
                touched.append(rows)
                continue
            out_acc, lse_acc = accumulators(q)
        out_c = _rows(out_acc, c.q, 2, c.batch, c.q_step)
        lse_c = _rows(lse_acc, c.q, 2, c.batch, c.q_step)
        if fresh and not any(a < rows[1] and rows[0] < e for a, e in touched):
            out_c.copy_(o)
            lse_c.copy_(lse)
        else:
            _merge(out_c, lse_c, o, lse)
        touched.append(rows)
    return out_acc, lse_acc


def grad_zeros(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, _, d = x.shape
    return torch.zeros(b, s, heads, d, dtype=kernels.accumulation_dtype(x.dtype), device=x.device)


def _accumulate(
    acc: Optional[torch.Tensor],
    rows: slice,
    g: torch.Tensor,
    like: torch.Tensor,
    heads: int,
    batch: int = 1,
    step: int = 0,
) -> torch.Tensor:
    """``acc[:, rows] += g`` (``g [b, h, n, d]``; batched: block ``i`` at ``rows + i * step``); a
    missing ``acc`` becomes ``g`` itself when ``g`` covers every row in the accumulation dtype (no
    zero fill, no copy), else zeros first."""
    g = g.transpose(1, 2)
    if acc is None:
        if (
            batch == 1
            and rows.start == 0
            and rows.stop == like.shape[1]
            and g.dtype == kernels.accumulation_dtype(like.dtype)
        ):
            return g
        acc = grad_zeros(like, heads)
    _rows(acc, rows, 1, batch, step).add_(g)
    return acc


def block_backward(
    dq_acc: Optional[torch.Tensor],
    dk_acc: Optional[torch.Tensor],
    dv_acc: Optional[torch.Tensor],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    backend: str,
    stats: Optional[EngineStats] = None,
    fresh: bool = False,
):
    """Accumulate this block's ``dq [b, sq, h, d]`` and ``dk, dv [b, sk, h, d]`` (expanded heads,
    accumulation dtype) given the GLOBAL ``out [b, h, sq, d]`` and ``lse [b, h, sq]`` of the rows
    (``lse = +inf`` on rows without any visible key, so their gradients are zero); returns the
    accumulators. With ``fresh`` an accumulator may be None: the first call's gradient becomes it
    where it covers every position, else it is allocated; it stays None without any call."""
    if not plan.calls:
        return dq_acc, dk_acc, dv_acc
    if dq_acc is None or dk_acc is None or dv_acc is None:
        if not fresh:
            raise ValueError("block_backward: accumulators may be None only with fresh=True")
    h = q.shape[2]
    if backend == "flex":
        dq_acc = grad_zeros(q, h) if dq_acc is None else dq_acc
        dk_acc = grad_zeros(k, h) if dk_acc is None else dk_acc
        dv_acc = grad_zeros(v, h) if dv_acc is None else dv_acc
        _flex_backward(dq_acc, dk_acc, dv_acc, dout, q, k, v, out, lse, plan, scale)
        return dq_acc, dk_acc, dv_acc
    # torch's CPU kernels take strided [b, h, s, d] views: no copies of q, k, v, out or dout per step
    qt = q.transpose(1, 2)
    kt, vt = _heads_first(k, h, False), _heads_first(v, h, False)
    bwd = _bwd_math if backend == "math" else _bwd_sdpa
    for index, c in _runnable(plan, plan.backward_order(), q.shape[0]):
        m = (
            plan.tile_mask(c, q.device, stats, index)
            if (c.kind == PARTIAL or backend == "math")
            else None
        )
        n, qs, ks = c.batch, c.q_step, c.k_step
        g = bwd(  # each part dropped once accumulated: not held while the next is allocated
            _rows(dout, c.q, 2, n, qs),
            _rows(qt, c.q, 2, n, qs),
            _rows(kt, c.k, 2, n, ks),
            _rows(vt, c.k, 2, n, ks),
            _rows(out, c.q, 2, n, qs),
            _rows(lse, c.q, 2, n, qs),
            c,
            m,
            scale,
        )
        g = list(g)
        dq_acc = _accumulate(dq_acc, c.q, g.pop(0), q, h, n, qs)
        dk_acc = _accumulate(dk_acc, c.k, g.pop(0), k, h, n, ks)
        dv_acc = _accumulate(dv_acc, c.k, g.pop(0), v, h, n, ks)
    return dq_acc, dk_acc, dv_acc


def _flex_backward(dq_acc, dk_acc, dv_acc, dout, q, k, v, out, lse, plan, scale):
    """Recompute the block under autograd and back-propagate the merged output's gradient.

    With ``w = exp(lse_block - lse)``: ``d out_block = w * dout`` and
    ``d lse_block = w * rowsum(dout * (out_block - out))`` (the LSE merge's derivative).
    """
    with torch.enable_grad():
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        o, lb = flex.flex_lse(qt, kt, vt, flex.block_mask(plan, q.device), scale)
        glob = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
        w = torch.exp(lb.detach().to(glob.dtype) - glob)
        w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        g_o = (w[..., None] * dout.to(w.dtype)).to(o.dtype)
        g_l = (w * (dout.to(w.dtype) * (o.detach().to(w.dtype) - out.to(w.dtype))).sum(-1)).to(
            lb.dtype
        )
        dq, dk, dv = torch.autograd.grad((o, lb), (qt, kt, vt), (g_o, g_l), allow_unused=True)
    hk = k.shape[2]
    dq_acc += dq.transpose(1, 2).to(dq_acc.dtype)
    # dk/dv come back with the kv heads of k; spread them on the expanded accumulator's first copy
    rep = q.shape[2] // hk
    dk = dk.transpose(1, 2).to(dk_acc.dtype)
    dv = dv.transpose(1, 2).to(dv_acc.dtype)
    if rep == 1:
        dk_acc += dk
        dv_acc += dv
    else:
        dk_acc.view(*dk_acc.shape[:2], hk, rep, dk_acc.shape[-1])[:, :, :, 0] += dk
        dv_acc.view(*dv_acc.shape[:2], hk, rep, dv_acc.shape[-1])[:, :, :, 0] += dv


def plan_for(
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    mask: Optional[AttentionMask],
    tile: int,
    backend: str,
    stats: Optional[EngineStats] = None,
) -> BlockPlan:
    """The plan a backend runs: fixed tiles over the block for ``"flex"``, run tiles otherwise."""
    t0 = time.perf_counter()
    if backend == "flex":
        plan = flex_plan(q_ids, k_ids, mask, tile, stats)
    else:
        plan = plan_block(q_ids, k_ids, mask, tile, merge=backend != "math", stats=stats)
    if stats is not None:
        stats.mask_seconds += time.perf_counter() - t0
    return plan


def cached_plan(
    ids_key,
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    mask: Optional[AttentionMask],
    tile: int,
    backend: str,
    device,
    stats: Optional[EngineStats] = None,
    cache: bool = True,
) -> BlockPlan:
    """``plan_for`` through the plan cache: ``ids_key`` (hashable) must determine ``q_ids`` and
    ``k_ids``; ``cache=False`` builds without keeping (a mask that lives for one call)."""
    debug = debug_enabled()
    key = ("block", ids_key, mask, tile, backend, str(device), debug) if cache else None
    return PLANS.get(key, lambda: plan_for(q_ids, k_ids, mask, tile, backend, stats))


def engine_backend(backend: str, q: torch.Tensor, mask=None) -> str:
    """The engine's kernel family for ``backend``, ``q`` and ``mask``: ``"math"``, ``"sdpa"`` or
    ``"flex"``. ``"auto"`` takes FlexAttention on CUDA for masks that define ``pair``. ``"flex"``
    on CPU runs torch's unfused flex math path (forward and backward): the GPU path's BlockMask,
    mask_mods and LSE merge checked on CPU, not a fast path."""
    flex_ok = mask is None or not isinstance(mask, AttentionMask) or mask.has_pair
    if backend == "auto":
        if q.dtype == torch.float64:
            return "math"
        if q.is_cuda and kernels._flex() is not None and flex_ok:
            return "flex"
        return "sdpa" if (q.is_cuda or kernels._has_cpu_flash()) else "math"
    if backend not in ("math", "sdpa", "flex", "flash_attn"):
        raise ValueError(f"backend ({backend!r}) must be 'auto' or one of {kernels.BACKENDS}")
    if backend not in kernels.available_backends():
        raise ValueError(
            f"backend ({backend!r}) is not available here (available: "
            f"{kernels.available_backends()})"
        )
    if backend == "flash_attn":  # torch's flash kernel runs the unmasked fp16/bf16 calls on CUDA
        return "sdpa"
    if backend == "flex" and not flex_ok:
        raise ValueError(
            f"backend ('flex') needs a mask with an elementwise pair(); {mask!r} has none"
        )
    return backend


def accumulators(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zero ``out [b, h, s, d]`` and ``-inf`` ``lse [b, h, s]`` in the accumulation dtype."""
    b, s, h, d = q.shape
    acc = kernels.accumulation_dtype(q.dtype)
    return (
        torch.zeros(b, h, s, d, dtype=acc, device=q.device),
        torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device),
    )


class _EngineAttention(torch.autograd.Function):
    """One block (all queries x all keys) through the engine, with its own backward."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, backend, stats):
        out, lse = block_forward(None, None, q, k, v, plan, scale, backend, stats, fresh=True)
        if out is None:  # no visible pair at all
            out, lse = accumulators(q)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.backend, ctx.stats = plan, scale, backend, stats
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        hk, h = k.shape[2], q.shape[2]
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        dq, dk, dv = block_backward(
            None,
            None,
            None,
            dout.transpose(1, 2).to(q.dtype),
            q,
            k,
            v,
            out,
            lse,
            ctx.plan,
            ctx.scale,
            ctx.backend,
            ctx.stats,
            fresh=True,
        )
        dq = grad_zeros(q, h) if dq is None else dq
        dk = grad_zeros(k, h) if dk is None else dk
        dv = grad_zeros(v, h) if dv is None else dv
        return (
            dq.to(q.dtype),
            kernels._reduce_kv(dk, hk).to(k.dtype),
            kernels._reduce_kv(dv, hk).to(v.dtype),
            None,
            None,
            None,
            None,
        )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    tile: Optional[int] = None,
    stats: Optional[EngineStats] = None,
):
    """Autograd-aware single-process attention through the engine: ``(out [b, sq, h, d], lse [b, h, sq])``.

    ``q [b, sq, h, d]``, ``k, v [b, sk, h_kv, d]`` (any ``sk``, e.g. cross-attention); ``mask`` is None,
    an ``AttentionMask`` on positions ``0..sq-1`` x ``0..sk-1``, or a bool ``[sq, sk]`` tensor (read one
    tile at a time). A ``[b, h, sq, sk]`` mask takes the dense kernels of ``attention.kernels``.
    Gradients flow through ``out``.
    """
    from ..masks import AttentionMask, from_dense

    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return kernels.dense_local_attention(q, k, v, mask, softmax_scale, backend)
    kernels._check(q, k, v, mask if isinstance(mask, torch.Tensor) else None)
    one_call = isinstance(mask, torch.Tensor)
    if one_call:
        mask = from_dense(mask, copy=False)  # lives for this call only: its plan is not kept
    elif mask is not None and not isinstance(mask, AttentionMask):
        raise ValueError(
            f"mask ({type(mask).__name__}) must be None, an AttentionMask or a bool tensor"
        )
    kernel = engine_backend(backend, q, mask)
    tile = (
        choose_tile(mask, kernel, q.device) if tile is None else check_tile(tile, kernel, q.device)
    )
    scale = kernels._scale(softmax_scale, q.shape[-1])
    sq, sk = q.shape[1], k.shape[1]
    plan = cached_plan(
        ("local", sq, sk),
        torch.arange(sq),
        torch.arange(sk),
        mask,
        tile,
        kernel,
        q.device,
        stats,
        cache=not one_call,
    )
    if stats is not None:
        stats._plan("fwd", plan)
    return _EngineAttention.apply(q, k, v, plan, scale, kernel, stats)
