"""Test tier only: run Megatron-LM's real ``megatron.training.pretrain()`` on CPU ranks (gloo).

``megatron.training`` (shipped by the megatron-core 0.19 wheel) assumes CUDA in the places below;
:func:`apply` fakes exactly those (plus one test-time cost, the checkpoint writer's spawned
Manager), for the real-``pretrain()`` tests (tests/test_pretrain_real.py,
docs/launch.md). Users on GPUs never load this module; ``compat.cpu_mode`` (which covers
megatron.core) is not extended by it. Each patch names the Megatron file and the assumption, is
applied only where that attribute exists (feature detection, no version numbers) and is listed by
:func:`applied`. Run as a script it applies them and runs the entry script under it::

    torchrun --nproc-per-node 4 megatron_video/testing/megatron_training_cpu.py \\
        examples/pretrain_video_dit.py <the documented flags> --cpu ...

The Megatron bug that bites GPU users too (``core/datasets/utils.py`` running ``make`` for the
helper the wheel already ships) is worked around in the entry itself, for everyone
(``training.megatron_lm.skip_shipped_helper_build``), not here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import runpy
import sys
from typing import List, Tuple

import torch

from megatron_video.compat.checkpoint_writer import use_thread_results_queue
from megatron_video.compat.cpu_torch import _CPU_STREAM, CpuCuda, CpuTorch

__all__ = ["apply", "applied"]

_APPLIED: List[Tuple[str, str]] = []


class _TrainingCuda(CpuCuda):
    """``torch.cuda`` as the patched ``megatron.training`` modules see it on a CPU."""

    @staticmethod
    def Stream(*args, **kwargs):  # training.py: a side stream for DDP set-up
        return _CPU_STREAM

    @staticmethod
    def stream(s=None):
        return contextlib.nullcontext()

    @staticmethod
    def device_count():  # initialize.py: `device_count() > 0` gates model-parallel set-up / seeds
        return 1

    @staticmethod
    def set_device(device):
        """One CPU: nothing to select."""

    @staticmethod
    def memory_allocated(*a, **k):  # memory reports (training_log, report_memory)
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = memory_allocated


class _TrainingTorch(CpuTorch):
    def __init__(self):
        super().__init__()
        self.cuda = _TrainingCuda()


_TORCH = _TrainingTorch()

# (module, what in it assumes CUDA). Its module-level name ``torch`` becomes the CPU view:
# ``device='cuda'`` factories allocate on CPU, ``current_device()`` is the CPU, synchronize /
# streams / memory stats are no-ops, the CUDA RNG state is the CPU generator's.
_TORCH_MODULES = (
    (
        "megatron.training.initialize",
        "device_count() > 0 gates (set-up of model parallel, seeding); JIT warm-up on 'cuda'",
    ),
    (
        "megatron.training.training",
        "device='cuda' flags / loss accumulators, torch.cuda.Stream, model.cuda(current_device())",
    ),
    ("megatron.training.checkpointing", "iteration all-reduce on 'cuda'; CUDA RNG state save/load"),
    ("megatron.training.utils.common_utils", "current_device() / 'cuda' norms and reductions"),
    ("megatron.training.utils", "current_device() / 'cuda' reductions (older layout)"),
    ("megatron.core.timers", "torch.cuda.synchronize, current_device() for the timer all-gather"),
    ("megatron.core.rerun_state_machine", "'cuda' tensors, current_device(), CUDA RNG state"),
)


def _note(where: str, what: str) -> None:
    _APPLIED.append((where, what))


def _no_cuda_init(initialize_megatron):
    """initialize.py asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``; pretrain()
    never passes it."""

    @functools.wraps(initialize_megatron)
    def wrapper(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return wrapper


def _no_warmup(*args, **kwargs) -> None:
    """No fused GPU kernels to warm up on a CPU (see :func:`apply`)."""


def apply() -> List[Tuple[str, str]]:
    """Apply the patches (idempotent); returns ``(module.attribute, assumption)`` for each."""
    if _APPLIED:
        return list(_APPLIED)
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_training_cpu fakes CUDA for CPU test runs; this machine has a GPU"
        )
    from megatron_video.compat import ensure_cpu_mode

    ensure_cpu_mode()  # megatron.core's own CPU mode (compat.cpu_mode)
    for name, why in _TORCH_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = _TORCH
            _note(f"{name}.torch", why)
    training = importlib.import_module("megatron.training.training")
    init = getattr(training, "initialize_megatron", None)
    if init is not None and "allow_no_cuda" in inspect.signature(init).parameters:
        training.initialize_megatron = _no_cuda_init(init)
        _note(
            "megatron.training.training.initialize_megatron",
            "initialize.py asserts CUDA (pretrain() never passes allow_no_cuda)",
        )
    initialize = importlib.import_module("megatron.training.initialize")
    if hasattr(initialize, "_warmup_jit_function"):
        # initialize.py warms the fused GPU kernels up on torch.rand(..., device="cuda") tensors,
        # which on a GPU draw from the CUDA generator; on the CPU view they would draw from the CPU
        # generator after seeding and change the weights' initialisation. Nothing to warm on a CPU.
        initialize._warmup_jit_function = _no_warmup
        _note(
            "megatron.training.initialize._warmup_jit_function",
            "JIT warm-up of fused kernels on 'cuda' tensors (CUDA generator)",
        )
    if "--async-save" not in sys.argv and use_thread_results_queue():
        # Not a CUDA assumption but a test-time cost (compat/checkpoint_writer.py): synchronous
        # saves collect the writer's results in a thread queue instead of a spawned Manager.
        _note(
            "megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue",
            "a spawned Manager's queue on the first save (a thread queue: saves are synchronous)",
        )
    arguments = importlib.import_module("megatron.training.arguments")
    if hasattr(arguments, "get_device_arch_version"):
        # arguments.py reads the GPU architecture when TP or CP > 1 (CUDA_DEVICE_MAX_CONNECTIONS
        # rule for Hopper and older); a CPU has none: answer "pre-Blackwell", the strict branch
        arguments.get_device_arch_version = lambda: 0
        _note(
            "megatron.training.arguments.get_device_arch_version",
            "torch.cuda.get_device_properties when TP or CP > 1",
        )
    return list(_APPLIED)


def applied() -> List[Tuple[str, str]]:
    return list(_APPLIED)


def main(argv: List[str]) -> None:
    """``megatron_training_cpu.py SCRIPT ARGS...``: apply the patches, run SCRIPT as __main__;
    ``megatron_training_cpu.py --runs FILE``: the runs FILE lists, one after another (:func:`runs`)."""
    if not argv:
        raise SystemExit("usage: megatron_training_cpu.py SCRIPT [ARGS...] | --runs FILE")
    apply()
    if argv[0] == "--runs":
        runs(argv[1])
        return
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def runs(path: str) -> None:
    """Several launches in one ``torchrun``: FILE is JSON, ``[{"argv": [SCRIPT, ARGS...], "log":
    PREFIX, "port": N, "may_fail": bool}, ...]``. Each rank imports Megatron once, then runs each
    launch in a child it forks (:func:`_forked_run`): every run starts from a fresh process state
    (Megatron's globals, groups, memory) without paying the imports again, and rendezvouses on a
    TCP store of its own (rank 0's child hosts it on ``port``), so no key or connection of an
    earlier run is seen. Each run writes this rank's output to ``PREFIX.rankR``, ending with a line
    ``exit status N``. A run that fails, unless it ``may_fail``, ends the process (torchrun stops
    the other ranks; their children die with them)."""
    import json
    import os

    importlib.import_module("megatron.training.training")  # what every run imports, once
    importlib.import_module("megatron_video.training.megatron_lm")
    rank = os.environ.get("RANK", "0")
    for run in json.loads(open(path).read()):
        log = f"{run['log']}.rank{rank}"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _forked_run(run, log)  # never returns
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status < 0:  # killed by a signal: the child wrote no status line
            with open(log, "a") as f:
                f.write(f"\nexit status {status} (signal {-status})\n")
        if status and not run.get("may_fail"):
            raise SystemExit(1)


def _forked_run(run: dict, log: str) -> None:
    """In the forked child: die with the parent, rendezvous on the run's own store, run the
    launch as ``__main__`` with stdout / stderr in ``log``, exit with its status."""
    import ctypes
    import os
    import signal
    import time
    import traceback

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no child outlives its rank
    os.environ.update(MASTER_PORT=str(run["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    status, t0 = 0, time.time()
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            sys.argv = list(run["argv"])
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        print(f"exit status {status} after {time.time() - t0:.1f} s", flush=True)
        sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
