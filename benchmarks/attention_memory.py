"""Per-rank peak memory of 2D attention (fwd+bwd) vs sequence length, beside single-process torch flash.

4 gloo ranks as 2 simulated nodes x 2 (U2 x R2), causal / block-causal / teacher-forcing masks,
``b=1, H=4, D=32`` fp32 by default (``--dtype bfloat16``: inputs and shard in bf16). Memory is the
growth of the resident set's high-water mark during one forward + backward (``/proc/self/status``
VmHWM after resetting it through ``/proc/self/clear_refs``), per rank, max over ranks; printed in
MiB and as a multiple of one q shard (``b * S/N * H * D`` elements of the dtype). The baseline is
torch's fused CPU flash attention on ONE process over the whole sequence (``is_causal=True``, its
own q = the whole sequence), measured the same way.

Targets (docs/benchmarks.md): <= 15x one q shard at S >= 32k, and flat: the largest S within 1.5x
of the smallest. ``--breakdown`` repeats each step under ``testing.live_memory.LiveTensors`` and
prints the exact peak of live tensor storages (same multiple, no allocator noise) and, for the worst
case, what held it. Run: ``python benchmarks/attention_memory.py [--seqs 4096,8192,16384,32768,65536]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _attention_setup import N, attention_mask, u2r2_groups

MASKS = ("causal", "block_causal", "teacher_forcing")


def _hwm_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0  # MiB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _measure(fn):
    import gc

    gc.collect()
    _hwm_reset()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return _status("VmHWM") - base, dt


def _live_peak(step, inputs):
    """``(peak bytes of live tensor storages during step(), [(bytes, allocation site)])``."""
    from megatron_video.testing.live_memory import LiveTensors

    with LiveTensors(exclude=inputs) as live:
        step()
    for x in inputs:
        x.grad = None
    return live.peak, live.held[:12]


def _rank_bench(seqs, heads, dim, tile, masks_, breakdown=False, dtype="float32"):
    import torch.distributed as dist

    from megatron_video.attention import RingStats, dist_attention

    rows = []
    with u2r2_groups() as groups:
        for S in seqs:
            for name in masks_:
                mask, scheme = attention_mask(name, S)
                g = torch.Generator().manual_seed(dist.get_rank())
                q, k, v = (
                    torch.randn(1, S // N, heads, dim, generator=g)
                    .to(getattr(torch, dtype))
                    .requires_grad_()
                    for _ in range(3)
                )
                st = RingStats()

                def step():
                    out = dist_attention(
                        q, k, v, groups, mask=mask, scheme=scheme, tile=tile, stats=st
                    )
                    out.backward(torch.ones_like(out))

                dist.barrier()
                mib, dt = _measure(step)
                for x in (q, k, v):
                    x.grad = None
                live = _live_peak(step, (q, k, v)) if breakdown else (0, [])
                rows.append(
                    dict(
                        S=S,
                        mask=name,
                        mib=mib,
                        live=live[0] / q.nbytes,
                        held=[(n / q.nbytes, where) for n, where in live[1]],
                        sec=dt,
                        q_mib=q.nbytes / 2**20,
                        max_mask=st.max_mask_elements,
                        skipped=(st.tiles_skipped, st.tiles),
                    )
                )
    return rows


def _flash_baseline(seqs, heads, dim, dtype="float32"):
    rows = []
    for S in seqs:
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(1, heads, S, dim, generator=g).to(getattr(torch, dtype)).requires_grad_()
            for _ in range(3)
        )

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        mib, dt = _measure(step)
        rows.append(dict(S=S, mib=mib, sec=dt, q_mib=q.nbytes / 2**20))
    return rows


def _cells(S, masks_, per_rank, breakdown):
    """The table cells of one S, and the multiple of each mask (max over ranks)."""
    cells, xs = [], []
    for m in masks_:
        rs = [next(r for r in rank if r["S"] == S and r["mask"] == m) for rank in per_rank]
        mib = max(r["mib"] for r in rs)
        xs.append(mib / rs[0]["q_mib"])
        live = f" ({max(r['live'] for r in rs):4.1f}x)" if breakdown else ""
        cells.append(f"{mib:8.1f} MiB {xs[-1]:5.1f}x{live} {max(r['sec'] for r in rs):5.1f}s")
    return cells, xs


def _report(a, seqs, masks_, per_rank, flash):
    w = 34 if a.breakdown else 26
    print(
        f"2D attention U2 x R2 (4 gloo ranks), b=1 H={a.heads} D={a.dim} {a.dtype}, tile "
        f"{a.tile or 'auto'}, fwd+bwd; peak RSS growth per rank (max over ranks) and its multiple "
        f"of one q shard" + ("; (live tensor storages, exact)" if a.breakdown else "")
    )
    print(f"{'S':>7}" + "".join(f"{m:>{w}}" for m in masks_) + f"{'torch flash, 1 process':>28}")
    ratios = {m: [] for m in masks_}
    for i, S in enumerate(seqs):
        cells, xs = _cells(S, masks_, per_rank, a.breakdown)
        for m, x in zip(masks_, xs):
            ratios[m].append(x)
        f = flash[i]
        cells.append(f"{f['mib']:8.1f} MiB {f['mib'] / f['q_mib']:5.1f}x {f['sec']:5.1f}s")
        print(f"{S:>7}" + "".join(f"{c:>{w}}" for c in cells[:-1]) + f"{cells[-1]:>28}")
    print(
        "flatness (largest S / smallest S, multiple of q shard): "
        + ", ".join(f"{m} {r[-1] / r[0]:.2f}" for m, r in ratios.items())
    )
    big = [x for r in ratios.values() for S, x in zip(seqs, r) if S >= 32768]
    print(
        f"worst multiple {max(max(r) for r in ratios.values()):.1f}x one q shard"
        + (f", {max(big):.1f}x at S >= 32k (target <= 15x)" if big else "")
        + f"; largest mask buffer {max(r['max_mask'] for rank in per_rank for r in rank):,} "
        f"elements (one 512-tile pair = {512**2:,})"
    )
    if a.breakdown:  # what held the worst exact peak
        r = max((r for rank in per_rank for r in rank), key=lambda r: r["live"])
        print(f"held at the worst live peak ({r['mask']}, S={r['S']}, {r['live']:.2f}x):")
        for x, where in r["held"]:
            print(f"  {x:5.2f}x  {where}")


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--seqs", default="4096,8192,16384,32768,65536")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument(
        "--tile", type=int, default=0, help="engine tile; 0 = automatic (engine.choose_tile)"
    )
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--breakdown", action="store_true", help="exact live-tensor peak, holders")
    a = ap.parse_args()
    a.tile = a.tile or None
    seqs = [int(s) for s in a.seqs.split(",")]
    masks_ = tuple(a.masks.split(","))
    # A fixed mmap threshold makes glibc map every large tensor on its own and unmap it on free, so
    # the resident set tracks live tensors (no reuse of freed heap memory hiding a later peak).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    # warm-up at the smallest size so one-time allocations (thread pools, kernels) are not counted
    with WorkerPool(4, ranks_per_node=2, timeout=3600) as pool:
        pool.run(_rank_bench, seqs[:1], a.heads, a.dim, a.tile, masks_, False, a.dtype)
        per_rank = pool.run(_rank_bench, seqs, a.heads, a.dim, a.tile, masks_, a.breakdown, a.dtype)
        flash = pool.run(_flash_baseline, seqs[:1] + seqs, a.heads, a.dim, a.dtype)[0][
            1:
        ]  # rank 0's, after warm-up
    _report(a, seqs, masks_, per_rank, flash)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    torch.set_num_threads(1)
    main()
