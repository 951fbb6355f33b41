"""ST-DiT layouts A (frames per rank) and B (spatial positions per rank): pure, rank-explicit index
maps; the communicating transitions live in ``attention.stdit_transitions``. Design:
docs/architecture.md, "Capabilities" 3; the layouts are described on ``layout_a_indices`` and
``layout_b_indices``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..checks import check_positive_int, check_rank
from .geometry import VideoGeometry

__all__ = [
    "VideoGeometry",
    "check_stdit_divisibility",
    "positions_per_rank",
    "padded_positions",
    "frames_per_rank",
    "layout_a_indices",
    "layout_b_indices",
    "layout_a_owner",
    "layout_b_owner",
    "token_thw",
    "image_batch_range",
    "shard_layout_a",
    "shard_layout_b",
    "unshard_layout_a",
]


def check_stdit_divisibility(num_frames: int, cp_size: int, batch_size: int = None) -> None:
    """``ValueError`` unless the sample splits into layout A over ``cp_size`` ranks.

    Videos need ``num_frames % cp_size == 0``; images (``num_frames == 1``) are data-parallel over the
    CP group and need ``batch_size % cp_size == 0`` (checked when ``batch_size`` is given).
    """
    check_positive_int("num_frames", num_frames)
    check_positive_int("cp_size", cp_size)
    if num_frames == 1:
        if batch_size is not None and batch_size % cp_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by cp_size ({cp_size}) for images "
                f"(num_frames == 1): the CP group runs images data-parallel"
            )
        return
    if num_frames % cp_size:
        raise ValueError(f"num_frames ({num_frames}) must be divisible by cp_size ({cp_size})")


def frames_per_rank(num_frames: int, cp_size: int) -> int:
    check_stdit_divisibility(num_frames, cp_size)
    return 1 if num_frames == 1 else num_frames // cp_size


def positions_per_rank(num_positions: int, cp_size: int) -> int:
    """``m = ceil(n/P)``: positions each rank holds in layout B, padding included."""
    check_positive_int("num_positions", num_positions)
    check_positive_int("cp_size", cp_size)
    return -(-num_positions // cp_size)


def padded_positions(num_positions: int, cp_size: int) -> int:
    return positions_per_rank(num_positions, cp_size) * cp_size


def layout_a_indices(rank: int, num_frames: int, num_positions: int, cp_size: int) -> torch.Tensor:
    """Global token index of every local token of ``rank`` in layout A, in local order.

    A video sample is a grid of ``t`` frames x ``n = h*w`` spatial positions; its global token index
    is ``g = f*n + p`` (frame-major, the order of the full-attention sequence). Layout A (full and
    spatial attention): rank ``r`` of ``P`` holds frames ``[r*t/P, (r+1)*t/P)`` x all ``n``
    positions, locally in the order ``(f_local, p)``: a contiguous chunk of the global sequence
    (``[b, t*n/P, d]``) and, by a free reshape, ``[(b*t/P), n, d]`` for spatial attention. Images
    (``t == 1``): the frame axis cannot be split, so the CP group runs them data-parallel instead
    (``image_batch_range``: rank ``r`` holds whole samples ``[r*b/P, (r+1)*b/P)``; A and B
    coincide).
    """
    check_rank("rank", rank, cp_size, "cp_size")
    tl = frames_per_rank(num_frames, cp_size)
    if num_frames == 1:
        return torch.arange(num_positions)
    f = torch.arange(rank * tl, (rank + 1) * tl)
    return (f[:, None] * num_positions + torch.arange(num_positions)[None, :]).reshape(-1)


def layout_b_indices(rank: int, num_frames: int, num_positions: int, cp_size: int) -> torch.Tensor:
    """Global token index of every local token of ``rank`` in layout B (``-1`` for padding).

    Layout B (temporal attention): rank ``r`` holds positions ``[r*m, (r+1)*m)`` x all ``t`` frames,
    locally in the order ``(p_local, f)``, i.e. ``[(b*m), t, d]``. ``m = ceil(n/P)``: when
    ``n % P != 0`` positions are padded to ``P*m`` (padding sits at the end of the last ranks and is
    stripped on the way back to A); padded slots map to global index ``-1``.
    """
    check_rank("rank", rank, cp_size, "cp_size")
    check_stdit_divisibility(num_frames, cp_size)
    if num_frames == 1:
        return torch.arange(num_positions)
    m = positions_per_rank(num_positions, cp_size)
    p = torch.arange(rank * m, (rank + 1) * m)
    g = torch.arange(num_frames)[None, :] * num_positions + p[:, None]
    return torch.where(p[:, None] < num_positions, g, torch.full_like(g, -1)).reshape(-1)


def _check_video(num_frames: int) -> None:
    if num_frames == 1:
        raise ValueError(
            "num_frames (1): images are sharded by sample, not by token; every rank "
            "holds all tokens of its own samples"
        )


def layout_a_owner(
    global_index: torch.Tensor, num_frames: int, num_positions: int, cp_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``layout_a_indices`` for videos: ``(rank, local index)`` of global tokens."""
    _check_video(num_frames)
    tl = frames_per_rank(num_frames, cp_size)
    g = torch.as_tensor(global_index)
    f, p = g // num_positions, g % num_positions
    return f // tl, (f % tl) * num_positions + p


def layout_b_owner(
    global_index: torch.Tensor, num_frames: int, num_positions: int, cp_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``layout_b_indices`` for videos: ``(rank, local index)`` of global tokens."""
    _check_video(num_frames)
    check_stdit_divisibility(num_frames, cp_size)
    m = positions_per_rank(num_positions, cp_size)
    g = torch.as_tensor(global_index)
    f, p = g // num_positions, g % num_positions
    return p // m, (p % m) * num_frames + f


def token_thw(global_index: torch.Tensor, geometry: VideoGeometry) -> torch.Tensor:
    """``[..., 3]`` (frame, row, column) of global token indices; padding (``-1``) maps to 0s."""
    g = torch.as_tensor(global_index).clamp_min(0)
    n, w = geometry.positions, geometry.width
    p = g % n
    return torch.stack([g // n, p // w, p % w], dim=-1)


def image_batch_range(rank: int, batch_size: int, cp_size: int) -> range:
    """Samples held by ``rank`` when images (``t == 1``) run data-parallel over the CP group."""
    check_rank("rank", rank, cp_size, "cp_size")
    check_stdit_divisibility(1, cp_size, batch_size)
    k = batch_size // cp_size
    return range(rank * k, (rank + 1) * k)


# -- slicing helpers (used to feed a model and as the transitions' reference) -----------------------
def shard_layout_a(video: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """``[b, t, n, ...]`` full video -> this rank's layout-A block ``[b, t/P, n, ...]``.

    Images (``t == 1``) -> ``[b/P, 1, n, ...]`` (this rank's samples).
    """
    b, t = video.shape[0], video.shape[1]
    check_rank("rank", rank, cp_size, "cp_size")
    if t == 1:
        rb = image_batch_range(rank, b, cp_size)
        return video[rb.start : rb.stop]
    tl = frames_per_rank(t, cp_size)
    return video[:, rank * tl : (rank + 1) * tl]


def unshard_layout_a(blocks, num_frames: int) -> torch.Tensor:
    """Inverse of ``shard_layout_a``: concatenate the ranks' blocks (rank order)."""
    return torch.cat(list(blocks), dim=0 if num_frames == 1 else 1)


def shard_layout_b(video: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """``[b, t, n, ...]`` full video -> this rank's layout-B block ``[b, m, t, ...]`` (zero padded).

    Images (``t == 1``) -> ``[b/P, n, 1, ...]`` (this rank's samples, transposed).
    """
    b, t, n = video.shape[:3]
    check_rank("rank", rank, cp_size, "cp_size")
    if t == 1:
        return shard_layout_a(video, rank, cp_size).transpose(1, 2)
    check_stdit_divisibility(t, cp_size)
    m = positions_per_rank(n, cp_size)
    out = video.new_zeros((b, m, t) + tuple(video.shape[3:]))
    lo, hi = rank * m, min((rank + 1) * m, n)
    if hi > lo:
        out[:, : hi - lo] = video[:, :, lo:hi].transpose(1, 2)
    return out
