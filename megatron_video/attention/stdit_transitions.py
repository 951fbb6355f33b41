"""Autograd transitions between ST-DiT layouts A (frames per rank) and B (positions per rank): one
all-to-all each way, each the other's backward. Index maps: ``megatron_video.layouts.stdit``; kept
here, beside the other communicating layout code, so that ``layouts`` stays pure.
"""

from __future__ import annotations

import torch

from ..layouts.stdit import check_stdit_divisibility, frames_per_rank, positions_per_rank
from ..parallel.comm import all_to_all, check_same_shape, group_size

__all__ = ["frames_to_positions", "positions_to_frames"]


def _check_dims(x: torch.Tensor, name: str, expected: tuple, what: str) -> None:
    if x.dim() < 3 or tuple(x.shape[1:3]) != expected:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; {what} expects [b, {expected[0]}, "
            f"{expected[1]}, ...]"
        )


def _checked_cp_size(x, group, num_frames: int, num_positions: int, where: str, dims) -> int:
    """The CP size ``P`` of ``group``, with ``num_frames`` divisible and ``x``'s dims 1 and 2
    ``dims(P)``."""
    P = group_size(group)
    check_stdit_divisibility(num_frames, P)
    _check_dims(
        x,
        "x",
        dims(P),
        f"{where} (num_frames={num_frames}, num_positions={num_positions}, cp_size={P})",
    )
    return P


def _exchanges(x, group, num_frames: int, P: int, check_shapes: bool, where: str) -> bool:
    """Whether the transition needs the all-to-all (not for images or one rank: a local
    transpose); if so and ``check_shapes``, the ranks agree on ``x``'s shape first."""
    if num_frames == 1 or P == 1:
        return False
    if check_shapes:
        check_same_shape({"x": x}, group, where=where)
    return True


def frames_to_positions(
    x: torch.Tensor,
    group,
    num_frames: int,
    num_positions: int,
    tag: str = "stdit.frames_to_positions",
    check_shapes: bool = True,
) -> torch.Tensor:
    """Layout A ``[b, t/P, n, ...]`` -> layout B ``[b, ceil(n/P), t, ...]`` over ``group``.

    ``check_shapes`` agrees on shapes across the group first (one small all-gather), so a
    mismatch raises ``ValueError`` instead of hanging in the all-to-all.
    """
    P = _checked_cp_size(
        x,
        group,
        num_frames,
        num_positions,
        "frames_to_positions",
        lambda P: (frames_per_rank(num_frames, P), num_positions),
    )
    if not _exchanges(x, group, num_frames, P, check_shapes, "frames_to_positions"):
        return x.transpose(1, 2)
    y = x.transpose(1, 2)  # [b, n, t/P, ...]
    pad = positions_per_rank(num_positions, P) * P - num_positions
    if pad:
        y = torch.cat([y, y.new_zeros((y.shape[0], pad) + tuple(y.shape[2:]))], dim=1)
    # chunk i of the positions goes to rank i; frames arrive in rank order = global frame order.
    return all_to_all(y, group, scatter_dim=1, gather_dim=2, tag=tag)


def positions_to_frames(
    x: torch.Tensor,
    group,
    num_frames: int,
    num_positions: int,
    tag: str = "stdit.positions_to_frames",
    check_shapes: bool = True,
) -> torch.Tensor:
    """Layout B ``[b, ceil(n/P), t, ...]`` -> layout A ``[b, t/P, n, ...]``; inverse of the above."""
    P = _checked_cp_size(
        x,
        group,
        num_frames,
        num_positions,
        "positions_to_frames",
        lambda P: (
            num_positions if num_frames == 1 else positions_per_rank(num_positions, P),
            num_frames,
        ),
    )
    if not _exchanges(x, group, num_frames, P, check_shapes, "positions_to_frames"):
        return x.transpose(1, 2)
    y = all_to_all(x, group, scatter_dim=2, gather_dim=1, tag=tag)  # [b, P*m, t/P, ...]
    return y[:, :num_positions].transpose(1, 2)
