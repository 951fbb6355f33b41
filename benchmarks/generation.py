"""Streaming AR generation with a KV cache vs the recompute sampler (what a user has without it).

One ``ar_dit`` (random weights, float32, CPU) generates a 16-block video three ways:
``recompute`` = ``cp_sampling.sample_autoregressive`` (the whole ``[clean ; noisy]`` sequence at
every denoising step), ``cached`` = ``generation.streaming`` with an unbounded window, and
``cached sink+window`` (sink 2, window 8 latent frames). Printed: seconds per block against
the block index, the 16-block totals and their ratio, and the peak bytes of tensors alive
(``testing.LiveTensors``). Then on a gloo pool of 4 CPU ranks, for CP 1 / 2 (U2) / 4 (U2 x R2):
per-rank KV-cache bytes before the last block and per-rank CPU time (``time.process_time``) of
the last block (``--pool-blocks``, ``--pool-grid``: larger frames, so compute dominates). Times
are CPU seconds (one thread), robust on shared cores.

    python benchmarks/generation.py [--blocks 16 --grid 8 --steps 4 --pool-blocks 8 --pool-grid 24]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

NB = 2  # latent frames per block
HIDDEN, HEADS, LAYERS = 96, 4, 4  # the demo's ar_dit (examples/configs/demo.yaml)


def build(grid: int, tp: int = 1, cp: int = 1):
    from megatron_video.models.ar_dit import ARVideoDiT
    from megatron_video.models.video_dit import VideoDiTConfig

    torch.manual_seed(0)
    cfg = VideoDiTConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        lora_rank=16,
        in_channels=4,
        patch_size=(1, 1, 1),
        text_max_len=16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    model = ARVideoDiT(cfg).eval()
    with torch.no_grad():  # AdaLN-zero would make every block the identity
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def cond():
    ids = torch.randint(1, 8, (1, 16), generator=torch.Generator().manual_seed(2))
    return (ids, torch.ones(1, 16, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))


def noise(blocks: int, grid: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, blocks * NB * grid * grid, 4, generator=g)


def cached_run(model, blocks, grid, steps, groups=None, rule=None, stop_after=None):
    """Per-block seconds (and CPU seconds), cache bytes after each block."""
    from megatron_video.generation.ar_models import block_model
    from megatron_video.generation.streaming import stream_autoregressive

    S = grid * grid
    n = noise(blocks, grid)
    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    wall, cpu, nbytes = [], [], []
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for j, _, cache in stream_autoregressive(
            block_model(model, grid, grid, NB, rank, N),
            lambda j: n[:, j * NB * S : (j + 1) * NB * S],
            blocks,
            NB,
            S,
            cond(),
            groups=groups,
            num_steps=steps,
            rule=rule,
        ):
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            nbytes.append(cache.nbytes())
            t0, c0 = time.perf_counter(), time.process_time()
            if stop_after is not None and j + 1 == stop_after:
                break
    return wall, cpu, nbytes


def recompute_run(model, blocks, grid, steps):
    from megatron_video.generation.ar_models import recompute_velocity
    from megatron_video.generation.cp_sampling import sample_autoregressive
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    layout = BalancedSPLayout(blocks * NB, grid * grid, NB, 1)
    v = recompute_velocity(model, layout, 0, grid, grid)
    stamps = []

    def timed(x, t, c):
        out = v(x, t, c)
        stamps.append(time.process_time())
        return out

    t0 = time.process_time()
    with torch.no_grad():
        sample_autoregressive(timed, layout, 0, noise(blocks, grid), cond(), num_steps=steps)
    ends = [t0] + stamps[steps - 1 :: steps]
    return [b - a for a, b in zip(ends, ends[1:])]


def peak_bytes(fn) -> int:
    from megatron_video.testing.live_memory import LiveTensors

    with LiveTensors() as live:
        fn()
    return live.peak


def single_process(a):
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.testing.parallel import model_parallel

    torch.set_num_threads(1)
    with model_parallel(seed=0):
        model = build(a.grid)
        recompute_run(model, 1, a.grid, 1), cached_run(model, 2, a.grid, 1)  # warm-up
        rec = recompute_run(model, a.blocks, a.grid, a.steps)
        _, cac, _ = cached_run(model, a.blocks, a.grid, a.steps)
        _, win, _ = cached_run(model, a.blocks, a.grid, a.steps, rule=WindowRule(NB, 2, 8))
        print(
            f"ar_dit {LAYERS} layers, hidden {HIDDEN}; {a.grid}x{a.grid} tokens a frame, "
            f"{NB} frames a block, {a.steps} steps, {a.blocks} blocks, float32, 1 process"
        )
        print("block  recompute_s  cached_s  cached_sink2_window8_s")
        for j in range(a.blocks):
            print(f"{j:5d}  {rec[j]:11.3f}  {cac[j]:8.3f}  {win[j]:22.3f}")
        print(f"total  {sum(rec):11.2f}  {sum(cac):8.2f}  {sum(win):22.2f}")
        print(
            f"recompute / cached: {sum(rec) / sum(cac):.1f}x; recompute / sink+window: "
            f"{sum(rec) / sum(win):.1f}x"
        )
        b = min(a.blocks, 8)
        pr = peak_bytes(lambda: recompute_run(model, b, a.grid, a.steps))
        pc = peak_bytes(lambda: cached_run(model, b, a.grid, a.steps))
        print(
            f"peak tensor bytes, {b} blocks: recompute {pr / 2**20:.1f} MiB, "
            f"cached {pc / 2**20:.1f} MiB"
        )


def _rank_case(blocks, grid, steps, U, R):
    from megatron_video.testing.parallel import model_parallel, video_parallel

    torch.set_num_threads(1)
    with model_parallel(seed=0):
        cached_run(build(grid), 2, grid, 1)  # warm-up
    if U * R == 1:
        with model_parallel(seed=0):
            _, cpu, nbytes = cached_run(build(grid), blocks, grid, steps)
    else:
        with video_parallel(U, R, seed=0) as groups:
            _, cpu, nbytes = cached_run(build(grid, cp=U * R), blocks, grid, steps, groups)
    return cpu[-1], nbytes[-2]


def pool_runs(a):
    from megatron_video.testing import WorkerPool

    print(
        f"\nper rank, 4 gloo ranks on this machine ({os.cpu_count()} cores), 1 thread each; "
        f"{a.pool_grid}x{a.pool_grid} tokens a frame"
    )
    print(
        f"CP         cache_bytes_after_{a.pool_blocks - 1}_blocks  cpu_s_block_{a.pool_blocks} "
        f"(max over ranks)  vs CP1"
    )
    base = None
    with WorkerPool(4, ranks_per_node=4, timeout=3600) as pool:
        for U, R in ((1, 1), (2, 1), (2, 2)):
            res = pool.run(_rank_case, a.pool_blocks, a.pool_grid, a.steps, U, R)
            cpu, nbytes = max(r[0] for r in res), max(r[1] for r in res)
            base = base or cpu
            print(f"{U * R} (U{U}xR{R})  {nbytes:27d}  {cpu:32.3f}  {cpu / base:5.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--grid", type=int, default=8, help="tokens a frame: grid x grid")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps a block (LongLive: 4)")
    ap.add_argument("--pool-grid", type=int, default=24, help="tokens a frame on the pool")
    ap.add_argument("--pool-blocks", type=int, default=8, help="blocks on the pool")
    ap.add_argument("--skip-pool", action="store_true")
    a = ap.parse_args()
    import torch.distributed as dist

    from megatron_video.training.trainer import init_distributed

    init_distributed()
    single_process(a)
    dist.destroy_process_group()
    if not a.skip_pool:
        pool_runs(a)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
