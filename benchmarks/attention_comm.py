"""Ulysses-only vs ring-only vs 2D attention at N = 8 (2 simulated nodes x 4 ranks), on CPU / gloo,
and the engine's efficiency against single-process fused attention.

1. For each layout: forward bytes per rank from the CommTracer, intra- and inter-node, next to the
   docs/architecture.md formulas (a2a ``G*(2H+2H_kv')*(U-1)/U``, ring ``(R-1)*2*H_kv'*G``, ``G =
   b*(S/N)*D*e``,
   ``H_kv' = lcm(H_kv, U)``); for each mask the engine tiles skipped; the CPU wall-clock of
   forward+backward relative to Ulysses-only; and causal vs full (target with Ulysses only: <= 0.6x).
2. Efficiency (``--eff-seq``, U2 x R2): CPU time of forward+backward summed over the ranks
   (``time.process_time``, so other load on the machine does not count) against torch's fused CPU
   flash kernel on ONE process over the same total problem (``is_causal=True`` / no mask).
   Target for causal at S = 32k: >= 0.8.
3. Time vs mask density (``--density-seq``, U2 x R2): block-causal masks of several frame counts and
   teacher-forcing masks, CPU time relative to the full mask against the fraction of visible pairs.
   Target: time <= density + 0.15.
Run: ``python benchmarks/attention_comm.py [--seq 2048 --eff-seq 32768 --density-seq 8192]``.

CPU timings on 2 shared cores measure the implementation's overheads, not network cost (gloo over
loopback): read the byte columns for the topology argument.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

LAYOUTS = [("ulysses-only", 8, 1), ("ring-only", 1, 8), ("2D 4x2", 4, 2), ("2D 2x4", 2, 4)]
MASKS = ["full", "causal", "block_causal", "packed_causal"]


def _mask(name, S):
    from megatron_video.attention import masks

    if name == "full":
        return masks.full()
    if name == "causal":
        return masks.causal()
    if name == "block_causal":
        return masks.block_causal(S // 16)  # e.g. 16 frames
    docs = [0, S // 8, S // 3, S // 2, S]  # uneven documents, causal inside
    return masks.packed(docs, inner=masks.causal())


def _rank_bench(seq, heads, kv_heads, dim, iters):
    import torch.distributed as dist

    from megatron_video.attention import RingStats, dist_attention
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel import CommTracer, destroy_video_parallel, init_video_parallel

    rows = []
    for name, U, R in LAYOUTS:
        kw = dict(tensor_model_parallel_size=1, context_parallel_size=8)
        if U > 1 and R > 1:
            kw["hierarchical_context_parallel_sizes"] = [U, R]
        initialize_model_parallel(**kw)
        # Ulysses-only at N = 8 must cross nodes: allow it, the tracer still sees the 4-rank nodes.
        groups = init_video_parallel(U, R, ranks_per_node=8 if U > 4 else 4)
        try:
            s_local = seq // 8
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, s_local, heads, dim, generator=g).requires_grad_()
            k = torch.randn(1, s_local, kv_heads, dim, generator=g).requires_grad_()
            v = torch.randn(1, s_local, kv_heads, dim, generator=g).requires_grad_()
            with CommTracer() as t:
                dist_attention(q, k, v, groups, mask=_mask("full", seq))
            comm = dict(
                a2a_intra=t.bytes("all_to_all", intra_node=True),
                a2a_inter=t.bytes("all_to_all", intra_node=False),
                ring_intra=t.bytes("send", intra_node=True),
                ring_inter=t.bytes("send", intra_node=False),
            )
            skipped, times, cpu = {}, {}, {}
            for m in MASKS:
                mask = _mask(m, seq)
                st = RingStats()
                dist_attention(q, k, v, groups, mask=mask, scheme=mask.default_scheme, stats=st)
                skipped[m] = (st.tiles_skipped, st.tiles)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    dist_attention(
                        q, k, v, groups, mask=mask, scheme=mask.default_scheme
                    ).sum().backward()
                cpu[m] = (time.process_time() - c0) / iters
                dist.barrier()
                times[m] = (time.perf_counter() - t0) / iters
            rows.append(dict(name=name, U=U, R=R, comm=comm, skipped=skipped, times=times, cpu=cpu))
        finally:
            destroy_video_parallel()
            destroy_model_parallel()
    return rows


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument(
        "--tile", type=int, default=0, help="engine tile; 0 = automatic (engine.choose_tile)"
    )
    ap.add_argument("--eff-seq", type=int, default=32768, help="0 skips the efficiency section")
    ap.add_argument("--eff-heads", type=int, default=4)
    ap.add_argument("--density-seq", type=int, default=8192, help="0 skips the density section")
    a = ap.parse_args()
    a.tile = a.tile or None
    with WorkerPool(8, ranks_per_node=4, timeout=1200) as pool:
        per_rank = pool.run(_rank_bench, a.seq, a.heads, a.kv_heads, a.dim, a.iters)

    N, e = 8, 4
    G = 1 * (a.seq // N) * a.dim * e
    print(
        f"S={a.seq} H={a.heads} H_kv={a.kv_heads} D={a.dim} fp32, N=8 as 2 nodes x 4; "
        f"G = b*(S/N)*D*e = {G:,} B; bytes are forward, per rank (max over ranks)"
    )
    print(
        f"{'layout':<13}{'a2a intra':>12}{'a2a inter':>12}{'a2a formula':>13}"
        f"{'ring intra':>12}{'ring inter':>12}{'ring formula':>14}"
    )
    for i, row in enumerate(per_rank[0]):
        U, R = row["U"], row["R"]
        hk = a.kv_heads * U // math.gcd(a.kv_heads, U)
        f_a2a = G * (2 * a.heads + 2 * hk) * (U - 1) // U
        f_ring = (R - 1) * 2 * hk * G
        mx = {k: max(r[i]["comm"][k] for r in per_rank) for k in row["comm"]}
        print(
            f"{row['name']:<13}{mx['a2a_intra']:>12,}{mx['a2a_inter']:>12,}{f_a2a:>13,}"
            f"{mx['ring_intra']:>12,}{mx['ring_inter']:>12,}{f_ring:>14,}"
        )
    print("\nengine tiles skipped / total (rank 0 | max over ranks), forward")
    print(f"{'layout':<13}" + "".join(f"{m:>22}" for m in MASKS))
    for i, row in enumerate(per_rank[0]):
        cells = []
        for m in MASKS:
            s0, n0 = row["skipped"][m]
            smax = max(r[i]["skipped"][m][0] for r in per_rank)
            cells.append(f"{s0}/{n0} | {smax}")
        print(f"{row['name']:<13}" + "".join(f"{c:>22}" for c in cells))
    print("\nCPU wall-clock fwd+bwd (max over ranks), ratio to ulysses-only with the same mask")
    base = {m: max(r[0]["times"][m] for r in per_rank) for m in MASKS}
    print(f"{'layout':<13}" + "".join(f"{m:>22}" for m in MASKS))
    for i, row in enumerate(per_rank[0]):
        cells = []
        for m in MASKS:
            t = max(r[i]["times"][m] for r in per_rank)
            cells.append(f"{t * 1e3:.0f} ms ({t / base[m]:.2f}x)")
        print(f"{row['name']:<13}" + "".join(f"{c:>22}" for c in cells))

    print(
        "\ncausal / full CPU time (summed over ranks), per layout (target with Ulysses only: <= 0.6x)"
    )
    for i, row in enumerate(per_rank[0]):
        c = sum(r[i]["cpu"]["causal"] for r in per_rank)
        f = sum(r[i]["cpu"]["full"] for r in per_rank)
        print(f"{row['name']:<13}{c / f:>8.2f}x")

    if a.eff_seq:
        with WorkerPool(4, ranks_per_node=2, timeout=3600) as pool:
            eff = pool.run(_efficiency, a.eff_seq, a.eff_heads, a.dim, a.tile)
        print(
            f"\nefficiency: fwd+bwd CPU time, U2 x R2 (4 ranks, summed) vs torch fused flash on one "
            f"process, S={a.eff_seq} H={a.eff_heads} D={a.dim} fp32, tile {a.tile or 'auto'}"
        )
        for m in ("causal", "full"):
            ours = sum(r["ours"][m] for r in eff)
            single = eff[0]["single"][m]
            print(
                f"{m:<8} ours {ours:8.2f} s   single-process flash {single:8.2f} s   efficiency "
                f"{single / ours:5.2f} (target >= 0.8 for causal)"
            )

    if a.density_seq:
        with WorkerPool(4, ranks_per_node=2, timeout=3600) as pool:
            dens = pool.run(_density, a.density_seq, a.eff_heads, a.dim, a.tile)
        print(
            f"\ntime vs mask density, U2 x R2, S={a.density_seq} H={a.eff_heads} D={a.dim} fp32, fwd+bwd CPU "
            f"time summed over ranks relative to the full mask (target: <= density + 0.15)"
        )
        full = sum(r["full"] for r in dens)
        for key in dens[0]["masks"]:
            t = sum(r["masks"][key][1] for r in dens)
            d = dens[0]["masks"][key][0]
            ok = "ok" if t / full <= d + 0.15 else "MISSED"
            print(f"{key:<28} density {d:5.3f}   time {t / full:5.3f}x of full   {ok}")


def _fwd_bwd_cpu(fn, q, k, v, iters=1, sync=True):
    import torch.distributed as dist

    fn(q, k, v).sum().backward()  # warm-up
    best = float("inf")
    for _ in range(iters):
        if sync:
            dist.barrier()
        c0 = time.process_time()
        fn(q, k, v).sum().backward()
        best = min(best, time.process_time() - c0)
    return best


def _setup_2x2():
    from megatron_video.compat import initialize_model_parallel
    from megatron_video.parallel import init_video_parallel

    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
    )
    return init_video_parallel(2, 2, ranks_per_node=2)


def _teardown():
    from megatron_video.compat import destroy_model_parallel
    from megatron_video.parallel import destroy_video_parallel

    destroy_video_parallel()
    destroy_model_parallel()


def _efficiency(seq, heads, dim, tile):
    import torch.distributed as dist

    from megatron_video.attention import dist_attention, masks

    groups = _setup_2x2()
    out = dict(ours={}, single={})
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (
            torch.randn(1, seq // 4, heads, dim, generator=g).requires_grad_() for _ in range(3)
        )
        for m, mask in (("causal", masks.causal()), ("full", masks.full())):
            out["ours"][m] = _fwd_bwd_cpu(
                lambda q, k, v: dist_attention(
                    q, k, v, groups, mask=mask, scheme="zigzag", tile=tile
                ),
                q,
                k,
                v,
            )
    finally:
        _teardown()
    if dist.get_rank() == 0:  # the single-process baseline, alone on the machine's cores
        g = torch.Generator().manual_seed(0)
        Q, K, V = (torch.randn(1, heads, seq, dim, generator=g).requires_grad_() for _ in range(3))
        for m, causal in (("causal", True), ("full", False)):
            out["single"][m] = _fwd_bwd_cpu(
                lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal
                ),
                Q,
                K,
                V,
                sync=False,
            )
    return out  # no barrier: the baseline may outlast gloo's timeout while the others wait


def _density(seq, heads, dim, tile):
    import torch.distributed as dist

    from megatron_video.attention import dist_attention, masks
    from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
    from megatron_video.layouts import BalancedSPLayout

    groups = _setup_2x2()
    res = {"masks": {}}
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (
            torch.randn(1, seq // 4, heads, dim, generator=g).requires_grad_() for _ in range(3)
        )
        run = lambda mask, scheme: _fwd_bwd_cpu(  # noqa: E731
            lambda q, k, v: dist_attention(q, k, v, groups, mask=mask, scheme=scheme, tile=tile),
            q,
            k,
            v,
        )
        res["full"] = run(masks.full(), "zigzag")
        for frames in (4, 16, 64):
            b = seq // frames
            density = sum((i + 1) * b * b for i in range(frames)) / seq**2
            res["masks"][f"block_causal {frames} frames"] = (
                density,
                run(masks.block_causal(b), "zigzag"),
            )
        for F, nb in ((16, 1), (16, 4)):
            lay = BalancedSPLayout(
                num_latent_frames=F,
                tokens_per_frame=seq // (2 * F),
                frames_per_block=nb,
                sp_size=4,
                ring_size=2,
            )
            density = float(lay.block_mask().double().mean())
            res["masks"][f"teacher_forcing F={F} nb={nb}"] = (
                density,
                run(TeacherForcingMask(lay), "contiguous"),
            )
    finally:
        _teardown()
    return res


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    torch.set_num_threads(1)
    main()
