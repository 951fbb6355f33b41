"""Mixed-length clips under context parallelism (U2 x R2, 4 gloo ranks as 2 nodes x 2), four ways:

(a) pad to the longest: each micro-batch's clips padded to its longest clip, zigzag over CP;
(b) fixed-shape buckets: clips cropped to the largest frame bucket they fill, one bucket per
    micro-batch (Open-Sora style), zigzag over CP;
(c) token-count first-fit-decreasing packing (NVIDIA's Wan recipes): clips packed into sequences
    of the token budget, padded to a multiple of 2·CP, split zigzag over the whole CP group;
(d) ours: the same packs as (c), placed by ``layouts.placement.plan_placement`` (whole clips inside
    one Ulysses group, long clips split over the ring) with routed ring sends.

Data like a real T2V set: durations 2-16 s at 16 fps (latent frames ``1 + (16·s - 1) // 4``), three
aspect buckets at one latent area, 20 % images; full attention inside each clip. Every method runs
one transformer-like layer per micro-batch (QKV and output projections, 2D attention, a 4x MLP;
forward + backward, fp32) and reports, per rank: attention work (pairs computed, padding
included) max/mean, padding fraction, tokens cropped, ring K/V bytes (``CommTracer``), CPU time
(``time.process_time``, which sharing 2 cores does not distort) max/mean and summed per sample,
and for (d) the cost model's predicted per-rank time (weights fitted by least squares on the runs
of (a)-(c)) against the measured one. Run: ``python benchmarks/mixed_lengths.py [--clips 32 --budget 8192]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _attention_setup import N, R, U, u2r2_groups

from megatron_video.layouts import max_over_mean

BUCKETS = [(6, 10), (10, 6), (8, 8)]  # latent (h, w) tokens per frame at one area (~60)
FRAME_BUCKETS = [1, 9, 17, 33, 49, 65]  # latent frames of the fixed-shape buckets (b)


def dataset(n: int, seed: int = 0):
    """``[(frames, h, w)]`` latent token grids of ``n`` clips (20 % one-frame images)."""
    g = torch.Generator().manual_seed(seed)
    clips = []
    for _ in range(n):
        h, w = BUCKETS[int(torch.randint(len(BUCKETS), (1,), generator=g))]
        if float(torch.rand(1, generator=g)) < 0.2:
            clips.append((1, h, w))
            continue
        seconds = 2 + 14 * float(torch.rand(1, generator=g))
        clips.append((1 + (int(16 * seconds) - 1) // 4, h, w))
    return clips


def _ffd(tokens, budget):
    """First-fit-decreasing by token count (NVIDIA's Wan recipes): largest clip first (ties by
    index) into the first pack with room, else a new pack. ``[[clip index, ...], ...]``."""
    if max(tokens) > budget:
        raise ValueError(f"budget ({budget}) must hold every clip (largest: {max(tokens)} tokens)")
    packs, used = [], []
    for i in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        slot = next((k for k, u in enumerate(used) if u + tokens[i] <= budget), None)
        if slot is None:
            packs.append([])
            used.append(0)
            slot = len(packs) - 1
        packs[slot].append(i)
        used[slot] += tokens[i]
    return packs


def micro_batches(clips, budget: int):
    """Per method: a list of micro-batches, each ``(docs, seq_len, scheme_or_plan, cropped)``;
    ``docs`` the token count of each document (a padded clip counts its padding)."""
    from megatron_video.layouts.placement import Clip, plan_placement

    tokens = [f * h * w for f, h, w in clips]
    packs = _ffd(tokens, budget)
    out = {"a": [], "b": [], "c": [], "d": []}
    for pack in packs:  # (a): the same groups, each clip padded to the group's longest
        longest = max(tokens[i] for i in pack)
        S = -(-longest * len(pack) // (2 * N)) * 2 * N
        out["a"].append(([longest] * len(pack), S, "zigzag", 0))
        docs = [tokens[i] for i in pack]
        S = -(-sum(docs) // (2 * N)) * 2 * N
        out["c"].append((docs, S, "zigzag", 0))
        plan = plan_placement([Clip(t) for t in docs], U, R, seq_len=-(-sum(docs) // N) * N)
        out["d"].append((docs, plan.seq_len, plan, 0))
    by_bucket = {}
    for f, h, w in clips:  # (b): crop to the largest frame bucket <= frames, group by shape
        fb = max(b for b in FRAME_BUCKETS if b <= f)
        by_bucket.setdefault((fb, h, w), []).append(f * h * w - fb * h * w)
    for (fb, h, w), crops in sorted(by_bucket.items()):
        per = max(1, budget // (fb * h * w))  # hand-tuned batch size: fill the budget
        for a in range(0, len(crops), per):
            docs = [fb * h * w] * len(crops[a : a + per])
            S = -(-sum(docs) // (2 * N)) * 2 * N
            out["b"].append((docs, S, "zigzag", sum(crops[a : a + per])))
    return out


def _layer(C: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda i, o: (torch.randn(i, o, generator=g) / i**0.5).requires_grad_()  # noqa: E731
    return dict(qkv=mk(C, 3 * C), proj=mk(C, C), up=mk(C, 4 * C), down=mk(4 * C, C))


def _step(x, w, heads, attend):
    """One layer forward + backward on this rank's tokens ``x [1, s, C]``."""
    s, C = x.shape[1], x.shape[2]
    q, k, v = (x @ w["qkv"]).view(1, s, 3, heads, C // heads).unbind(2)
    y = x + attend(q, k, v).reshape(1, s, C) @ w["proj"]
    y = y + torch.nn.functional.gelu(y @ w["up"]) @ w["down"]
    y.square().mean().backward()


def _rank_bench(batches, heads, C, iters):
    import torch.distributed as dist

    from megatron_video.attention import dist_attention, masks
    from megatron_video.parallel import CommTracer

    torch.set_num_threads(1)
    w = _layer(C)
    rows = {}
    with u2r2_groups() as groups:
        for method, mbs in batches.items():
            rows[method] = []
            for docs, S, layout, _ in mbs:
                cu = [0]
                for d in docs:
                    cu.append(cu[-1] + d)
                mask = masks.packed(cu)
                scheme = layout.placement if not isinstance(layout, str) else layout
                x = torch.randn(1, S // N, C, generator=torch.Generator().manual_seed(1))

                def attend(q, k, v):
                    return dist_attention(q, k, v, groups, mask=mask, scheme=scheme)

                _step(x, w, heads, attend)  # plans built, caches warm
                dist.barrier()
                with CommTracer() as t:
                    c0 = time.process_time()
                    for _ in range(iters):
                        _step(x, w, heads, attend)
                    cpu = (time.process_time() - c0) / iters
                dist.barrier()
                rows[method].append(dict(cpu=cpu, ring=t.bytes("send") // iters))
    return rows


def _fit(mbs, cpu, pairs):
    """Least-squares ``(seconds per attention pair, per token, per call)`` of one CP rank from the
    runs of another method (its per-rank pairs, tokens and measured CPU times)."""
    rows, times = [], []
    for (_, S, _, _), measured, p in zip(mbs, cpu, pairs):
        for r in range(N):
            rows.append([p[r // U] / U, S / N, 1.0])
            times.append(measured[r])
    A = torch.tensor(rows, dtype=torch.float64)
    sol = torch.linalg.lstsq(A, torch.tensor(times, dtype=torch.float64)[:, None]).solution
    return tuple(float(x) for x in sol.flatten())


def _ring_pairs(docs, S, layout):
    """Attention pairs computed per ring rank (full attention inside each document, padding
    tokens of a padded clip included, trailing sequence padding attends nothing)."""
    from megatron_video.layouts import shard_global_ids
    from megatron_video.layouts.placement import ring_members

    per_token = torch.zeros(S, dtype=torch.long)
    at = 0
    for d in docs:
        per_token[at : at + d] = d
        at += d
    scheme = layout if isinstance(layout, str) else layout.placement
    out = []
    for members in ring_members(U, R):
        ids = torch.cat([shard_global_ids(c, N, S, scheme) for c in members])
        out.append(int(per_token[ids].sum()))
    return out


def _summary(method, mbs, per_rank, clips, weights):
    """One row of the table: aggregates over the micro-batches of ``method``."""
    pairs = [_ring_pairs(docs, S, lay) for docs, S, lay, _ in mbs]
    work = max(max_over_mean(p) for p in pairs)
    total = sum(S for _, S, _, _ in mbs)
    useful = sum(sum(docs) for docs, _, _, _ in mbs)
    real = sum(f * h * w for f, h, w in clips)
    cropped = sum(c for *_, c in mbs)
    pad = 1 - (useful if method != "a" else real) / total
    cpu = [[per_rank[r][method][i]["cpu"] for r in range(N)] for i in range(len(mbs))]
    ring = sum(max(per_rank[r][method][i]["ring"] for r in range(N)) for i in range(len(mbs)))
    row = dict(
        work=work,
        pad=pad,
        cropped=cropped / real,
        ring=ring,
        cpu_ratio=max(max_over_mean(c) for c in cpu),
        cpu_sum=sum(sum(c) for c in cpu),
    )
    row["fit"] = (list(mbs), cpu, pairs)
    if method == "d":
        a, b, c = weights
        row["model"] = [
            [(a * p[r // U] / U + b * S / N + c, measured[r]) for r in range(N)]
            for (_, S, _, _), measured, p in zip(mbs, cpu, pairs)
        ]
    return row


def main():
    from megatron_video.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=128, help="model width C = heads x head_dim")
    ap.add_argument("--iters", type=int, default=2)
    a = ap.parse_args()
    clips = dataset(a.clips)
    batches = micro_batches(clips, a.budget)
    with WorkerPool(N, ranks_per_node=2, timeout=3600) as pool:
        per_rank = pool.run(_rank_bench, batches, a.heads, a.width, a.iters)
    fits = [_summary(m, batches[m], per_rank, clips, None)["fit"] for m in "abc"]
    weights = _fit(*(sum((f[i] for f in fits), []) for i in range(3)))
    rows = {m: _summary(m, batches[m], per_rank, clips, weights) for m in batches}
    print(
        f"{len(clips)} clips ({sum(f == 1 for f, _, _ in clips)} images), "
        f"{sum(f * h * w for f, h, w in clips):,} tokens, budget {a.budget} per micro-batch, "
        f"U{U}xR{R}, C={a.width}, {a.heads} heads, fp32 fwd+bwd, one layer"
    )
    print(
        f"{'method':<34}{'mbs':>4}{'work max/mean':>14}{'padding':>9}{'cropped':>9}"
        f"{'ring KV bytes':>15}{'CPU max/mean':>13}{'CPU s sum':>10}{'vs (c)':>8}"
    )
    names = dict(
        a="(a) pad to longest, zigzag",
        b="(b) fixed-shape buckets, zigzag",
        c="(c) FFD packing, zigzag over CP",
        d="(d) ours: planned placement",
    )
    for m, row in rows.items():
        print(
            f"{names[m]:<34}{len(batches[m]):>4}{row['work']:>14.3f}{row['pad']:>9.1%}"
            f"{row['cropped']:>9.1%}{row['ring']:>15,}{row['cpu_ratio']:>13.3f}"
            f"{row['cpu_sum']:>10.2f}{row['cpu_sum'] / rows['c']['cpu_sum']:>8.2f}"
        )
    d, c = rows["d"], rows["c"]
    print(
        f"\nours vs (c): ring bytes {d['ring'] / max(1, c['ring']):.2f}x (target <= 0.6), work "
        f"max/mean {d['work']:.3f} (target <= 1.05; (c) {c['work']:.3f}), CPU max/mean "
        f"{d['cpu_ratio']:.3f} (target <= 1.1), CPU summed {d['cpu_sum'] / c['cpu_sum']:.2f}x "
        f"(target <= 0.8), padding {d['pad']:.2%} (target <= 1 %)"
    )
    errs = [abs(p - m) / m for mb in d["model"] for p, m in mb]
    print(
        f"cost model (fitted on the runs of (a)-(c): {weights[0] * 1e9:.2f} ns / pair, "
        f"{weights[1] * 1e6:.2f} us / token, {weights[2] * 1e3:.2f} ms / call): "
        f"|predicted - measured| / measured per rank and micro-batch: largest {max(errs):.1%}, "
        f"mean {sum(errs) / len(errs):.1%} (target <= 15 %)"
    )
    for (_, _, plan, _), mb in zip(batches["d"], d["model"]):
        pm = " ".join(f"{p * 1e3:.0f}/{m * 1e3:.0f}" for p, m in mb)
        print(f"  {plan.summary()}; ms predicted/measured per rank: {pm}")


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
