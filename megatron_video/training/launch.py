"""Start a training job: N local CPU ranks with gloo (``--nproc``), or this process under torchrun.

``--nproc N`` simulates nodes of ``ranks_per_node`` (``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` /
``GROUP_RANK`` as torchrun sets them, which the U x R placement rules read); workers fork from a
server that preloaded torch and Megatron; a watchdog ends the job when a rank dies or stalls
(``launch``; docs/reliability.md). Only rank 0 (the logging rank) writes to the console; every other rank's
stdout / stderr go to ``<output>/logs/rank<N>.log`` (torchrun's ``--log-dir`` / ``--redirects``
convention). Under ``torchrun`` this process is one rank.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Callable, Optional, Tuple

import torch.multiprocessing as mp

from .config import Config, validate
from .families import get_family

__all__ = ["under_torchrun", "launch", "rank_log"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Frames in these files mean "waiting on other ranks" (a blocked collective or P2P wait).
_COMM_FILES = (
    os.sep + os.path.join("torch", "distributed") + os.sep,
    os.path.join("megatron_video", "parallel", "comm") + os.sep,
    os.path.join("megatron", "core", "pipeline_parallel", "p2p_communication.py"),
)


def _waiting_in_comm(frame) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMM_FILES):
            return True
        frame = frame.f_back
    return False


class _Heartbeat:
    """This rank's slots in the launcher's shared array: ``[step, time of the last beat, waiting in
    communication (0/1)]``; the trainer beats after start-up and resume, as each step starts, and
    around saves and sampling. A daemon thread refreshes the third slot every 0.25 s by
    looking at the main thread's stack, so the launcher can tell a rank that computes (or hangs)
    from one that waits for it."""

    def __init__(self, shared, rank: int):
        import threading

        self.shared, self.base = shared, 3 * rank
        self.main = threading.main_thread().ident
        threading.Thread(target=self._watch, daemon=True, name="megatron-video-heartbeat").start()

    def __call__(self, step: int) -> None:
        self.shared[self.base] = float(step)
        self.shared[self.base + 1] = time.time()

    def _watch(self) -> None:
        while True:
            frame = sys._current_frames().get(self.main)
            self.shared[self.base + 2] = 1.0 if _waiting_in_comm(frame) else 0.0
            time.sleep(0.25)


def rank_log(config: Config, rank: int) -> str:
    """Where a rank other than the console one writes its output."""
    return os.path.join(config.output, "logs", f"rank{rank}.log")


def _redirect_output(path: str) -> None:
    """This process's stdout and stderr (descriptors 1 and 2: native code too) -> ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# Megatron's warnings for a missing Transformer Engine / Apex (expected on CPU): the launcher's own
# imports show them once on the console. The forkserver that preloads Megatron, and helpers the
# ranks spawn (Megatron's async checkpoint writer starts a spawned manager that re-imports
# Megatron), start with these filters, so they repeat nothing; each rank drops them again, so its
# own warnings still reach its log.
_REPEATED_WARNINGS = (
    "ignore:Transformer Engine and Apex are not installed",
    "ignore:Apex is not installed",
)


def _quiet_children_env() -> str:
    """``PYTHONWARNINGS`` for processes started from here (the user's own entries kept first)."""
    own = os.environ.get("PYTHONWARNINGS", "")
    return ",".join([w for w in own.split(",") if w] + list(_REPEATED_WARNINGS))


def _show_own_warnings() -> None:
    """Undo, in this rank, the ``_REPEATED_WARNINGS`` filters it inherited from the forkserver
    (a ``default`` filter in front wins): what the rank itself warns reaches its log."""
    import warnings

    for w in _REPEATED_WARNINGS:
        warnings.filterwarnings("default", message=w.split(":", 1)[1])


def _worker(
    rank: int,
    world: int,
    port: int,
    ranks_per_node: int,
    threads: int,
    config: Config,
    shared,
    target: Optional[Callable],
    cpu: bool,
) -> None:
    os.setpgid(0, 0)  # own process group: the launcher can end this rank and any helper it forked
    if rank != 0:  # rank 0 logs (trainer.is_logger); the others write to files
        _redirect_output(rank_log(config, rank))
    _show_own_warnings()
    if rank == 0:  # the console: known environment warnings stay held back (console.py)
        from .console import quiet_known_warnings

        quiet_known_warnings()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        GROUP_RANK=str(rank // ranks_per_node),
        OMP_NUM_THREADS=str(threads),
    )
    import torch

    torch.set_num_threads(threads)
    if cpu:  # explicit CPU mode (`--cpu`), entered before anything builds Megatron objects
        from megatron_video.compat import ensure_cpu_mode

        ensure_cpu_mode()
    if target is None:
        from .trainer import train as target

    target(config, heartbeat=_Heartbeat(shared, rank))


def _kill_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell reports


def _watch(procs, shared, timeout: float) -> Tuple[int, str]:
    """Wait for the ranks; ``(0, "")`` when all succeeded, else ``(exit status, reason)`` for the
    first rank that failed, or the rank(s) that hung: after start-up, no rank beat for ``timeout``
    seconds, and the culprits are the ranks not waiting in communication (all, if every rank waits)."""
    n = len(procs)

    def progress():
        return [shared[3 * r + k] for r in range(n) for k in (0, 1)]

    # Armed once every rank finished start-up (its first beat): start-up time varies with the
    # machine and the model; a start-up that hangs ends through the process group's timeout.
    last_progress, seen = time.time(), progress()
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            # the first to die is the cause; peers that lost it fail right after with an error
            signalled = [r for r in failed if procs[r].exitcode < 0]
            r = (signalled or failed)[0]
            step = int(shared[3 * r])
            where = f"at step {step}" if step >= 0 else "before the first step"
            return (
                _exit_status(procs[r].exitcode),
                f"rank {r} exited with code {procs[r].exitcode} {where}",
            )
        now = progress()
        armed = all(shared[3 * r + 1] > 0 for r in range(n))
        if now != seen or not armed:
            seen, last_progress = now, time.time()
        elif time.time() - last_progress > timeout:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            busy = [r for r in alive if not shared[3 * r + 2]] or alive
            steps = sorted({int(shared[3 * r]) for r in busy})
            return (
                1,
                f"rank(s) {busy} made no progress for {timeout:g} s (train.rank_timeout_s) at "
                f"step {steps[0] if len(steps) == 1 else steps} while rank(s) "
                f"{[r for r in alive if r not in busy]} waited for them",
            )
        time.sleep(0.2)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        return _exit_status(bad[0][1]), f"rank {bad[0][0]} exited with code {bad[0][1]}"
    return 0, ""


def _start_ranks(config: Config, nproc: int, ranks_per_node: int, target, cpu: bool):
    """Start the ``nproc`` rank processes (forked from a preloaded forkserver); returns them and
    the shared array of their progress that the watchdog reads."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    port = _free_port()
    # Ranks fork from a server that imported torch / Megatron once (a fresh import per rank costs
    # seconds each); the server itself never touches CUDA, so forking stays safe on GPUs.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "megatron.core.parallel_state",
            "megatron_video.training.trainer",
        ]
    )
    shared = ctx.Array("d", [-1.0, 0.0, 0.0] * nproc, lock=False)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nproc, port, ranks_per_node, threads, config, shared, target, cpu),
            daemon=False,
        )
        for r in range(nproc)
    ]
    print(
        f"[megatron-video] {nproc} ranks; rank 0 logs here, ranks 1-{nproc - 1} to "
        f"{os.path.dirname(rank_log(config, 0))}/rank<N>.log",
        file=sys.stderr,
        flush=True,
    )
    saved_env = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = _quiet_children_env()  # the forkserver and the ranks inherit it
    try:
        for p in procs:
            p.start()
    finally:
        if saved_env is None:
            os.environ.pop("PYTHONWARNINGS")
        else:
            os.environ["PYTHONWARNINGS"] = saved_env
    return procs, shared


def launch(
    config: Config,
    nproc: int,
    ranks_per_node: Optional[int] = None,
    target: Optional[Callable] = None,
    cpu: bool = False,
) -> int:
    """Run ``config`` on ``nproc`` local ranks; returns the exit code (0 = success).

    ``cpu``: every rank enters CPU mode (``megatron_video.compat.ensure_cpu_mode``) first.

    ``target(config, heartbeat=...)`` runs on every rank (default: ``trainer.train``). If a rank
    dies, or no rank makes progress for ``config.train.rank_timeout_s`` seconds, every rank (and
    anything it forked) is killed, the rank and the step are named on stderr and the exit code is
    non-zero (docs/reliability.md).

    Workers are not daemonic (Megatron's checkpoint writer forks helpers); each rank runs in its
    own process group and reports the step it starts in a shared array, which the watchdog
    reads."""
    if ranks_per_node is None:
        ranks_per_node = config.parallel.ranks_per_node or nproc
    import torch

    # again here (launch() is also a library entry), with this machine's device rules
    validate(config, nproc, torch.cuda.is_available())
    if nproc % ranks_per_node:
        raise ValueError(f"--ranks-per-node ({ranks_per_node}) must divide --nproc ({nproc})")
    from .vae_stage import ensure_vae

    if get_family(config.model.family).needs_vae:
        ensure_vae(config, progress=config.train.progress)  # once, before the ranks start
    if nproc == 1 and target is None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        from .trainer import train

        train(config, cpu=cpu)
        return 0
    procs, shared = _start_ranks(config, nproc, ranks_per_node, target, cpu)
    code, reason = 1, ""
    try:
        code, reason = _watch(procs, shared, config.train.rank_timeout_s)
    except KeyboardInterrupt:
        code, reason = 130, "interrupted"
    finally:
        for p in procs:
            if p.is_alive() or code:
                _kill_group(p)
        for p in procs:
            p.join(timeout=30)
    if code:
        print(
            f"[megatron-video] {reason}; stopped all ranks (exit status {code}); the "
            f"other ranks' output: {os.path.dirname(rank_log(config, 0))}/rank<N>.log",
            file=sys.stderr,
            flush=True,
        )
    return code
