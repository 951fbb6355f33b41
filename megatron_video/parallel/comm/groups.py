"""Group helpers of the traced communication: ranks, sizes, and the gloo group that carries a
group's host tensors (``host_group``)."""

from __future__ import annotations

import contextlib
import weakref
from typing import List

import torch
import torch.distributed as dist

__all__ = ["group_ranks", "group_size", "group_rank", "host_group", "drop_host_groups"]


def group_ranks(group) -> List[int]:
    return (
        list(dist.get_process_group_ranks(group))
        if group is not None
        else list(range(dist.get_world_size()))
    )


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


# A group whose backend has no CPU device (NCCL: Megatron's groups and ours on GPUs) cannot carry
# the small host tensors of shape checks, counts and status flags; they travel over a gloo group
# of the same ranks instead, so they never touch the device (no device sync, nothing to capture).
_HOST_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _carries_cpu(pg) -> bool:
    try:
        pg._get_backend(torch.device("cpu"))
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    return True


def host_group(group):
    """The group that carries CPU tensors for ``group`` (None: the world): ``group`` itself when
    its backend has a CPU device (gloo, ``"cpu:gloo,cuda:nccl"``), else a gloo group of the same
    ranks, created at the first call by the group's members (every member reaches it at the same
    collective) and kept until ``drop_host_groups``."""
    pg = dist.group.WORLD if group is None else group
    if _carries_cpu(pg):
        return group
    mirror = _HOST_GROUPS.get(pg)
    if mirror is None:
        ranks = list(dist.get_process_group_ranks(pg))
        mirror = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        _HOST_GROUPS[pg] = mirror
    return mirror


def drop_host_groups() -> None:
    """Destroy the gloo groups ``host_group`` created (``destroy_video_parallel`` calls it)."""
    mirrors = list(_HOST_GROUPS.values())
    _HOST_GROUPS.clear()
    for m in mirrors:
        with contextlib.suppress(ValueError):  # already destroyed with the world
            dist.destroy_process_group(m)


def _carrier(x: torch.Tensor, group):
    """``group``, or its ``host_group`` for a CPU tensor."""
    return host_group(group) if x.device.type == "cpu" else group
