"""Save / resume with ``megatron.core.dist_checkpointing``: model, optimizer, LR scheduler, RNG, step.

Layout: Megatron-LM's directory naming -- ``<dir>/iter_0000100/`` (one distributed checkpoint per
save) and ``<dir>/latest_checkpointed_iteration.txt`` (the iteration of the newest complete one,
written by rank 0 after every rank finished saving); the two names are ``ITER_DIR`` / ``TRACKER``. Model and
optimizer are sharded tensors; scheduler state, step and the parallel layout are common
(identical on all ranks); the RNG states are one object per global rank. Resuming needs the same
world size and parallel layout (checked from the common part before anything is loaded), which is
what makes the resumed run bitwise identical to an uninterrupted one.
"""
from __future__ import annotations

import multiprocessing
import os
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["latest_step", "save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state",
           "TRACKER", "ITER_DIR"]

# Megatron-LM's names (megatron/training/checkpointing.py): tracker file and per-iteration folder.
TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = "iter_{:07d}"


def latest_step(directory) -> Optional[int]:
    """Step of the newest complete checkpoint under ``directory`` (None if there is none)."""
    f = Path(directory) / TRACKER
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{f} must hold a step number, found {text!r}")
    return int(text)


def _step_dir(directory, step: int) -> Path:
    return Path(directory) / ITER_DIR.format(step)


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "random": random.getstate(),
             "numpy": np.random.get_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextmanager
def _may_fork_writers():
    """Megatron's checkpoint writer forks helper processes, which a daemonic process (e.g. a test
    worker) may not have; lift the flag for the duration of the save only."""
    proc = multiprocessing.current_process()
    was = proc.daemon
    proc.daemon = False
    try:
        yield
    finally:
        proc.daemon = was


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(),
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size()}


def _sharded(model, optimizer, scheduler, step: int, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = model.sharded_state_dict()
    return {
        "layout": _layout(),
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "rng": ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0),
    }


def save_checkpoint(directory, step: int, model, optimizer, scheduler) -> Path:
    """Collective: save everything for ``step``; returns the step directory."""
    from megatron.core import dist_checkpointing

    path = _step_dir(directory, step)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.iterdir():  # an interrupted earlier save of the same step
            if stale.is_file():
                stale.unlink()
    dist.barrier()
    with _may_fork_writers():
        dist_checkpointing.save(_sharded(model, optimizer, scheduler, step, False), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = Path(directory) / f"{TRACKER}.tmp{os.getpid()}"
        tmp.write_text(str(step))
        os.replace(tmp, Path(directory) / TRACKER)
    dist.barrier()
    return path


def load_checkpoint(directory, model, optimizer, scheduler, step: Optional[int] = None) -> int:
    """Collective: restore the newest (or the given) checkpoint; returns its step."""
    from megatron.core import dist_checkpointing

    step = latest_step(directory) if step is None else step
    if step is None:
        raise ValueError(f"no checkpoint under {directory} (missing {TRACKER!r})")
    path = _step_dir(directory, step)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    saved = dist_checkpointing.load_common_state_dict(str(path)).get("layout")
    if saved != _layout():
        raise ValueError(f"checkpoint {path} was written with parallel layout {saved}; this job runs "
                         f"{_layout()} (resume with the same world size and parallel sizes)")
    loaded = dist_checkpointing.load(_sharded(model, optimizer, scheduler, step, True), str(path))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    if int(loaded["step"]) != step:
        raise ValueError(f"checkpoint {path} holds step {loaded['step']}, expected {step}")
    return step
