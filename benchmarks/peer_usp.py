"""Forward time side by side with yunchang 0.6.4 ``LongContextAttention`` (USP), same ranks and kernels.

4 gloo ranks (2 simulated nodes x 2), U2xR2 / U4 / R4, full and causal masks, ``b=1`` fp32. yunchang
runs its pure-PyTorch path (``AttnType.TORCH_FLASH``) with its kernel pointed at torch's fused CPU
flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, the kernel our engine calls), its
``basic`` ring for full attention and its ``zigzag`` ring for causal, on the SAME process groups as
ours (its Ulysses group = our Ulysses group, its ring group = our ring group). Each library takes
its own balanced input layout (yunchang: ``zigzag_extract_local``; ours: Megatron's 2*CP-chunk cut),
cut from the same full tensors; both outputs are compared with a float64 oracle of the full
sequence. yunchang's PyTorch path has no backward, so this is forward only.

Target (docs/benchmarks.md): ours <= 1.0x yunchang everywhere. Needs the benchmark extra:
``pip install -r requirements/bench.txt -c requirements/constraints.txt``.
The two libraries alternate call by call (ours, yunchang, yunchang, ours, ...), so a drift of the
machine's speed hits both alike; the spread column shows how far one library's own repeats vary.
Rows for every ``--seqs`` size (default 2048, 4096 and 16384: small sizes show fixed per-call cost).
Ours runs twice: called alone ("per call": every call first checks that the CP ranks pass the same
shapes, one small all-gather) and as the DiT layers call it ("in a micro-batch": inside one
``parallel.comm.shape_check_scope``, where the first call checks and the layers after it share that
check); yunchang checks nothing.
Run: ``python benchmarks/peer_usp.py [--seqs 2048,4096,16384 --heads 8 --dim 64 --iters 6]``.
"""

from __future__ import annotations

import argparse
import contextvars
import statistics
import time

import torch

LAYOUTS = [("U2xR2", 2, 2), ("U4", 4, 1), ("R4", 1, 4)]
MASKS = ("full", "causal")


def _patch_yunchang_kernel():
    """Point yunchang's torch-flash kernel at torch's CPU flash op (what it would use on CPU)."""
    import yunchang.kernels.attention as yk

    def cpu_flash(q, k, v, dropout_p=0.0, is_causal=False, scale=None, **_):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale
        )

    yk._scaled_dot_product_flash_attention = cpu_flash


def _oracle(q, k, v, causal, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())


def _time_pair(s_local, heads, dim, iters, g, groups, mask, usp, causal):
    """Interleaved (ours, yunchang, ours, ...) wall and CPU times: drift hits both alike."""
    import torch.distributed as dist

    from megatron_video.attention import dist_attention
    from megatron_video.parallel import shape_check_scope

    q, k, v = (torch.randn(1, s_local, heads, dim, generator=g) for _ in range(3))
    ours = lambda: dist_attention(q, k, v, groups, mask=mask, scheme="zigzag")  # noqa: E731
    scoped, scope = contextvars.copy_context(), shape_check_scope()
    scoped.run(scope.__enter__)  # one micro-batch's scope, held by the "scoped" calls only
    fns = {
        "ours": ours,
        "scoped": lambda: scoped.run(ours),
        "yunchang": lambda: usp(q, k, v, causal=causal),
    }
    wall = {who: [] for who in fns}
    cpu = {who: [] for who in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()  # warm-up (the scope's one check)
        for it in range(iters):
            order = list(fns)[it % 3 :] + list(fns)[: it % 3]
            for who in order if it % 2 == 0 else order[::-1]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fns[who]()
                cpu[who].append(time.process_time() - c0)
                dist.barrier()
                wall[who].append(time.perf_counter() - t0)
    scoped.run(scope.__exit__, None, None, None)
    return wall, cpu


def _rank_bench(seqs, heads, dim, iters, check_seq):
    import yunchang
    from yunchang import LongContextAttention
    from yunchang.comm.extract_local import zigzag_extract_local
    from yunchang.kernels import AttnType

    from megatron_video.attention import dist_attention, masks
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.layouts import shard_sequence
    from megatron_video.parallel import destroy_video_parallel, init_video_parallel

    _patch_yunchang_kernel()
    rows = []
    for name, U, R in LAYOUTS:
        kw = dict(tensor_model_parallel_size=1, context_parallel_size=U * R)
        if U > 1 and R > 1:
            kw["hierarchical_context_parallel_sizes"] = [U, R]
        initialize_model_parallel(**kw)
        groups = init_video_parallel(U, R, ranks_per_node=2 if U <= 2 else 4)
        yunchang.globals.PROCESS_GROUP.ULYSSES_PG = groups.ulysses_group
        yunchang.globals.PROCESS_GROUP.RING_PG = groups.ring_group
        N = U * R
        try:
            for mask_name in MASKS:
                causal = mask_name == "causal"
                mask = masks.causal() if causal else masks.full()
                usp = LongContextAttention(
                    ring_impl_type="zigzag" if causal else "basic", attn_type=AttnType.TORCH_FLASH
                )
                ours_local = lambda x: shard_sequence(x, groups, dim=1, scheme="zigzag")  # noqa: E731
                their_local = lambda x: zigzag_extract_local(x, groups.cp_rank, N, R, U)  # noqa: E731
                if not causal:
                    their_local = lambda x: x.chunk(N, dim=1)[groups.cp_rank].contiguous()  # noqa: E731
                # accuracy at a small size (float64 oracle of the whole sequence)
                g = torch.Generator().manual_seed(1)
                full = [torch.randn(1, check_seq, heads, dim, generator=g) for _ in range(3)]
                ref = _oracle(*full, causal, dim**-0.5)
                with torch.no_grad():
                    o1 = dist_attention(
                        *(ours_local(x) for x in full), groups, mask=mask, scheme="zigzag"
                    )
                    o2 = usp(*(their_local(x) for x in full), causal=causal)
                err_ours = float((o1.double() - ours_local(ref)).abs().max())
                err_theirs = float((o2.double() - their_local(ref)).abs().max())
                for seq in seqs:  # time at the benchmark sizes
                    wall, cpu = _time_pair(
                        seq // N, heads, dim, iters, g, groups, mask, usp, causal
                    )
                    rows.append(
                        dict(
                            seq=seq,
                            layout=name,
                            mask=mask_name,
                            wall=wall,
                            cpu=cpu,
                            err_ours=err_ours,
                            err_theirs=err_theirs,
                        )
                    )
        finally:
            yunchang.globals.PROCESS_GROUP.ULYSSES_PG = None
            yunchang.globals.PROCESS_GROUP.RING_PG = None
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
    ap.add_argument("--seqs", default="2048,4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--check-seq", type=int, default=512)
    a = ap.parse_args()
    try:
        import yunchang  # noqa: F401
    except ImportError:
        raise SystemExit(
            "peer_usp: yunchang is not installed; pip install -r requirements/bench.txt "
            "-c requirements/constraints.txt"
        ) from None
    seqs = [int(x) for x in a.seqs.split(",")]
    with WorkerPool(4, ranks_per_node=2, timeout=3600) as pool:
        per_rank = pool.run(_rank_bench, seqs, a.heads, a.dim, a.iters, a.check_seq)
    _report(per_rank, a)


def _report(per_rank, a):
    whos = ("ours", "scoped", "yunchang")
    print(
        f"forward, S={a.seqs} b=1 H={a.heads} D={a.dim} fp32, 4 gloo ranks (2 nodes x 2), "
        f"{a.iters} interleaved iterations each: best CPU time summed over ranks (robust to other "
        f"load) of ours per call, ours in a micro-batch (one shape check per micro-batch) and "
        f"yunchang; ratios to yunchang; spread = median/best - 1, largest of the three; best wall "
        f"time ratio (max over ranks, in a micro-batch); max-abs error vs float64 at S={a.check_seq}"
    )
    print(
        f"{'S':>6} {'layout':<8}{'mask':<8}{'per call':>9}{'micro-b.':>9}{'yunchang':>9}"
        f"{'ratio':>8}{'ratio':>8}{'spread':>8}{'wall':>7}{'err ours':>10}{'err yunchang':>13}"
    )
    worst, worst_call, worst_spread = 0.0, 0.0, 0.0
    for i, row in enumerate(per_rank[0]):
        summed = {
            w: [sum(r[i]["cpu"][w][t] for r in per_rank) for t in range(a.iters)] for w in whos
        }
        walls = {
            w: min(max(r[i]["wall"][w][t] for r in per_rank) for t in range(a.iters)) for w in whos
        }
        best = {w: min(summed[w]) for w in whos}
        spread = max(statistics.median(summed[w]) / best[w] - 1 for w in whos)
        call, scoped = best["ours"] / best["yunchang"], best["scoped"] / best["yunchang"]
        eo = max(r[i]["err_ours"] for r in per_rank)
        et = max(r[i]["err_theirs"] for r in per_rank)
        worst, worst_call = max(worst, scoped), max(worst_call, call)
        worst_spread = max(worst_spread, spread)
        print(
            f"{row['seq']:>6} {row['layout']:<8}{row['mask']:<8}{best['ours']:>8.2f}s"
            f"{best['scoped']:>8.2f}s{best['yunchang']:>8.2f}s{call:>7.3f}x{scoped:>7.3f}x"
            f"{100 * spread:>7.1f}%{walls['scoped'] / walls['yunchang']:>6.2f}x{eo:>10.1e}{et:>13.1e}"
        )
    print(
        f"worst ours/yunchang CPU time: in a micro-batch {worst:.3f}x (target <= 1.0x), per call "
        f"{worst_call:.3f}x; largest spread of one library's repeats {100 * worst_spread:.1f}% "
        f"(differences below it are noise)"
    )


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    torch.set_num_threads(1)
    main()
