"""Ulysses-only vs ring-only vs 2D attention at N = 8 (2 simulated nodes x 4 ranks), on CPU / gloo.

For each layout: forward bytes per rank from the CommTracer, intra- and inter-node, next to the
docs/architecture.md formulas (a2a ``G*(2H+2H_kv)*(U-1)/U``, ring ``(R-1)*2*H_kv*G``, ``G = b*(S/N)*D*e``);
for each mask the ring sub-blocks skipped; and the CPU wall-clock of forward+backward relative to
Ulysses-only. Run: ``python benchmarks/attention_comm.py [--seq 2048 --heads 8 ...]``.

CPU timings on 2 shared cores measure the implementation's overheads, not network cost (gloo over
loopback): read the byte columns for the topology argument.
"""
from __future__ import annotations

import argparse
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
            comm = dict(a2a_intra=t.bytes("all_to_all", intra_node=True),
                        a2a_inter=t.bytes("all_to_all", intra_node=False),
                        ring_intra=t.bytes("send", intra_node=True),
                        ring_inter=t.bytes("send", intra_node=False))
            skipped, times = {}, {}
            for m in MASKS:
                mask = _mask(m, seq)
                st = RingStats()
                dist_attention(q, k, v, groups, mask=mask, scheme=mask.default_scheme, stats=st)
                skipped[m] = (st.blocks_skipped, st.blocks)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist_attention(q, k, v, groups, mask=mask,
                                   scheme=mask.default_scheme).sum().backward()
                dist.barrier()
                times[m] = (time.perf_counter() - t0) / iters
            rows.append(dict(name=name, U=U, R=R, comm=comm, skipped=skipped, times=times))
        finally:
            destroy_video_parallel()
            destroy_model_parallel()
    return rows


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=2)
    a = ap.parse_args()
    with WorkerPool(8, ranks_per_node=4, timeout=1200) as pool:
        per_rank = pool.run(_rank_bench, a.seq, a.heads, a.kv_heads, a.dim, a.iters)

    N, e = 8, 4
    G = 1 * (a.seq // N) * a.dim * e
    print(f"S={a.seq} H={a.heads} H_kv={a.kv_heads} D={a.dim} fp32, N=8 as 2 nodes x 4; "
          f"G = b*(S/N)*D*e = {G:,} B; bytes are forward, per rank (max over ranks)")
    print(f"{'layout':<13}{'a2a intra':>12}{'a2a inter':>12}{'a2a formula':>13}"
          f"{'ring intra':>12}{'ring inter':>12}{'ring formula':>14}")
    for i, row in enumerate(per_rank[0]):
        U, R = row["U"], row["R"]
        hk = a.kv_heads if a.kv_heads % U == 0 else U
        f_a2a = G * (2 * a.heads + 2 * hk) * (U - 1) // U
        f_ring = (R - 1) * 2 * hk * G
        mx = {k: max(r[i]["comm"][k] for r in per_rank) for k in row["comm"]}
        print(f"{row['name']:<13}{mx['a2a_intra']:>12,}{mx['a2a_inter']:>12,}{f_a2a:>13,}"
              f"{mx['ring_intra']:>12,}{mx['ring_inter']:>12,}{f_ring:>14,}")
    print("\nring sub-blocks skipped / total (rank 0 | max over ranks), forward")
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


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
