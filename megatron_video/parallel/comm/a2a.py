"""Autograd all-to-all (equal splits, optional permutations) and all-to-all-v (uneven splits,
counts exchanged first), traced."""

from __future__ import annotations

import math
from numbers import Integral
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ...checks import check_dim
from .groups import _carrier, group_rank, group_size, host_group
from .tracer import _record

__all__ = ["all_to_all_single", "all_to_all", "exchange_counts", "all_to_all_v"]


def all_to_all_single(
    x: torch.Tensor, group, tag: str = "", direction: str = "fwd"
) -> torch.Tensor:
    """Plain (non-autograd) ``all_to_all_single`` over dim 0 with equal splits, traced."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    _record("all_to_all", group, x.nbytes * (n - 1) // n, tag, direction)
    dist.all_to_all_single(out, x, group=_carrier(x, group))
    return out


def _a2a(
    x: torch.Tensor,
    group,
    scatter_dim: int,
    gather_dim: int,
    tag: str,
    direction: str,
    scatter_index: Optional[torch.Tensor] = None,
    gather_index: Optional[torch.Tensor] = None,
):
    n = group_size(group)
    if n == 1:
        x = x if scatter_index is None else x.index_select(scatter_dim, scatter_index)
        return x if gather_index is None else x.index_select(gather_dim, gather_index)
    if x.shape[scatter_dim] % n:
        raise ValueError(
            f"all_to_all{f' ({tag})' if tag else ''}: scatter dimension {scatter_dim} has size "
            f"{x.shape[scatter_dim]}, which must be divisible by the group size ({n})"
        )
    # chunk i of the scatter dim goes to group rank i; received chunks are concatenated in group
    # rank order along the gather dim. A permutation of the scatter dim (before) or of the gather
    # dim (after) rides on the packing / unpacking copy where the layout allows (e.g. batch 1).
    if scatter_index is not None:
        x = x.index_select(scatter_dim, scatter_index)
    send = x.unflatten(scatter_dim, (n, -1)).movedim(scatter_dim, 0).contiguous()
    recv = all_to_all_single(send, group, tag, direction)
    out = recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)  # a view where possible
    return out if gather_index is None else out.index_select(gather_dim, gather_index)


def _inverse(index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The inverse permutation: one O(n) scatter (``inv[index] = arange``), not a sort."""
    if index is None:
        return None
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device, dtype=index.dtype)
    return inv


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, tag, scatter_index, gather_index):
        ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.tag = group, scatter_dim, gather_dim, tag
        ctx.indices = (scatter_index, gather_index)
        return _a2a(x, group, scatter_dim, gather_dim, tag, "fwd", scatter_index, gather_index)

    @staticmethod
    def backward(ctx, grad):
        # The inverse all-to-all: scatter what was gathered, gather what was scattered (and undo
        # the permutations in reverse order).
        s_idx, g_idx = ctx.indices
        return (
            _a2a(
                grad,
                ctx.group,
                ctx.gather_dim,
                ctx.scatter_dim,
                ctx.tag,
                "bwd",
                _inverse(g_idx),
                _inverse(s_idx),
            ),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _check_index(name: str, index, size: int, device) -> Optional[torch.Tensor]:
    if index is None:
        return None
    if (
        not isinstance(index, torch.Tensor)
        or index.dim() != 1
        or index.numel() != size
        or index.dtype not in (torch.int64, torch.int32)
    ):
        raise ValueError(
            f"{name} ({getattr(index, 'shape', type(index).__name__)}) must be a 1-D integer "
            f"permutation of {size} positions"
        )
    return index.to(device=device, dtype=torch.int64)


def all_to_all(
    x: torch.Tensor,
    group,
    scatter_dim: int,
    gather_dim: int,
    tag: str = "",
    scatter_index: Optional[torch.Tensor] = None,
    gather_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Autograd all-to-all: split ``scatter_dim`` across the group, concatenate along ``gather_dim``.

    The backward is the inverse all-to-all. ``x.shape[scatter_dim]`` must be divisible by the
    group size; shapes must agree across ranks (see ``check_same_shape``). Optional permutations
    (1-D, the caller's to get right): ``scatter_index`` reorders ``scatter_dim`` before the split
    (``x.index_select(scatter_dim, scatter_index)``), ``gather_index`` the concatenated
    ``gather_dim`` after it (``y.index_select(gather_dim, gather_index)``). Packing (scatter side)
    and unpacking (gather side) take at most one copy each, permutations included, where the layout
    allows (e.g. batch 1); the backward undoes the permutations the same way.
    """
    scatter_dim = check_dim("scatter_dim", scatter_dim, x)
    gather_dim = check_dim("gather_dim", gather_dim, x)
    scatter_index = _check_index("scatter_index", scatter_index, x.shape[scatter_dim], x.device)
    n = group_size(group)
    gather_index = _check_index(
        "gather_index",
        gather_index,
        x.shape[gather_dim] * n if scatter_dim != gather_dim else x.shape[gather_dim],
        x.device,
    )
    if n == 1 and scatter_index is None and gather_index is None:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, tag, scatter_index, gather_index)


# ----------------------------------------------------------------------------------------------
# All-to-all-v (uneven splits; gloo has only all_to_all_single, which takes split sizes)
# ----------------------------------------------------------------------------------------------
def _check_counts(name: str, counts, n: int) -> List[int]:
    vals = list(counts) if isinstance(counts, (list, tuple, torch.Tensor)) else None
    ok = vals is not None and len(vals) == n
    out = []
    for c in vals or []:
        if (
            isinstance(c, torch.Tensor)
            and c.dim() == 0
            and not c.is_floating_point()
            and c.dtype != torch.bool
        ):
            c = int(c)
        if isinstance(c, bool) or not isinstance(c, Integral) or c < 0:
            ok = False
            break
        out.append(int(c))
    if not ok:
        raise ValueError(
            f"{name} ({counts!r}) must be a sequence of {n} (the group size) non-negative integers"
        )
    return out


def exchange_counts(send_counts: Sequence[int], group, tag: str = "") -> List[int]:
    """Every rank tells every other rank how many rows it will send it: ``recv[j]`` is the count
    group rank ``j`` passed for this rank. One tiny ``all_to_all_single`` (``op="a2a_counts"``)."""
    n = group_size(group)
    send = torch.tensor(_check_counts("send_counts", send_counts, n), dtype=torch.int64)
    if n == 1:
        return send.tolist()
    recv = torch.empty_like(send)
    _record("a2a_counts", group, send.nbytes * (n - 1) // n, tag, "fwd")
    dist.all_to_all_single(recv, send, group=host_group(group))
    return recv.tolist()


def _a2av(x: torch.Tensor, send: List[int], recv: List[int], group, tag: str, direction: str):
    x = x.contiguous()
    row = math.prod(x.shape[1:]) * x.element_size()
    me = group_rank(group)
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    _record("all_to_all_v", group, row * (sum(send) - send[me]), tag, direction)
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=list(recv),
        input_split_sizes=list(send),
        group=_carrier(x, group),
    )
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, tag):
        ctx.send, ctx.recv, ctx.group, ctx.tag = send, recv, group, tag
        return _a2av(x, send, recv, group, tag, "fwd")

    @staticmethod
    def backward(ctx, grad):
        # The inverse exchange: every received row's gradient goes back to the rank that sent it,
        # in the order it was sent (split sizes swapped; no count exchange needed).
        return _a2av(grad, ctx.recv, ctx.send, ctx.group, ctx.tag, "bwd"), None, None, None, None


def all_to_all_v(
    x: torch.Tensor,
    send_counts: Sequence[int],
    group,
    tag: str = "",
    expect_recv_counts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Autograd all-to-all with uneven splits along dim 0.

    ``x`` holds ``send_counts[j]`` rows for group rank ``j``, in group-rank order. The counts are
    exchanged first (``exchange_counts``), then one ``all_to_all_single`` with split sizes moves
    the rows; the result holds the rows received from group rank 0, 1, ... in that order. The
    backward is the inverse exchange, so every sender receives exactly the gradient of the rows it
    sent. ``expect_recv_counts`` (optional): the counts this rank computed for itself; a
    difference from the exchanged ones raises ``ValueError`` (callers agree on their inputs first,
    e.g. with ``check_same_values``, so that every rank reaches the same verdict).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(
            f"x ({type(x).__name__} {tuple(getattr(x, 'shape', ()))}) must be a tensor "
            f"with at least one dimension (rows along dim 0)"
        )
    n = group_size(group)
    send = _check_counts("send_counts", send_counts, n)
    if sum(send) != x.shape[0]:
        raise ValueError(f"send_counts ({send}) must sum to x.shape[0] ({x.shape[0]})")
    recv = exchange_counts(send, group, tag)
    if expect_recv_counts is not None and list(expect_recv_counts) != recv:
        raise ValueError(
            f"all_to_all_v{f' ({tag})' if tag else ''}: the counts the other ranks send "
            f"({recv}) differ from expect_recv_counts ({list(expect_recv_counts)})"
        )
    if n == 1:
        return x
    return _AllToAllV.apply(x, send, recv, group, tag)
