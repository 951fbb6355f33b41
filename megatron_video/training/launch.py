"""Start a training job: N local CPU ranks with gloo (``--nproc``), or this process under torchrun.

``--nproc N`` spawns N worker processes on this machine (gloo, one rendezvous port) with simulated
nodes: ``ranks_per_node`` sets ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` / ``GROUP_RANK`` as torchrun
would on a real cluster, which is what the U x R placement rules read. Workers fork from a server
that preloaded torch and Megatron, and are not daemonic (Megatron's checkpoint writer forks
helpers). If a worker fails, the others are terminated and the launcher returns its exit code.

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment) the current process is one rank:
NCCL on GPUs, gloo on CPU.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import Optional

import torch.multiprocessing as mp

from .config import Config, validate

__all__ = ["under_torchrun", "launch"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, ranks_per_node: int, threads: int, config: Config,
            cpu: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
        GROUP_RANK=str(rank // ranks_per_node), OMP_NUM_THREADS=str(threads))
    import torch

    torch.set_num_threads(threads)
    from .trainer import train

    train(config, cpu=cpu)


def launch(config: Config, nproc: int, ranks_per_node: Optional[int] = None, cpu: bool = False) -> int:
    """Run ``config`` on ``nproc`` local ranks; returns the exit code (0 = success).

    ``cpu``: every rank enters CPU mode (``megatron_video.compat.ensure_cpu_mode``) first."""
    if ranks_per_node is None:
        ranks_per_node = config.parallel.ranks_per_node or nproc
    validate(config, nproc)  # again here: launch() is also a library entry
    if nproc % ranks_per_node:
        raise ValueError(f"--ranks-per-node ({ranks_per_node}) must divide --nproc ({nproc})")
    from .vae_stage import ensure_vae

    ensure_vae(config, progress=config.train.progress)  # once, before the ranks start
    if nproc == 1:
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        from .trainer import train

        train(config, cpu=cpu)
        return 0
    threads = max(1, (os.cpu_count() or 1) // nproc)
    port = _free_port()
    # Ranks fork from a server that imported torch / Megatron once (a fresh import per rank costs
    # seconds each); the server itself never touches CUDA, so forking stays safe on GPUs.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.parallel_state",
                                "megatron_video.training.trainer"])
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, ranks_per_node, threads, config, cpu),
                         daemon=False) for r in range(nproc)]
    for p in procs:
        p.start()
    code = 0
    try:
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                code = failed[0].exitcode
                print(f"[megatron-video] rank {procs.index(failed[0])} exited with code {code}; "
                      f"stopping the other ranks", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if code == 0:
        codes = [p.exitcode for p in procs]
        code = next((c for c in codes if c != 0), 0)
    return int(code) if code >= 0 else 1
