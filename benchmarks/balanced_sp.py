"""Balanced SP vs naive Ulysses slicing for teacher-forced AR video diffusion (counts, not timings).

Three layouts of the teacher-forcing sequence ``[clean ; noisy]`` over ``P = U*R`` SP ranks:

* naive:     rank ``c`` holds the ``c``-th contiguous slice of ``[clean ; noisy]``; every rank
             encodes the whole video with the VAE (replicated) and slices its latents;
* balanced:  rank ``c`` holds frames ``[c*F/P, (c+1)*F/P)`` as clean AND noisy; VAE on its raw
             window with a left halo;
* balanced+ring: the same with zigzag chunk pairing over the ring slices.

Per rank: loss tokens, unmasked attention work (query-key pairs after the Ulysses gather, over the
``U`` head shards), raw frames VAE-encoded, raw-video bytes received, and per-layer attention comm
bytes (a2a / ring, from the 2D-attention formula). Printed with max/mean. ``--measure`` also runs
the teacher-forcing objective on a gloo pool of ``P`` CPU ranks and prints the traced comm bytes.

    python benchmarks/balanced_sp.py --frames 64 --tokens-per-frame 1560 --frames-per-block 4 -U 4 -R 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.layouts.balanced_sp import (  # noqa: E402
    BalancedSPLayout,
    max_over_mean,
    naive_identity_units,
    naive_slice_global_ids,
    ring_attention_work,
)
from megatron_video.layouts.vae_halo import num_raw_frames, windows_for_bounds  # noqa: E402
from megatron_video.models.vae import CausalVideoEncoder, CausalVideoVAE  # noqa: E402
from megatron_video.models.vae_halo_probe import temporal_receptive_field  # noqa: E402

STRIDE = CausalVideoVAE.temporal_stride  # the project's VAE


def per_rank_rows(a):
    F, S, nb, U, R = a.frames, a.tokens_per_frame, a.frames_per_block, a.ulysses, a.ring
    P = U * R
    T = num_raw_frames(F, STRIDE)
    frame_bytes = a.channels * a.height * a.width * a.bytes_per_elt
    rows = {}

    # naive slicing: loss tokens and work from the single-GPU order; replicated VAE encoding
    side, block = naive_identity_units(F, nb)
    ring = ring_attention_work(side, block, nb * S, R)
    rows["naive"] = dict(
        loss=[int((naive_slice_global_ids(F, S, P, c) >= F * S).sum()) for c in range(P)],
        work=[ring[c // U] / U for c in range(P)],
        vae=[T] * P,
        raw_bytes=[T * frame_bytes] * P,
    )

    for name, bal in (("balanced", False), ("balanced+ring", True)):
        lay = BalancedSPLayout(F, S, nb, P, ring_size=R, ring_balance=bal)
        vae = [
            sum(w.num_raw for w in windows_for_bounds(lay.rank_segments(c), a.halo, STRIDE))
            for c in range(P)
        ]
        rows[name] = dict(
            loss=lay.loss_tokens_per_rank(),
            work=lay.attention_work_per_rank(),
            vae=vae,
            raw_bytes=[v * frame_bytes for v in vae],
        )
    return rows


def comm_per_layer(a):
    """Forward bytes per rank per attention layer (docs/architecture.md, Capabilities 1),
    identical for all three layouts."""
    U, R = a.ulysses, a.ring
    P = U * R
    G = a.batch * (2 * a.frames * a.tokens_per_frame // P) * a.head_dim * a.bytes_per_elt
    a2a = G * (2 * a.heads + 2 * a.kv_heads) * (U - 1) // U
    ring = (R - 1) * 2 * a.kv_heads * G
    return a2a, ring


def fmt(v):
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def print_table(rows, a):
    P = a.ulysses * a.ring
    metrics = [
        ("loss", "loss tokens"),
        ("work", "unmasked attn pairs"),
        ("vae", "VAE raw frames"),
        ("raw_bytes", "raw video bytes in"),
    ]
    print(
        f"F={a.frames} latent frames, S={a.tokens_per_frame} tokens/frame, nb={a.frames_per_block}, "
        f"P={P} (U={a.ulysses} x R={a.ring}), VAE halo={a.halo} latents, "
        f"raw frames T={num_raw_frames(a.frames, STRIDE)}"
    )
    head = (
        f"{'metric':<22} {'layout':<14} "
        + " ".join(f"{'r' + str(c):>12}" for c in range(P))
        + f" {'total':>14} {'max/mean':>9}"
    )
    print(head)
    print("-" * len(head))
    for key, label in metrics:
        for name, r in rows.items():
            vals = r[key]
            print(
                f"{label:<22} {name:<14} "
                + " ".join(f"{fmt(v):>12}" for v in vals)
                + f" {fmt(sum(vals)):>14} {max_over_mean(vals):>9.3f}"
            )
    a2a, ring = comm_per_layer(a)
    print(
        f"\nattention comm per rank per layer (fwd, all layouts alike): all-to-all {a2a:,} B "
        f"(intra-node), ring {ring:,} B (inter-node)"
    )
    rb = rows["naive"]["raw_bytes"][0]
    hb = max(rows["balanced"]["raw_bytes"])
    print(
        f"raw video per rank: replicated {rb:,} B vs halo window (max) {hb:,} B "
        f"-> {rb / hb:.2f}x less loading and VAE work"
    )


# ----------------------------------------------------------------------------------------------
# --measure: traced comm of the objective on a CPU gloo pool
# ----------------------------------------------------------------------------------------------
def _measure_rank(U, R, F, S, nb, heads, head_dim, balance):
    from megatron_video.attention import RingStats, dist_attention
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.diffusion.teacher_forcing import TeacherForcingObjective
    from megatron_video.parallel import CommTracer, destroy_video_parallel, init_video_parallel

    kw = dict(tensor_model_parallel_size=1, context_parallel_size=U * R)
    if U > 1 and R > 1:
        kw["hierarchical_context_parallel_sizes"] = [U, R]
    initialize_model_parallel(**kw)
    try:
        groups = init_video_parallel(U, R)
        lay = BalancedSPLayout(F, S, nb, U * R, ring_size=R, ring_balance=balance)
        obj = TeacherForcingObjective(lay, groups)
        dim = heads * head_dim
        proj = torch.nn.Linear(dim, 3 * dim)
        stats = RingStats()

        def model(x, t, *, frame_positions, token_ids, mask):  # one attention layer
            b, L, _ = x.shape
            q, k, v = proj(x).view(b, L, 3, heads, head_dim).unbind(2)
            return dist_attention(
                q, k, v, groups, mask=mask, scheme="contiguous", stats=stats
            ).reshape(b, L, dim)

        clean = torch.randn(1, lay.local_len // 2, dim)
        with CommTracer() as tr:
            out = obj(model, clean, block_timesteps=torch.rand(1, lay.num_blocks))
            out.loss.backward()
        return dict(
            a2a=(tr.bytes("all_to_all", "fwd"), tr.bytes("all_to_all", "bwd")),
            ring=(tr.bytes("send", "fwd"), tr.bytes("send", "bwd")),
            blocks=stats.blocks,
            skipped=stats.blocks_skipped,
        )
    finally:
        destroy_video_parallel()
        destroy_model_parallel()


def measure(a):
    from megatron_video.testing import WorkerPool

    P = a.ulysses * a.ring
    with WorkerPool(P, ranks_per_node=a.ulysses, timeout=600) as pool:
        for bal in (False, True):
            res = pool.run(
                _measure_rank,
                a.ulysses,
                a.ring,
                a.frames,
                a.tokens_per_frame,
                a.frames_per_block,
                a.heads,
                a.head_dim,
                bal,
            )
            print(
                f"measured (ring_balance={bal}, 1 layer, (fwd, bwd) bytes per rank): a2a "
                f"{[r['a2a'] for r in res]}, ring {[r['ring'] for r in res]}; fwd ring sub-blocks "
                f"skipped/total {[(r['skipped'], r['blocks']) for r in res]}"
            )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--tokens-per-frame", type=int, default=1560)
    p.add_argument("--frames-per-block", type=int, default=2)
    p.add_argument("-U", "--ulysses", type=int, default=4)
    p.add_argument("-R", "--ring", type=int, default=2)
    p.add_argument(
        "--halo",
        type=int,
        default=None,
        help="VAE halo latents (default: derived from the small causal VAE's encoder)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bytes-per-elt", type=int, default=2)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument(
        "--measure",
        action="store_true",
        help="also trace comm of one TF attention layer on a CPU gloo pool (use small sizes)",
    )
    a = p.parse_args(argv)
    if a.halo is None:
        a.halo = temporal_receptive_field(CausalVideoEncoder())
    print_table(per_rank_rows(a), a)
    if a.measure:
        measure(a)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
