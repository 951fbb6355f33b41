"""CPU mode: the one place megatron_video patches Megatron-Core, and only when no GPU is present
and only when asked (:func:`ensure_cpu_mode`, idempotent). Design: docs/architecture.md,
"CPU mode"; what is patched and why is listed below and in ``MODULES_USING_CUDA`` /
``FUNCTION_PATCHES``.
"""

from __future__ import annotations

# Megatron-Core assumes CUDA in a few places that the CPU tests and the embedded-default job need.
# :func:`ensure_cpu_mode` (idempotent) makes them work on CPU when ``torch.cuda.is_available()`` is
# False, and does nothing on a GPU. It is entered only explicitly: by calling it (the test worker
# pool does, and a stock Megatron job on a CPU does), or with ``megatron-video train/demo --cpu``;
# nothing in the package enters it behind the caller's back, and the trainer refuses to run on a
# machine without CUDA unless it is active (docs/architecture.md, "CPU mode"). On activation it logs
# (logger ``megatron_video.compat``) one WARNING line with the number of attributes it changed, and
# the list of them at DEBUG (also :func:`applied_patches`). The real ``torch`` module is never
# modified, the user's global CPU generator is not reseeded (see 4.) and no Megatron warning is
# silenced (see 3. for the one log record dropped, which is named in the log). Every patch is a
# module attribute of Megatron:
#
# 1. ``torch`` -> :data:`~megatron_video.compat.cpu_torch.CPU_TORCH` in the modules of
#    :data:`MODULES_USING_CUDA` (reason per module there). Inside them
#    ``torch.cuda.current_device()`` is the CPU, ``device="cuda"`` factories allocate on CPU,
#    ``synchronize``/``empty_cache`` are no-ops and ``torch.cuda``'s RNG functions act on the CPU
#    generator. This covers the CUDA RNG tracker (``model_parallel_cuda_manual_seed`` seeds the CPU
#    generator, as the device generator on a CPU is the CPU one), DDP grad buffers, pipeline P2P
#    receive buffers, the optimizer's ``device="cuda"`` scalars, grad-norm accumulators and
#    ``torch.cuda.synchronize`` in ``dist_checkpointing``.
# 2. Functions in :data:`FUNCTION_PATCHES` replaced by :mod:`~megatron_video.compat.cpu_functions`,
#    where (1) cannot help: RNG state get/set (the original defers through
#    ``torch.cuda._lazy_call``, which never runs without a GPU), ``clip_grad_by_total_norm_fp32``
#    (asserts the tensor *type* ``torch.cuda.FloatTensor``) and RoPE's
#    ``get_pos_emb_on_this_cp_rank`` with CP > 1 (``pin_memory`` + ``.cuda()``). A replacement is
#    installed only if the original has the same parameter names (a changed Megatron API is skipped
#    with a warning, not mis-called).
# 3. A logging filter on ``megatron.core.tensor_parallel.random`` that drops "CPU RNG state changed
#    within GPU RNG context": on CPU the forked generator *is* the CPU one, so it fired on every
#    dropout and said nothing.
# 4. ``model_parallel_cuda_manual_seed`` (in ``megatron.core.tensor_parallel`` and its ``random``
#    module) wrapped so that the CPU generator's state is restored after it: on a GPU it seeds the
#    device generator; on a CPU the "device" generator is the user's global CPU generator, which the
#    unwrapped function would silently reseed. The tracker's streams are seeded as on a GPU.
#
# Not covered (GPU-only by nature): the distributed optimizer (use
# ``use_distributed_optimizer=False``), fusions and ``gradient_accumulation_fusion`` (turn off; see
# ``cpu_transformer_config_kwargs``), CUDA graphs, streams/events (overlapped communication),
# Transformer Engine. ``psutil`` (needed by ``dist_checkpointing`` save) and ``einops``
# (hierarchical CP groups) are pinned dependencies.
import functools
import importlib
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from . import cpu_functions
from .cpu_torch import CPU_TORCH

__all__ = [
    "MODULES_USING_CUDA",
    "FUNCTION_PATCHES",
    "Patch",
    "applied_patches",
    "cpu_mode_active",
    "ensure_cpu_mode",
]

# (module, why its CUDA uses matter on CPU). Missing modules (other Megatron versions) are skipped.
MODULES_USING_CUDA: Tuple[Tuple[str, str], ...] = (
    (
        "megatron.core.tensor_parallel.random",
        "RNG tracker: torch.cuda.get_rng_state / manual_seed in add() and model_parallel_cuda_manual_seed",
    ),
    (
        "megatron.core.tensor_parallel.layers",
        "weights without use_cpu_initialization and sequence-parallel buffers on current_device()",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "sequence-parallel gather / reduce-scatter outputs on current_device()",
    ),
    (
        "megatron.core.utils",
        "GlobalMemoryBuffer (DotProductAttention, sequence parallel) on current_device()",
    ),
    ("megatron.core.transformer.utils", "default causal mask built with device='cuda'"),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "DDP param / grad buffers on current_device(); current_stream() before grad sync (>= 0.19)",
    ),
    ("megatron.core.distributed.distributed_data_parallel", "synchronize / empty_cache"),
    ("megatron.core.optimizer.optimizer", "found_inf / scale tensors with device='cuda'"),
    ("megatron.core.optimizer.clip_grads", "grad-norm and zero-count accumulators on 'cuda'"),
    (
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2P shape / receive buffers on current_device(), synchronize",
    ),
    ("megatron.core.pipeline_parallel.schedules", "token counter with device='cuda'"),
    (
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "inv_freq moved to current_device() on first forward; MultimodalRotaryEmbedding "
        "(M-RoPE, models.qwen_vl) allocates inv_freq on current_device() when built",
    ),
    (
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "synchronize after non-blocking device-to-host copies (save)",
    ),
    (
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "save verification flags on 'cuda' / current_device()",
    ),
    ("megatron.core.dist_checkpointing.strategies.fully_parallel", "synchronize (load / save)"),
    ("megatron.core.dist_checkpointing.tensor_aware_state_dict", "synchronize (load)"),
    ("megatron.core.dist_checkpointing.exchange_utils", "exchange buffers on 'cuda' (load)"),
    (
        "megatron.core.models.multimodal.llava_model",
        "empty sound embeddings on current_device() in LLaVAModel.forward (>= 0.19)",
    ),
)

_RNG = "megatron.core.tensor_parallel.random"
_ROPE = "megatron.core.models.common.embeddings"
# (module, attribute, CPU replacement). Functions imported by name are patched in each importer.
FUNCTION_PATCHES: Tuple[Tuple[str, str, Callable], ...] = (
    (_RNG, "_get_cuda_rng_state", cpu_functions.get_rng_state),
    (_RNG, "_set_cuda_rng_state", cpu_functions.set_rng_state),
    (
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        cpu_functions.clip_grad_by_total_norm_fp32,
    ),
    (
        "megatron.core.optimizer.optimizer",
        "clip_grad_by_total_norm_fp32",
        cpu_functions.clip_grad_by_total_norm_fp32,
    ),
    (
        f"{_ROPE}.rope_utils",
        "get_pos_emb_on_this_cp_rank",
        cpu_functions.get_pos_emb_on_this_cp_rank,
    ),
    (
        f"{_ROPE}.rotary_pos_embedding",
        "get_pos_emb_on_this_cp_rank",
        cpu_functions.get_pos_emb_on_this_cp_rank,
    ),
    (
        f"{_ROPE}.yarn_rotary_pos_embedding",
        "get_pos_emb_on_this_cp_rank",
        cpu_functions.get_pos_emb_on_this_cp_rank,
    ),
)

# Wrapped (arguments passed through unchanged) so that they leave the CPU generator as they found it.
SEEDING_FUNCTIONS: Tuple[Tuple[str, str], ...] = (
    (_RNG, "model_parallel_cuda_manual_seed"),
    ("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed"),
)

_FORK_WARNING = "CPU RNG state changed within GPU RNG context"
_LOG = logging.getLogger("megatron_video.compat")


@dataclass(frozen=True)
class Patch:
    """One applied patch: ``module.attribute`` now refers to ``replacement``."""

    module: str
    attribute: str
    replacement: str


_applied: List[Patch] = []
_active = False


def cpu_mode_active() -> bool:
    """Whether CPU mode has been activated in this process."""
    return _active


def applied_patches() -> Tuple[Patch, ...]:
    """The patches CPU mode applied in this process (empty when inactive)."""
    return tuple(_applied)


def ensure_cpu_mode() -> bool:
    """Activate CPU mode if CUDA is unavailable (idempotent); return whether it is active."""
    return _activate(cuda_available=torch.cuda.is_available())


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FORK_WARNING not in record.getMessage()


def _same_parameters(original, replacement) -> bool:
    try:
        return list(inspect.signature(original).parameters) == list(
            inspect.signature(replacement).parameters
        )
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return False


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:  # a module this Megatron version does not have
        return None


def _keep_cpu_generator(fn):
    """``fn`` that restores the global CPU generator's state when it returns (see 4. above)."""
    if getattr(fn, "_megatron_video_keeps_cpu_generator", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    wrapper._megatron_video_keeps_cpu_generator = True
    return wrapper


def _activate(cuda_available: bool) -> bool:
    """Apply the patches unless ``cuda_available``; split out so tests can pass the flag."""
    global _active
    if cuda_available:
        return False
    if _active:
        return True
    for name, _why in MODULES_USING_CUDA:
        module = _import(name)
        if module is not None and getattr(module, "torch", None) is torch:
            module.torch = CPU_TORCH
            _applied.append(Patch(name, "torch", "compat.cpu_torch.CPU_TORCH"))
    for name, attr, replacement in FUNCTION_PATCHES:
        module = _import(name)
        original = getattr(module, attr, None) if module is not None else None
        if original is None:
            continue
        if not _same_parameters(original, replacement):
            warnings.warn(
                f"CPU mode: {name}.{attr} has an unexpected signature; not patched", stacklevel=2
            )
            continue
        setattr(module, attr, replacement)
        _applied.append(Patch(name, attr, f"compat.cpu_functions.{replacement.__name__}"))
    for name, attr in SEEDING_FUNCTIONS:
        module = _import(name)
        original = getattr(module, attr, None) if module is not None else None
        if original is None:
            continue
        setattr(module, attr, _keep_cpu_generator(original))
        _applied.append(Patch(name, attr, "compat.cpu_mode._keep_cpu_generator(original)"))
    logging.getLogger(_RNG).addFilter(_DropForkWarning())
    _active = True
    _LOG.warning(
        "megatron_video CPU mode (no CUDA device): %d Megatron attributes replaced (listed at DEBUG "
        "level of this logger and by compat.cpu_mode.applied_patches()); log records %r of logger %s "
        "are dropped (on CPU the forked generator is the CPU one)",
        len(_applied),
        _FORK_WARNING,
        _RNG,
    )
    _LOG.debug(
        "megatron_video CPU mode replaced: %s",
        ", ".join(f"{p.module}.{p.attribute} -> {p.replacement}" for p in _applied),
    )
    return True
