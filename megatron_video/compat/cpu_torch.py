"""A stand-in for the name ``torch`` inside selected Megatron modules, for CPU mode
(``compat.cpu_mode``; docs/architecture.md, "CPU mode"): ``torch.cuda`` on the CPU and CUDA
tensor factories allocating on the CPU; everything else forwarded to the real ``torch``.
"""

from __future__ import annotations

# Megatron-Core allocates buffers with ``device=torch.cuda.current_device()`` or ``device="cuda"``
# and calls ``torch.cuda.synchronize()`` in dozens of places inside large methods (DDP grad buffers,
# pipeline receive buffers, optimizer scalars, checkpoint save/load). Rather than copy those
# methods, CPU mode rebinds the module-level name ``torch`` in the few modules that do this (see
# ``cpu_mode.MODULES_USING_CUDA``) to :data:`CPU_TORCH`. It forwards every attribute to the real
# ``torch`` except:
#
# * ``cuda``: :class:`CpuCuda`, where the current device is the CPU, synchronize / empty_cache do
#   nothing, and the RNG functions act on the CPU default generator (on a CPU the generator that
#   drives dropout *is* the CPU one);
# * tensor factories: a ``device`` naming CUDA becomes ``"cpu"`` and ``pin_memory`` is dropped
#   (pinned host memory only exists to speed up copies to a GPU).
#
# The real ``torch`` module and every other module are untouched. Anything not listed is forwarded,
# so a CUDA feature this does not emulate (streams, events) still fails loudly, as it would without
# it.
import functools
import types

import torch

__all__ = ["CPU_TORCH", "CpuCuda", "CpuTorch", "to_cpu_device"]

# Factories that Megatron calls with a CUDA device (found by grepping megatron/core).
_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand",
    "randn",
    "randint",
)


def to_cpu_device(device):
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, an index, a ``torch.device``) to CPU."""
    if device is None:
        return None
    if isinstance(device, int):  # a bare index means a CUDA ordinal
        return torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" else dev


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    # Only the default CPU generator: torch.manual_seed would also (lazily) seed CUDA generators.
    torch.default_generator.manual_seed(int(seed))


class CpuStream:
    """The one CPU "stream": work runs in order, so every wait is already satisfied."""

    def wait_event(self, event=None):
        """Nothing to wait for."""

    def wait_stream(self, stream=None):
        """Nothing to wait for."""

    def synchronize(self):
        """Nothing to wait for."""


_CPU_STREAM = CpuStream()


class CpuCuda:
    """``torch.cuda`` as seen by a patched Megatron module on a machine without a GPU."""

    random = types.SimpleNamespace(
        get_rng_state=_get_rng_state, set_rng_state=_set_rng_state, manual_seed=_manual_seed
    )
    get_rng_state = staticmethod(_get_rng_state)
    set_rng_state = staticmethod(_set_rng_state)
    manual_seed = staticmethod(_manual_seed)
    manual_seed_all = staticmethod(_manual_seed)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        """CPU work is synchronous; nothing to wait for."""

    @staticmethod
    def empty_cache():
        """No caching allocator on CPU."""

    @staticmethod
    def current_stream(device=None):
        """megatron-core >= 0.19 waits on the current stream before a grad reduction."""
        return _CPU_STREAM

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class CpuTorch(types.ModuleType):
    """The ``torch`` module with :class:`CpuCuda` and CPU tensor factories; all else forwarded."""

    def __init__(self):
        super().__init__("torch", "megatron_video CPU-mode view of torch (see compat.cpu_torch)")
        self.cuda = CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = CpuTorch()
