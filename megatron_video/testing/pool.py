"""A pool of N gloo worker processes, started once and reused for many multi-rank cases.

Process start-up with torch + megatron costs seconds, so tests start one pool per module and run
many functions in it. ``pool.run(fn, *args)`` runs ``fn`` on every rank and returns the list of
per-rank results; if any rank raises, ``RankError`` carries every failing rank's traceback. A run
that does not finish within ``timeout`` kills the pool (it restarts on the next run) instead of
hanging. After each run a worker destroys the process groups the case left behind; a pool whose
workers still hold more than ``max_loop_threads`` gloo devices (each polls every 10 ms) is
restarted on its next run. Simulated nodes: ``ranks_per_node`` sets ``LOCAL_WORLD_SIZE`` /
``LOCAL_RANK`` in the workers, which is what ``megatron_video.parallel.topology`` reads for
placement rules.

``fn`` must be importable by qualified name (a module-level function); the workers get the parent's
``sys.path`` so test modules import as they do under pytest.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import itertools
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, List, Optional

import torch.multiprocessing as mp

from .mutations import ENV as MUTATION_ENV
from .mutations import broken

__all__ = ["WorkerPool", "RankError"]


class RankError(RuntimeError):
    """One or more ranks raised (or did not finish); the message holds every rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(rank: int, world_size: int, ranks_per_node: Optional[int]) -> dict:
    rpn = ranks_per_node or world_size
    return {
        "LOCAL_WORLD_SIZE": str(rpn),
        "LOCAL_RANK": str(rank % rpn),
        "GROUP_RANK": str(rank // rpn),
    }


def _reset_rank_state() -> None:
    """Leave no Megatron / tracer state behind between cases run in the same worker."""
    try:
        from megatron_video.compat import destroy_model_parallel

        destroy_model_parallel()
    except Exception:  # pragma: no cover - megatron missing or half-initialised
        pass
    try:
        from megatron_video.parallel.topology import destroy_video_parallel

        destroy_video_parallel()
    except Exception:  # pragma: no cover
        pass
    try:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.get_cuda_rng_tracker().reset()
    except Exception:  # pragma: no cover
        pass
    try:
        _destroy_stray_groups()
    except Exception:  # pragma: no cover - a private torch attribute changed
        pass


def _destroy_stray_groups() -> None:
    """Destroy process groups a case created and left behind (``dist.new_group`` in a test or in
    code under test). Each live gloo group keeps a TCP loop thread that wakes every 10 ms: left to
    pile up over a session they burn a core of a small CI machine in idle workers."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None) or {}
    for g in list(pg_map):
        if g is not dist.GroupMember.WORLD:
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # pragma: no cover - already destroyed
                pass


def _gloo_loop_threads() -> int:
    """Live gloo TCP loop threads of this process (one per gloo device; 0 where /proc is absent).
    Each wakes every 10 ms, so devices kept alive after their groups were destroyed (by references
    held in C++) cost CPU in idle workers; the pool restarts workers that collect too many."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - no procfs
        return 0
    return sum(n.strip() == "gloo_tcp_loop" for n in names)


def _exit_with_parent(parent_pid: int) -> None:
    """Workers are not daemonic (Megatron's checkpoint writer forks children), so they must notice
    a parent that died without closing the pool and exit instead of lingering."""
    import threading

    def watch():
        while True:
            time.sleep(2.0)
            try:
                os.kill(parent_pid, 0)  # the pool's owner (a forkserver is our OS parent)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="pool-parent-watch").start()


def _worker_main(
    rank,
    world_size,
    port,
    sys_path,
    ranks_per_node,
    gloo_timeout_s,
    task_q,
    result_q,
    parent_pid,
    parent_env,
):
    _exit_with_parent(parent_pid)
    # The forkserver's environment is from when it started; use the pool owner's current one.
    os.environ.clear()
    os.environ.update(parent_env)
    sys.path[:] = list(dict.fromkeys(list(sys_path) + sys.path))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        **_node_env(rank, world_size, ranks_per_node),
    )
    # Connect gloo pairs on first use: Megatron creates dozens of groups per initialisation and
    # eager full-mesh connection set-up dominates multi-rank test time on a small machine.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=gloo_timeout_s),
    )
    from megatron_video.compat import ensure_cpu_mode

    ensure_cpu_mode()
    result_q.put(("ready", rank, True, None, 0))
    while True:
        msg = task_q.get()
        if msg is None:
            break
        task_id, fn, args, kwargs, rpn, breakage = msg
        os.environ.update(_node_env(rank, world_size, rpn))
        try:
            with broken(breakage):  # the mutation check's breakage of the calling test, if any
                out = fn(*args, **kwargs)
            # Fail here, not in the queue's feeder thread (whose errors would never reach the
            # parent, which would then wait for the timeout), when a result cannot be pickled.
            ForkingPickler.dumps(out)
            msg = (task_id, rank, True, out)
        except BaseException:  # report everything, including assertion errors
            msg = (task_id, rank, False, traceback.format_exc())
        _reset_rank_state()
        result_q.put(msg + (_gloo_loop_threads(),))
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover
        pass


class WorkerPool:
    """``world_size`` gloo ranks on this machine; ``ranks_per_node`` simulates nodes."""

    max_loop_threads = 8  # restart the workers when one holds more (``_gloo_loop_threads``)

    def __init__(
        self,
        world_size: int,
        ranks_per_node: Optional[int] = None,
        timeout: float = 240.0,
        gloo_timeout: float = 60.0,
    ):
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be >= 1")
        if ranks_per_node is not None and (ranks_per_node < 1 or world_size % ranks_per_node):
            raise ValueError(
                f"ranks_per_node ({ranks_per_node}) must be >= 1 and divide world_size ({world_size})"
            )
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.timeout = timeout
        self.gloo_timeout = gloo_timeout
        self._procs: List[Any] = []
        self._loop_threads = 0  # the most gloo loop threads a worker reported since its start
        self._task_qs: List[Any] = []
        self._result_q = None
        self._ids = itertools.count()

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        # the ranks import Megatron: a process that refuses it (env_split.py) refuses the pool
        importlib.util.find_spec("megatron")
        # forkserver with torch + megatron preloaded: workers fork from a process that already
        # imported them (seconds saved per worker); the server itself has started no threads.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "megatron_video.testing.quiet_workers",  # first: before Megatron's import warnings
                "torch",
                "torch.distributed",
                "megatron.core.parallel_state",
                "megatron_video.parallel",
            ]
        )
        port = _free_port()
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(
                    r,
                    self.world_size,
                    port,
                    list(sys.path),
                    self.ranks_per_node,
                    self.gloo_timeout,
                    self._task_qs[r],
                    self._result_q,
                    os.getpid(),
                    dict(os.environ),
                ),
                daemon=False,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.close)
        self._collect("ready", what="start-up")

    def close(self) -> None:
        for q in self._task_qs:
            try:
                q.put(None)
            except Exception:  # pragma: no cover
                pass
        deadline = time.time() + 3
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout=max(0.1, deadline - time.time()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._task_qs, self._result_q = [], [], None
        self._loop_threads = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- running ---------------------------------------------------------------------------
    def _collect(self, task_id, what: str):
        results: dict = {}
        errors: dict = {}
        deadline = time.time() + self.timeout
        grace_deadline = None
        while len(results) + len(errors) < self.world_size:
            now = time.time()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                tid, rank, ok, payload, loops = self._result_q.get(timeout=min(1.0, limit - now))
            except queue_mod.Empty:
                dead = [
                    r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results
                ]
                for r in dead:
                    errors.setdefault(
                        r, f"rank {r} process died (exit code {self._procs[r].exitcode})"
                    )
                if dead and grace_deadline is None:
                    grace_deadline = time.time() + 5.0
                continue
            if tid != task_id:
                continue  # stale message from a killed earlier run
            self._loop_threads = max(self._loop_threads, loops)
            if ok:
                results[rank] = payload
            else:
                errors[rank] = payload
                if grace_deadline is None:
                    # Give the other ranks a moment to finish or fail, then stop waiting for them.
                    grace_deadline = time.time() + 10.0
        missing = [r for r in range(self.world_size) if r not in results and r not in errors]
        if errors or missing:
            self._kill()
            parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
            if missing:
                parts.append(
                    f"ranks {missing} did not finish {what} within the timeout "
                    f"({self.timeout:.0f} s) or after another rank failed; pool killed"
                )
            raise RankError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(parts))
        if self._loop_threads > self.max_loop_threads:
            self.close()  # restarted on the next run, without the idle threads
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, ranks_per_node: Optional[int] = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._procs:
            self._start()
        rpn = ranks_per_node if ranks_per_node is not None else self.ranks_per_node
        if rpn is not None and self.world_size % rpn:
            raise ValueError(f"ranks_per_node ({rpn}) must divide world_size ({self.world_size})")
        task_id = next(self._ids)
        for q in self._task_qs:
            q.put((task_id, fn, args, kwargs, rpn, os.environ.get(MUTATION_ENV)))
        return self._collect(task_id, what=getattr(fn, "__qualname__", str(fn)))
