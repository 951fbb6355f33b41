"""One GRPO rollout of a 16-block ``wan_ar``-shaped video at CP 1 / 2 / 4: streaming vs recompute.

A tiny random ``wan_ar`` (``WanModel``, 2 layers, 4 heads x 16, Wan's patch (1, 2, 2), 4 latent
channels, float32, CPU) generates one video of ``--blocks`` blocks of ``--frames-per-block`` latent
frames (Self-Forcing's Wan: 3) of ``--grid`` x ``--grid`` tokens, ``--steps`` denoising steps a
block, two ways, on a gloo pool of 4 CPU ranks (1 thread each), at CP 1, 2 (U2) and 4 (U2 x R2):

* ``streaming``: ``generation.streaming.stream_autoregressive`` (the rollout of the AR families'
  GRPO): block ``j`` denoised against the KV cache of the clean blocks before it, sharded over CP;
* ``recompute``: ``cp_sampling.sample_autoregressive`` with ``ar_models.recompute_velocity`` (no
  cache): every denoising step runs the whole teacher-forcing sequence ``[clean ; noisy]`` of the
  video, so a block re-runs every earlier (clean) block.

Per rank, side by side in one run: the peak bytes of tensors alive during the rollout
(``testing.LiveTensors``, a second pass: counted per storage, no allocator noise; the model's
weights excluded) and the CPU seconds per block (``time.process_time``, the first
pass: robust on shared cores), the max over the ranks. The rollout is the sampler's ODE form;
Flow-GRPO's SDE step adds one Gaussian draw per step, nothing per token of attention.

    python benchmarks/rl_rollout.py [--blocks 16 --frames-per-block 3 --grid 6 --steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.testing.wan import TINY_WAN as TINY  # noqa: E402  (tests' tiny Wan)

CHANNELS = 16  # a token: 4 latent channels x patch 1 x 2 x 2
LAYOUTS = ((1, 1), (2, 1), (2, 2))  # (Ulysses, ring): CP 1, 2, 4


def build():
    """The tiny ``wan_ar`` under the current parallel state (seeded weights, every layout)."""
    from megatron_video.models.wan import WanModel, get_wan_layer_spec
    from megatron_video.models.wan.interop import wan_config

    torch.manual_seed(0)
    model = WanModel(wan_config(TINY), layer_spec=get_wan_layer_spec(wan_config(TINY)))
    with torch.no_grad():  # Wan's zero-initialised output would make every velocity 0
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def noise(blocks: int, nb: int, grid: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, blocks * nb * grid * grid, CHANNELS, generator=g)


def cond():
    return (torch.randn(1, 8, TINY["text_dim"], generator=torch.Generator().manual_seed(2)),)


def streaming(model, blocks, nb, grid, steps, groups=None):
    """CPU seconds per block of the streaming rollout, and the video ``[1, F*S, C]``."""
    from megatron_video.generation.ar_models import block_model
    from megatron_video.generation.streaming import stream_autoregressive

    S, n = grid * grid, noise(blocks, nb, grid)
    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    cpu, out, c0 = [], [], time.process_time()
    with torch.no_grad():
        for _, block, _ in stream_autoregressive(
            block_model(model, grid, grid, nb, rank, N),
            lambda j: n[:, j * nb * S : (j + 1) * nb * S],
            blocks,
            nb,
            S,
            cond(),
            groups=groups,
            num_steps=steps,
        ):
            cpu.append(time.process_time() - c0)
            out.append(block)
            c0 = time.process_time()
    return cpu, torch.cat(out, dim=1)


def recompute(model, blocks, nb, grid, steps, groups=None):
    """CPU seconds per block of the recompute rollout (the whole sequence at every step), and
    this rank's clean tokens with their ids in the video."""
    from megatron_video.generation.ar_models import recompute_velocity
    from megatron_video.generation.cp_sampling import sample_autoregressive
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    U = 1 if groups is None else groups.ulysses_size
    layout = BalancedSPLayout(
        blocks * nb, grid * grid, nb, N, ring_size=N // U, ulysses_size=U, num_heads=4
    )
    v = recompute_velocity(model, layout, rank, grid, grid)
    stamps = []

    def timed(x, t, c):
        out = v(x, t, c)
        stamps.append(time.process_time())
        return out

    half = layout.local_len // 2
    ids = layout.local_global_ids(rank)[half:] - blocks * nb * grid * grid
    t0 = time.process_time()
    with torch.no_grad():
        clean = sample_autoregressive(timed, layout, rank, noise(blocks, nb, grid)[:, ids],
                                      cond(), num_steps=steps)  # fmt: skip
    ends = [t0] + stamps[steps - 1 :: steps]
    return [b - a for a, b in zip(ends, ends[1:])], (clean, layout.local_global_ids(rank)[:half])


def peak_bytes(fn, model) -> int:
    from megatron_video.testing.live_memory import LiveTensors

    with LiveTensors(exclude=tuple(model.parameters())) as live:
        fn()
    return live.peak


def rank_case(blocks: int, nb: int, grid: int, steps: int, U: int, R: int) -> dict:
    """This rank's numbers of both rollouts at CP ``U*R`` (CP 1: no groups)."""
    from megatron_video.testing.parallel import model_parallel, video_parallel

    torch.set_num_threads(1)
    ctx = model_parallel(seed=0) if U * R == 1 else video_parallel(U, R, seed=0)
    with ctx as groups:
        groups = None if U * R == 1 else groups
        model = build()
        streaming(model, 1, nb, grid, 1, groups)  # warm-up
        out, got = {}, {}
        for name, fn in (("streaming", streaming), ("recompute", recompute)):
            cpu, got[name] = fn(model, blocks, nb, grid, steps, groups)
            peak = peak_bytes(lambda: fn(model, blocks, nb, grid, steps, groups), model)
            out[name] = dict(cpu=cpu, peak=peak)
    clean, ids = got["recompute"]  # the same video both ways (this rank's tokens)
    out["max_diff"] = float((got["streaming"][:, ids] - clean).abs().max())
    return out


def table(results: dict, blocks: int) -> str:
    """``results[(U, R)]``: the ranks' ``rank_case`` outputs -> the side-by-side table."""
    lines = [
        "CP         streaming: peak MiB  s/block  last block s | "
        "recompute: peak MiB  s/block  last block s | recompute/streaming time | max |diff|"
    ]
    for (U, R), ranks in results.items():
        row = f"{U * R} (U{U}xR{R})"
        tot = {}
        for name in ("streaming", "recompute"):
            peak = max(r[name]["peak"] for r in ranks) / 2**20
            per = max(sum(r[name]["cpu"]) for r in ranks) / blocks
            last = max(r[name]["cpu"][-1] for r in ranks)
            tot[name] = per
            row += f"  {peak:18.2f}  {per:7.3f}  {last:12.3f} |"
        row += f"  {tot['recompute'] / tot['streaming']:23.1f}x"
        row += f" | {max(r['max_diff'] for r in ranks):.1e}"
        lines.append(row)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--frames-per-block", type=int, default=3, help="latent frames a block")
    ap.add_argument("--grid", type=int, default=6, help="tokens a frame: grid x grid")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps a block")
    a = ap.parse_args()
    from megatron_video.testing import WorkerPool

    results = {}
    with WorkerPool(4, ranks_per_node=4, timeout=3600) as pool:
        for U, R in LAYOUTS:
            results[(U, R)] = pool.run(
                rank_case, a.blocks, a.frames_per_block, a.grid, a.steps, U, R
            )
    print(
        f"wan_ar (tiny, 2 layers, hidden 64), {a.blocks} blocks x {a.frames_per_block} latent "
        f"frames x {a.grid}x{a.grid} tokens, {a.steps} steps a block, float32; per rank, max "
        f"over 4 gloo ranks ({os.cpu_count()} cores, 1 thread each)"
    )
    print(table(results, a.blocks))


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
