"""Chooses, per call, between the compiled kernels (``megatron_video._C``) and the references, by
``MEGATRON_VIDEO_OPS`` (``mode``: ``auto`` / ``reference`` / ``extension``, read on every call).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

ENV_VAR = "MEGATRON_VIDEO_OPS"
MODES = ("auto", "reference", "extension")


def mode() -> str:
    """``MEGATRON_VIDEO_OPS`` (read on every call, so tests can switch it):

    ``auto`` (default)  the extension when it is importable and supports the tensor's device, else
                        the reference (one warning per process says why);
    ``reference``       always the pure-PyTorch reference;
    ``extension``       always the extension; raises ``RuntimeError`` when it cannot run.
    """
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR} ({value!r}) must be one of {MODES}")
    return value


@functools.lru_cache(maxsize=None)
def _load():
    """Imports the extension once; returns (module or None, reason it is missing)."""
    try:
        return importlib.import_module("megatron_video._C"), ""
    except ImportError as exc:  # not built, or built against another torch
        return None, f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    # Cached on the message: one warning per process and cause, however many calls fall back.
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def extension_for(device: torch.device):
    """The extension module to run an op on ``device``, or ``None`` for the reference."""
    chosen = mode()
    if chosen == "reference":
        return None
    ext, reason = _load()
    if ext is None:
        if chosen == "extension":
            raise RuntimeError(
                f"{ENV_VAR}=extension but megatron_video._C cannot be imported ({reason})"
            )
        _warn_once(
            f"megatron_video._C is not available ({reason}); megatron_video.ops runs the "
            "pure-PyTorch references (build it with `pip install --no-build-isolation -e .`)"
        )
        return None
    supported = device.type == "cpu" or (device.type == "cuda" and ext.has_cuda())
    if not supported:
        if chosen == "extension":
            raise RuntimeError(
                f"{ENV_VAR}=extension but megatron_video._C has no kernels for device "
                f"{device} (CUDA kernels built: {ext.has_cuda()})"
            )
        _warn_once(
            f"megatron_video._C has no kernels for device type {device.type!r}; "
            "megatron_video.ops runs the pure-PyTorch references there"
        )
        return None
    return ext


def active_backend(device: torch.device | str = "cpu") -> str:
    """``"extension"`` or ``"reference"``: what an op on ``device`` runs now."""
    return "reference" if extension_for(torch.device(device)) is None else "extension"
