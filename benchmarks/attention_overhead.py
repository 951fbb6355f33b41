"""Host overhead per 2D-attention call (U2 x R2, 4 gloo ranks) beside the H200 kernel time it hides.

Per call, forward and backward separately, first call (empty plan cache) and steady state (median
of ``--reps``): host time = wall time minus the self time of aten compute ops (torch.profiler) minus
the time spent in communication (gloo sends, receives and all-to-alls, timed around
``parallel.comm``). Four ranks share the machine's cores, so wall times include other ranks' work;
the "host cpu" column is the robust one: this thread's CPU time (``time.thread_time``) minus the
thread CPU time inside aten compute ops (timed per op by a ``TorchDispatchMode``, its own
per-op cost calibrated and removed) minus the thread CPU time inside ``parallel.comm``;
beside it the estimated H200 time of this rank's share of the kernels (its visible (q, k) pairs x
``4 H D`` FLOPs forward, 2.5x that backward, at 60 % of 790 TFLOP/s, for ``--gpu-heads``
x ``--gpu-dim`` bf16); plan builds; engine kernel calls and aten compute ops (~ GPU launches) per
call. CPU runs at ``--heads`` x ``--dim`` fp32. The machine may be shared: wall times are noisy.
Run: ``python benchmarks/attention_overhead.py [--seqs 2048,8192,32768]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _attention_setup import N, R, U, attention_mask, u2r2_groups

MASKS = ("causal", "teacher_forcing")
H200_FLOPS = 0.6 * 790e12
# aten ops that move no data and compute nothing (metadata only); every other aten op with self
# time is counted as compute (a kernel on a GPU)
_META = {
    "aten::view",
    "aten::transpose",
    "aten::slice",
    "aten::as_strided",
    "aten::empty",
    "aten::select",
    "aten::unflatten",
    "aten::movedim",
    "aten::expand",
    "aten::resize_",
    "aten::detach",
    "aten::alias",
    "aten::t",
    "aten::permute",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::lift_fresh",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::reshape",
    "aten::flatten",
    "aten::_reshape_alias",
    "aten::to",
    "aten::_to_copy",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::detach_",
    "aten::set_",
    "aten::split",
    "aten::chunk",
    "aten::narrow",
    "aten::_unsafe_view",
    "aten::contiguous",
}


class _CommTimer:
    """Seconds spent inside the ``parallel.comm`` primitives the attention uses (patched)."""

    def __init__(self):
        from megatron_video.attention import attention_2d
        from megatron_video.parallel import comm
        from megatron_video.parallel.comm import a2a

        self.seconds, self.cpu = 0.0, 0.0
        self._saved = []
        for owner, name in (
            (a2a, "all_to_all_single"),
            (attention_2d, "check_same_shape"),
            (comm.RingExchange, "__init__"),
            (comm.RingExchange, "wait"),
        ):
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            setattr(owner, name, self._timed(orig))

    def _timed(self, fn):
        def f(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0

        return f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for owner, name, orig in self._saved:
            setattr(owner, name, orig)


def _op_timer():
    """A ``TorchDispatchMode`` summing this thread's CPU time inside aten compute ops (every op
    not in ``_META``) and counting all ops; ``overhead``: its own cost per op (calibrated)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpTimer(TorchDispatchMode):
        overhead = 0.0

        def __init__(self):
            super().__init__()
            self.compute, self.ops = 0.0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            c0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            if f"aten::{func.__name__.split('.')[0]}" not in _META:
                self.compute += time.thread_time() - c0
            self.ops += 1
            return out

    x = torch.zeros(4)
    for _ in range(2):  # calibrate: a metadata op with and without the mode
        c0 = time.thread_time()
        for _ in range(2000):
            torch.ops.aten.alias(x)
        bare = time.thread_time() - c0
        with OpTimer():
            c0 = time.thread_time()
            for _ in range(2000):
                torch.ops.aten.alias(x)
            timed = time.thread_time() - c0
        OpTimer.overhead = max(0.0, (timed - bare) / 2000)
    return OpTimer


def _host_cpu(fn, timer, op_timer) -> float:
    """This thread's CPU seconds in ``fn`` outside aten compute ops and communication."""
    import torch.distributed as dist

    dist.barrier()
    k0 = timer.cpu
    with op_timer() as ot:
        c0 = time.thread_time()
        fn()
        cpu = time.thread_time() - c0
    return max(0.0, cpu - ot.compute - (timer.cpu - k0) - ot.ops * ot.overhead)


def _visible_pairs(blocks) -> int:
    """(q, k) pairs the kernels of these block plans compute (FULL, causal and masked calls)."""
    from megatron_video.attention.engine import CAUSAL
    from megatron_video.ops.rules import FULL

    n = 0
    for bp in blocks:
        for i, c in enumerate(bp.calls if bp is not None else ()):
            nq, nk = c.q.stop - c.q.start, c.k.stop - c.k.start
            if c.kind == FULL:
                n += nq * nk * c.batch  # a batched call: c.batch equal blocks
            elif c.kind == CAUSAL:
                n += nq * (nq + 1) // 2
            else:
                m = bp.masks.get(i)
                n += int(m.sum()) if m is not None else nq * nk
    return n


def _compute_self_seconds(prof) -> tuple:
    evs = [e for e in prof.events() if e.name.startswith("aten::") and e.name not in _META]
    busy = [e for e in evs if e.self_cpu_time_total > 0]
    return sum(e.self_cpu_time_total for e in busy) * 1e-6, len(busy)


def _one(fn, timer, mode: str, op_timer):
    """``(wall, compute self seconds, compute ops, comm seconds, host cpu)`` of ``fn()``; each
    pass (``mode``: ``wall``, ``profile`` or ``cpu``) fills its own fields."""
    import torch.distributed as dist

    if mode == "cpu":
        return None, None, None, None, _host_cpu(fn, timer, op_timer)
    dist.barrier()
    c0 = timer.seconds
    if mode == "wall":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, None, None, timer.seconds - c0, None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    comp, ops = _compute_self_seconds(prof)
    return None, comp, ops, timer.seconds - c0, None


def _phase(run_fwd, run_bwd, timer, reps, first, op_timer):
    """Median per direction of wall / compute / ops / comm / host cpu, each call on fresh
    inputs."""
    from megatron_video.attention.plans import PLANS

    res = {"fwd": [], "bwd": []}
    for mode in ("wall", "profile", "cpu"):
        for _ in range(1 if first else reps):
            if first:
                PLANS.clear()
            holder = {}
            f = _one(lambda: holder.update(out=run_fwd()), timer, mode, op_timer)
            b = _one(lambda: run_bwd(holder["out"]), timer, mode, op_timer)
            res["fwd"].append(f)
            res["bwd"].append(b)
    out = {}
    for d, rows in res.items():

        def med(i, rows=rows):
            return statistics.median(r[i] for r in rows if r[i] is not None)

        wall, comp, ops, comm, host_cpu = med(0), med(1), med(2), med(3), med(4)
        out[d] = dict(
            wall=wall,
            compute=comp,
            ops=ops,
            comm=comm,
            host_cpu=host_cpu,
            host=max(0.0, wall - comp - comm),
        )
    return out


def _rank_bench(seqs, heads, dim, gpu_heads, gpu_dim, reps, masks_):
    import torch.distributed as dist

    from megatron_video.attention import RingStats, dist_attention
    from megatron_video.attention.plans import PLANS
    from megatron_video.attention.ring import ring_block_plans

    torch.set_num_threads(1)
    rows, op_timer = [], _op_timer()
    with u2r2_groups() as groups, _CommTimer() as timer:
        for S in seqs:
            for name in masks_:
                mask, scheme = attention_mask(name, S)
                g = torch.Generator().manual_seed(dist.get_rank())
                st = RingStats()

                def run_fwd():
                    q, k, v = (
                        torch.randn(1, S // N, heads, dim, generator=g).requires_grad_()
                        for _ in range(3)
                    )
                    return dist_attention(q, k, v, groups, mask=mask, scheme=scheme, stats=st)

                def run_bwd(out):
                    out.backward(torch.ones_like(out))

                first = _phase(run_fwd, run_bwd, timer, reps, True, op_timer)
                builds_first = PLANS.builds  # the last first call started from an empty cache
                calls0 = (st.kernel_calls, st.bwd_kernel_calls, st.steps)
                b1 = PLANS.builds
                steady = _phase(run_fwd, run_bwd, timer, reps, False, op_timer)
                n_calls = (st.steps - calls0[2]) // R  # dist_attention calls in the steady phase
                kcalls = (
                    (st.kernel_calls - calls0[0]) / n_calls,
                    (st.bwd_kernel_calls - calls0[1]) / n_calls,
                )
                builds_steady = PLANS.builds - b1
                from megatron_video.attention import engine

                kernel = engine.engine_backend("auto", torch.empty(1))
                tile = engine.choose_tile(mask, kernel, torch.device("cpu"))
                _, blocks = ring_block_plans(
                    None, _ring_ids(groups, S, scheme), groups.ring_rank, mask, tile, kernel
                )
                pairs = _visible_pairs(blocks) // U  # this rank's heads: H / U of them
                fwd_flops = 4 * pairs * gpu_dim * gpu_heads
                rows.append(
                    dict(
                        S=S,
                        mask=name,
                        first=first,
                        steady=steady,
                        builds_first=builds_first,
                        builds_steady=builds_steady,
                        kcalls=kcalls,
                        gpu_fwd=fwd_flops / H200_FLOPS,
                        gpu_bwd=2.5 * fwd_flops / H200_FLOPS,
                    )
                )
    return rows


def _ring_ids(groups, S, scheme):
    from megatron_video.attention.attention_2d import _layout

    return _layout(
        tuple(groups.cp_ranks),
        tuple(groups.ulysses_ranks),
        tuple(groups.ring_ranks),
        groups.ulysses_size,
        groups.ring_size,
        groups.placement,
        S,
        scheme,
    )[0]


def _ms(x):
    return f"{x * 1e3:8.2f}"


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--gpu-heads", type=int, default=12)
    ap.add_argument("--gpu-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--masks", default=",".join(MASKS))
    a = ap.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    masks_ = tuple(a.masks.split(","))
    with WorkerPool(4, ranks_per_node=2, timeout=7200) as pool:
        pool.run(_rank_bench, seqs[:1], a.heads, a.dim, a.gpu_heads, a.gpu_dim, 1, masks_[:1])
        per_rank = pool.run(
            _rank_bench, seqs, a.heads, a.dim, a.gpu_heads, a.gpu_dim, a.reps, masks_
        )
    print(
        f"2D attention U2 x R2 (4 gloo ranks, CPU b=1 H={a.heads} D={a.dim} fp32); host = wall - "
        f"aten compute self time - comm; H200 est. = this rank's share at H={a.gpu_heads} "
        f"D={a.gpu_dim} bf16, 60% of 790 TFLOP/s; max over ranks; times in ms (shared machine: "
        f"noisy)"
    )
    print(
        "host 1st / ss: wall-based (wall - compute - comm; first call / steady state); host cpu: "
        "this thread's CPU time - its CPU time in aten compute ops and in comm, steady state "
        "(robust to sharing the cores); host/H200 uses host cpu"
    )
    print(
        f"{'S':>7} {'mask':>16} {'dir':>4} {'host 1st':>9} {'host ss':>9} {'host cpu':>9} "
        f"{'wall ss':>9} {'comm ss':>9} {'H200 est':>9} {'host/H200':>10} {'aten ops':>8} "
        f"{'eng calls':>9} {'builds 1st/ss':>13}"
    )
    for S in seqs:
        for m in masks_:
            rs = [next(r for r in rank if r["S"] == S and r["mask"] == m) for rank in per_rank]
            for d in ("fwd", "bwd"):
                h1 = max(r["first"][d]["host"] for r in rs)
                hs = max(r["steady"][d]["host"] for r in rs)
                hc = max(r["steady"][d]["host_cpu"] for r in rs)
                ws = max(r["steady"][d]["wall"] for r in rs)
                cs = max(r["steady"][d]["comm"] for r in rs)
                gpu = max(r["gpu_" + d] for r in rs)
                ops = max(r["steady"][d]["ops"] for r in rs)
                kc = max(r["kcalls"][0 if d == "fwd" else 1] for r in rs)
                b = f"{max(r['builds_first'] for r in rs)}/{max(r['builds_steady'] for r in rs)}"
                print(
                    f"{S:>7} {m:>16} {d:>4} {_ms(h1):>9} {_ms(hs):>9} {_ms(hc):>9} {_ms(ws):>9} "
                    f"{_ms(cs):>9} {_ms(gpu):>9} {hc / gpu:>9.0%} {ops:>8.0f} {kc:>9.1f} {b:>13}"
                )


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
