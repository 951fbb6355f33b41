"""MR-SP on Qwen2.5-VL (``qwen_vl``): one GRPO step's peak live tensor bytes per rank at CP 1 and
CP 4 against the number of frames (the acceptance target: CP 4 <= 0.3x CP 1).

On a gloo pool of 4 CPU ranks (2 simulated nodes x 2) with a tiny random Qwen2.5-VL
(``models.qwen_vl.tiny_hf_config``: text 2 layers x 64, vision depth 2 x 32, patch 4, temporal
patch 2, 2x2 merger) as ``mmsp.qwen_vl.MMSPQwenVLModel``: one prompt (text, one video of
``--size`` x ``--size`` pixel frames, text), the step of ``train.objective: grpo`` -- the vision
tower once (frozen, ``rl.train_encoder`` false), ``G`` rollouts of ``--new-tokens`` with the KV
cache, the reference's and the policy's log-probs, the GRPO loss and its backward. CP 4 is U2 x R2
(``a2a+p2p``); CP 1 runs on rank 0 alone (the other ranks idle). Peak bytes of the tensors the
step allocates (``testing.LiveTensors`` around ``testing.qwen_grpo_memory``'s step: deterministic,
no allocator noise), max over ranks; the weights and the inputs are not counted (ids, every pixel
row: ``rl.encode_video`` picks this rank's temporal patches; a loader decoding only its frames,
``data.qwen_video_qa``, would hand only those).

    python benchmarks/qwen_grpo_memory.py [--frames 256 512 1024] [--size 16] [--group 4]
                                          [--new-tokens 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--frames", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--size", type=int, default=16, help="frame side in pixels (multiple of 8)")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=2, help="tokens per response")
    a = ap.parse_args()
    if a.size % 8 or a.size < 8:
        ap.error(f"--size ({a.size}) must be a multiple of 8 (4-pixel patches merged 2x2)")
    if min(a.frames) < 8 or any(f % 2 for f in a.frames):
        ap.error(f"--frames ({a.frames}) must be even and >= 8 (>= 4 temporal patches for CP 4)")
    from megatron_video.testing import WorkerPool
    from megatron_video.testing.qwen_grpo_memory import grpo_step_memory

    args = (a.frames, a.size, a.group, a.new_tokens)
    with WorkerPool(4, ranks_per_node=2, timeout=1800) as pool:
        mem = {cp: [r for r in pool.run(grpo_step_memory, *args[:1], cp, *args[1:]) if r]
               for cp in (1, 4)}  # fmt: skip
    tok = (a.size // 8) ** 2
    print(
        f"one GRPO step (G {a.group}, {a.new_tokens} new tokens) of one {a.size}x{a.size} video, "
        f"{tok} visual tokens per temporal patch: peak live tensor bytes per rank (max over ranks)"
    )
    print(f"{'frames':>6} {'LLM tokens':>10} {'CP 1 MiB':>9} {'CP 4 MiB':>9} {'CP 4 / CP 1':>12}"
          f" {'CP 1 s':>7} {'CP 4 s':>7}")  # fmt: skip
    for f in a.frames:
        one, four = (max(r[f][0] for r in mem[cp]) / 2**20 for cp in (1, 4))
        s1, s4 = (max(r[f][1] for r in mem[cp]) for cp in (1, 4))
        n = f // 2 * tok + 9
        print(f"{f:>6} {n:>10} {one:>9.2f} {four:>9.2f} {four / one:>11.2f}x {s1:>7.1f} {s4:>7.1f}")


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
