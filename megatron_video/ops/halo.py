"""Fused halo scatter and its inverse: pure data movement of every SP rank's raw-frame window in
one pass (C++ when built; pure-PyTorch references, equal bit for bit, any dtype). The windows come
from ``layouts.vae_halo`` (``window_tensors``). Design: docs/architecture.md, "Capabilities" 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ._backend import extension_for

LAYOUTS = ("bcthw", "btchw")


@dataclass(frozen=True)
class PackedWindows:
    """Every rank's window in one flat buffer: rank ``p`` is ``buffer[offsets[p]:offsets[p]+sizes[p]]``
    with shape ``shapes[p]``. ``offsets``/``sizes`` count elements (int64, CPU)."""

    buffer: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]

    def window(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s window as a view of the buffer."""
        start, size = int(self.offsets[rank]), int(self.sizes[rank])
        return self.buffer.narrow(0, start, size).view(self.shapes[rank])


def _time_dim(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout ({layout!r}) must be one of {LAYOUTS}")
    return 2 if layout == "bcthw" else 1


def _check_5d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 5:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} ({shape}) must be a 5-D tensor in the given layout")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} (requires_grad=True) must not need gradients: halo ops are data "
            "movement without autograd (use torch.no_grad() or .detach())"
        )


def _windows_tensor(windows, num_frames: int) -> torch.Tensor:
    w = torch.as_tensor(windows).detach().cpu()
    if (
        w.dim() != 2
        or w.shape[1] != 2
        or w.shape[0] < 1
        or w.dtype.is_floating_point
        or w.dtype == torch.bool
    ):
        raise ValueError(
            f"windows (shape {tuple(w.shape)}, {w.dtype}) must be P >= 1 integer "
            "[start, end) pairs, shape [P, 2]"
        )
    w = w.to(torch.int64).contiguous()
    for p, (s, e) in enumerate(w.tolist()):
        if not 0 <= s < e <= num_frames:
            raise ValueError(
                f"windows[{p}] ([{s}, {e})) must satisfy 0 <= start < end <= T ({num_frames})"
            )
    return w


def _window_shape(video: torch.Tensor, tdim: int, frames: int) -> tuple[int, ...]:
    shape = list(video.shape)
    shape[tdim] = frames
    return tuple(shape)


def halo_scatter(video: torch.Tensor, windows, layout: str = "bcthw") -> PackedWindows:
    """Pack rank ``p``'s frames ``[windows[p, 0], windows[p, 1])`` of ``video`` for all ranks (the
    windows overlap by the left halo) into one flat send buffer.

    Layouts: ``"bcthw"`` (``[B, C, T, H, W]``) and ``"btchw"`` (``[B, T, C, H, W]``); each window
    keeps the layout of its input. No autograd (data loading and inference): inputs that require
    grad are rejected here and in ``halo_gather``, so the two paths behave alike.

    ``windows``: ``[P, 2]`` integers (a CUDA tensor is copied to the host: sizes are needed there).
    A non-contiguous ``video`` is made contiguous first.
    """
    tdim = _time_dim(layout)
    _check_5d("video", video)
    w = _windows_tensor(windows, video.shape[tdim])
    ext = extension_for(video.device)
    if ext is None:
        return halo_scatter_reference(video, w, layout)
    x = video.contiguous()
    frames = x.shape[tdim]
    outer = math.prod(x.shape[:tdim])
    inner = math.prod(x.shape[tdim + 1 :])
    buffer, offsets, sizes = ext.halo_scatter(x.view(outer, frames, inner), w)
    shapes = tuple(_window_shape(x, tdim, e - s) for s, e in w.tolist())
    return PackedWindows(buffer, offsets, sizes, shapes)


def halo_scatter_reference(video: torch.Tensor, windows, layout: str = "bcthw") -> PackedWindows:
    """Pure-PyTorch ``halo_scatter``: narrow, flatten and concatenate."""
    tdim = _time_dim(layout)
    _check_5d("video", video)
    w = _windows_tensor(windows, video.shape[tdim])
    parts = [video.narrow(tdim, s, e - s).reshape(-1) for s, e in w.tolist()]
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    shapes = tuple(_window_shape(video, tdim, e - s) for s, e in w.tolist())
    return PackedWindows(torch.cat(parts), offsets, sizes, shapes)


def _check_gather(latents: Sequence[torch.Tensor], drop, tdim: int) -> list[int]:
    if isinstance(latents, torch.Tensor) or len(latents) < 1:
        raise ValueError("latents must be a non-empty sequence of per-rank 5-D tensors")
    for p, t in enumerate(latents):
        _check_5d(f"latents[{p}]", t)
    first = latents[0]
    for p, t in enumerate(latents):
        if (
            _window_shape(t, tdim, 0) != _window_shape(first, tdim, 0)
            or t.dtype != first.dtype
            or t.device != first.device
        ):
            raise ValueError(
                f"latents[{p}] ({tuple(t.shape)}, {t.dtype}, {t.device}) must match latents[0] "
                f"({tuple(first.shape)}, {first.dtype}, {first.device}) except in frames"
            )
    d = torch.as_tensor(drop).detach().cpu()
    if (
        d.dim() != 1
        or d.numel() != len(latents)
        or d.dtype.is_floating_point
        or d.dtype == torch.bool
    ):
        raise ValueError(
            f"drop (shape {tuple(d.shape)}, {d.dtype}) must hold one integer per rank "
            f"({len(latents)})"
        )
    drops = d.tolist()
    for p, (t, dp) in enumerate(zip(latents, drops)):
        if not 0 <= dp <= t.shape[tdim]:
            raise ValueError(
                f"drop[{p}] ({dp}) must be in [0, frames of latents[{p}] ({t.shape[tdim]})]"
            )
    return drops


def halo_gather(latents: Sequence[torch.Tensor], drop, layout: str = "bcthw") -> torch.Tensor:
    """Drop rank ``p``'s leading ``drop[p]`` latents and concatenate the rest over time, in rank order."""
    tdim = _time_dim(layout)
    drops = _check_gather(latents, drop, tdim)
    first = latents[0]
    ext = extension_for(first.device)
    if ext is None:
        return halo_gather_reference(latents, drops, layout)
    outer = math.prod(first.shape[:tdim])
    inner = math.prod(first.shape[tdim + 1 :])
    parts = [t.contiguous().view(outer, t.shape[tdim], inner) for t in latents]
    out = ext.halo_gather(parts, torch.tensor(drops, dtype=torch.int64))
    kept = sum(t.shape[tdim] - dp for t, dp in zip(latents, drops))
    return out.view(_window_shape(first, tdim, kept))


def halo_gather_reference(
    latents: Sequence[torch.Tensor], drop, layout: str = "bcthw"
) -> torch.Tensor:
    """Pure-PyTorch ``halo_gather``: narrow and concatenate."""
    tdim = _time_dim(layout)
    drops = _check_gather(latents, drop, tdim)
    kept = [t.narrow(tdim, dp, t.shape[tdim] - dp) for t, dp in zip(latents, drops)]
    return torch.cat(kept, dim=tdim)


def halo_gather_packed(
    buffer: torch.Tensor, shapes: Sequence[Sequence[int]], drop, layout: str = "bcthw"
) -> torch.Tensor:
    """``halo_gather`` for ranks packed back to back in one flat ``buffer`` (rank ``p`` has ``shapes[p]``)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1:
        raise ValueError(
            f"buffer ({getattr(buffer, 'shape', type(buffer).__name__)}) must be a 1-D tensor"
        )
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) != buffer.numel():
        raise ValueError(
            f"buffer ({buffer.numel()} elements) must hold exactly the ranks' shapes "
            f"({sum(sizes)} elements)"
        )
    views = [part.view(tuple(s)) for part, s in zip(buffer.split(sizes), shapes)]
    return halo_gather(views, drop, layout)
