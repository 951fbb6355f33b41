"""Feature detection for Megatron-Core API differences (0.16 -> 0.19); no version comparisons.

Arguments are checked against the installed Megatron's signatures and dataclass fields, so the same
call works on every version that has the feature. Config helpers hold the known-good CPU settings so
that callers do not repeat them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Tuple

import torch

__all__ = [
    "accepted_kwargs",
    "accepts_var_kwargs",
    "call_with_accepted_kwargs",
    "cpu_optimizer_config_kwargs",
    "cpu_transformer_config_kwargs",
    "device_transformer_config_kwargs",
    "gpu_transformer_config_kwargs",
    "initialize_model_parallel",
]

# Values that mean "feature off": an unknown argument at one of these can be dropped safely.
_NEUTRAL = (None, False, 1)


def _parameter_names(target) -> Tuple[set, bool]:
    """(names ``target`` accepts, whether it takes ``**kwargs``); dataclasses by init fields."""
    if dataclasses.is_dataclass(target):
        return {f.name for f in dataclasses.fields(target) if f.init}, False
    params = inspect.signature(target).parameters.values()
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}, var_kw


def accepts_var_kwargs(fn: Callable) -> bool:
    """Whether ``fn`` takes ``**kwargs`` (newer Megatron passes extra arguments to forwards)."""
    return _parameter_names(fn)[1]


def accepted_kwargs(target, kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split ``kwargs`` into (accepted by ``target``, not accepted); ``target`` a callable or dataclass."""
    names, var_kw = _parameter_names(target)
    if var_kw:
        return dict(kwargs), {}
    return (
        {k: v for k, v in kwargs.items() if k in names},
        {k: v for k, v in kwargs.items() if k not in names},
    )


def _is_neutral(value) -> bool:
    return any(value is n or (type(value) is type(n) and value == n) for n in _NEUTRAL)


def call_with_accepted_kwargs(fn: Callable, *args, **kwargs):
    """Call ``fn`` with the keyword arguments it accepts.

    An argument it does not know is dropped only at a neutral value (None, False, 1: the feature is
    off); otherwise ``ValueError`` names it, since silently ignoring a requested feature is a bug.
    """
    accepted, dropped = accepted_kwargs(fn, kwargs)
    for name, value in dropped.items():
        if not _is_neutral(value):
            raise ValueError(
                f"{name} ({value!r}) is not supported by this megatron-core's "
                f"{getattr(fn, '__qualname__', fn)}; it may only be omitted or None/False/1"
            )
    return fn(*args, **accepted)


def initialize_model_parallel(**kwargs):
    """``parallel_state.initialize_model_parallel`` with the kwargs this Megatron version accepts."""
    from megatron.core import parallel_state as ps

    return call_with_accepted_kwargs(ps.initialize_model_parallel, **kwargs)


# Known-good CPU settings: fp32, CPU initialisation, every CUDA fusion off.
_CPU_TRANSFORMER_CONFIG = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
    bf16=False,
    fp16=False,
)


def cpu_transformer_config_kwargs(**overrides) -> Dict[str, Any]:
    """``TransformerConfig`` kwargs for CPU: the known-good settings plus ``overrides``.

    CPU settings whose field this Megatron version lacks are left out (the feature is absent, so
    there is nothing to turn off); ``overrides`` are passed through unchanged so that a misspelt
    model argument still fails in ``TransformerConfig``.
    """
    from megatron.core.transformer import TransformerConfig

    base, _ = accepted_kwargs(TransformerConfig, _CPU_TRANSFORMER_CONFIG)
    return {**base, **overrides}


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def gpu_transformer_config_kwargs(**overrides) -> Dict[str, Any]:
    """``TransformerConfig`` kwargs for a GPU: weights initialised on the device and the fusions on.

    Fusions that need Transformer Engine or Apex (fused weight-gradient accumulation, fused RoPE,
    persistent layer norm) are enabled only where one of them is importable; the others are plain
    PyTorch / Megatron kernels. Fields this Megatron version lacks are left out.
    """
    from megatron.core.transformer import TransformerConfig

    te_or_apex = _importable("transformer_engine") or _importable("apex")
    gpu = dict(
        use_cpu_initialization=False,
        gradient_accumulation_fusion=te_or_apex,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=True,
        persist_layer_norm=te_or_apex,
        apply_rope_fusion=te_or_apex,
    )
    base, _ = accepted_kwargs(TransformerConfig, gpu)
    return {**base, **overrides}


def device_transformer_config_kwargs(has_gpu: bool, **overrides) -> Dict[str, Any]:
    """The GPU settings when ``has_gpu``, else the CPU ones (``cpu_transformer_config_kwargs``)."""
    if has_gpu:
        return gpu_transformer_config_kwargs(**overrides)
    return cpu_transformer_config_kwargs(**overrides)


def cpu_optimizer_config_kwargs(**overrides) -> Dict[str, Any]:
    """``OptimizerConfig`` kwargs for CPU: fp32, and no distributed optimizer (GPU-only)."""
    from megatron.core.optimizer import OptimizerConfig

    base, _ = accepted_kwargs(
        OptimizerConfig,
        dict(bf16=False, fp16=False, params_dtype=torch.float32, use_distributed_optimizer=False),
    )
    return {**base, **overrides}
