"""MR-SP (GRPO of the video LLaVA under CP, ``mmsp.rl``): the embedding cache against re-encoding
the frames at every pass, and per-rank memory against the number of frames at CP 1 and CP 4.

On a gloo pool of 4 CPU ranks (U2 x R2, 2 simulated nodes x 2; CP 1: each rank alone) with a tiny
``MMSPLLaVAModel`` (FrameViT encoder, MLP projector, 2-layer GPT with 2D attention), one GRPO step
of one prompt (one video + a question) is timed, max over ranks, the fastest of ``--iters``:

* **cached**: ``encode_video`` once, its tokens feeding the rollout prefill, the reference's and
  the policy's log-probs (what ``train.objective: grpo`` does);
* **re-encoded**: every pass encodes the frames again (the rollout, then the reference and the
  policy for each of the ``G`` responses: ``1 + 2 G`` encoder calls; LongVILA-R1 without its cache);

at ``G`` = 4 and 8, with the encoder's own time and call count. Then the step's peak live tensor
bytes per rank (``testing.LiveTensors``: deterministic) against the frames at CP 1 and CP 4.
Then rollout tokens / s at U2 x R2 (``G`` 4, ``--decode-tokens`` each), side by side in one run:
the KV cache (prefix and responses cached, one new token per response and step) against
recomputing the whole sequence for every token (``rollout(kv_cache=False)``); the tokens must
be the same.

    python benchmarks/mrsp.py [--frames 32] [--group 4 8] [--mem-frames 16 32 64] [--iters 3]
                              [--decode-tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

IMG = -200
SIZES = dict(
    vocab_size=64,
    max_sequence_length=1024,
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vision_layers=4,  # a vision tower heavier than the LLM, as SigLIP is next to a small LLM
    vision_hidden_size=256,
    vision_heads=4,
    img_size=16,
    patch_dim=8,
)


def _models(cp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model

    kw = dict(context_parallel_size=cp)
    if cp == 4:
        kw["hierarchical_context_parallel_sizes"] = [2, 2]
    ps.initialize_model_parallel(**kw)
    model_parallel_cuda_manual_seed(0)
    sizes = VideoLLaVASizes(**SIZES)
    comm = "a2a+p2p" if cp == 4 else None
    out = []
    for _ in range(2):  # policy, reference (the same start)
        torch.manual_seed(0)
        out.append(video_llava_model(sizes, cp=cp, cp_comm_type=comm))
    for name, p in out[0].named_parameters():
        if name.startswith(("vision_model.", "vision_projection.")):
            p.requires_grad_(False)
    return out


def _prompt(frames: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (1, 8), generator=g)
    ids[0, 1] = IMG
    return torch.randn(frames, 3, 16, 16, generator=g), ids


class _ReEncoded:
    """``VideoTokens`` without the cache: every read of ``local`` encodes the frames again."""

    def __init__(self, model, images, counter):
        self.model, self.images, self.counter = model, images, counter
        self.num_frames = images.shape[0]

    @property
    def local(self):
        from megatron_video.mmsp import rl

        self.counter.append(1)
        return rl.encode_video(self.model, self.images).local


def _step(policy, reference, images, ids, G, cached, encoder_s):
    """One GRPO step of one prompt; returns the encoder calls."""
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig

    cfg = RLConfig(group_size=G, max_new_tokens=2, temperature=1.0)
    calls = []
    if cached:
        calls.append(1)
        t0 = time.perf_counter()
        visual = rl.encode_video(policy, images)
        encoder_s.append(time.perf_counter() - t0)
    else:
        visual = _ReEncoded(policy, images, calls)
    ro = rl.rollout(policy, visual, ids, cfg, prompt_seed=0)
    rewards = torch.arange(G, dtype=torch.float64)
    policy.zero_grad(set_to_none=True)
    loss, _ = rl.grpo_loss(policy, reference, visual, ids, ro, rewards, cfg, int(ro.lengths.sum()))
    loss.backward()
    return len(calls)


def _time_case(frames, groups, iters):
    import torch.distributed as dist

    from megatron_video.compat import destroy_model_parallel

    policy, reference = _models(4)
    images, ids = _prompt(frames)
    out = {}
    try:
        for G in groups:
            for cached in (True, False):
                times, enc = [], []
                for _ in range(iters):
                    dist.barrier()
                    t0 = time.perf_counter()
                    calls = _step(policy, reference, images, ids, G, cached, enc)
                    times.append(time.perf_counter() - t0)
                out[(G, cached)] = (min(times), calls, min(enc) if enc else None)
    finally:
        destroy_model_parallel()
    return out


def _decode_case(frames, L):
    """Rollout seconds with the KV cache and with recompute, and whether the tokens agree."""
    import torch.distributed as dist

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig

    policy, _ = _models(4)
    images, ids = _prompt(frames)
    cfg = RLConfig(group_size=4, max_new_tokens=L, temperature=1.0)
    out = {}
    try:
        visual = rl.encode_video(policy, images)
        for kv in (True, False):
            dist.barrier()
            t0 = time.perf_counter()
            ro = rl.rollout(policy, visual, ids, cfg, prompt_seed=0, kv_cache=kv)
            out[kv] = (time.perf_counter() - t0, ro.tokens)
    finally:
        destroy_model_parallel()
    return out


def _memory_case(frames_list, cp):
    from megatron_video.compat import destroy_model_parallel
    from megatron_video.testing.live_memory import LiveTensors

    policy, reference = _models(cp)
    out = {}
    try:
        for frames in frames_list:
            images, ids = _prompt(frames)
            held = tuple(policy.parameters()) + tuple(reference.parameters())
            with LiveTensors(exclude=held + (images, ids)) as live:
                _step(policy, reference, images, ids, 4, True, [])
            out[frames] = live.peak
    finally:
        destroy_model_parallel()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--group", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mem-frames", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    a = ap.parse_args()
    from megatron_video.testing import WorkerPool

    with WorkerPool(4, ranks_per_node=2, timeout=1800) as pool:
        per_rank = pool.run(_time_case, a.frames, a.group, a.iters)
        mem = {cp: pool.run(_memory_case, a.mem_frames, cp) for cp in (1, 4)}
        dec = pool.run(_decode_case, a.frames, a.decode_tokens)
    print(
        f"(a) one GRPO step of one prompt, {a.frames} frames, U2xR2 on 4 gloo ranks (max over ranks)"
    )
    print(
        f"{'G':>3} {'cached s':>9} {'re-encoded s':>13} {'ratio':>6} {'encoder calls':>14} {'encoder s':>10}"
    )
    for G in a.group:
        c = max(r[(G, True)][0] for r in per_rank)
        n = max(r[(G, False)][0] for r in per_rank)
        calls = f"{per_rank[0][(G, True)][1]} vs {per_rank[0][(G, False)][1]}"
        enc = max(r[(G, True)][2] for r in per_rank)
        print(f"{G:>3} {c:>9.3f} {n:>13.3f} {n / c:>5.2f}x {calls:>14} {enc:>10.4f}")
    print("\n(b) peak live tensor bytes per rank of the step (G 4), max over ranks")
    print(f"{'frames':>6} {'CP 1 MiB':>9} {'CP 4 MiB':>9} {'CP 4 / CP 1':>12}")
    for f in a.mem_frames:
        one, four = (max(r[f] for r in mem[cp]) / 2**20 for cp in (1, 4))
        print(f"{f:>6} {one:>9.2f} {four:>9.2f} {four / one:>11.2f}x")
    n = 4 * a.decode_tokens
    kv, re_ = (max(r[k][0] for r in dec) for k in (True, False))
    same = all(torch.equal(r[True][1], r[False][1]) for r in dec)
    print(
        f"\n(c) rollout of 4 x {a.decode_tokens} tokens, {a.frames} frames, U2xR2 (max over ranks)"
    )
    print(f"{'KV cache tok/s':>15} {'recompute tok/s':>16} {'speed-up':>9} {'same tokens':>12}")
    print(f"{n / kv:>15.1f} {n / re_:>16.1f} {re_ / kv:>8.2f}x {'yes' if same else 'NO':>12}")


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
