"""Reductions, gathers, broadcast / scatter and Megatron's copy-to / gather-from group regions,
traced."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...checks import check_dim
from .groups import _carrier, group_rank, group_ranks, group_size
from .tracer import _record

__all__ = [
    "all_reduce",
    "all_gather_cat",
    "broadcast",
    "scatter",
    "copy_to_group",
    "gather_from_group",
]


# ----------------------------------------------------------------------------------------------
# Reductions (used for loss normalisation and replicated-parameter gradients)
# ----------------------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, tag: str = "") -> torch.Tensor:
    """In-place, non-autograd all-reduce, traced."""
    n = group_size(group)
    if n > 1:
        _record("all_reduce", group, x.nbytes * (n - 1) // n, tag, "fwd")
        dist.all_reduce(x, op=op, group=_carrier(x, group))
    return x


def all_gather_cat(x: torch.Tensor, group, dim: int = 0, tag: str = "") -> torch.Tensor:
    """Non-autograd all-gather concatenated along ``dim`` in group-rank order, traced."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(n)]
    _record("all_gather", group, x.nbytes * (n - 1), tag, "fwd")
    dist.all_gather(out, x, group=_carrier(x, group))
    return torch.cat(out, dim=dim)


# ----------------------------------------------------------------------------------------------
# One-to-many (distributing a loaded sample from the loading rank)
# ----------------------------------------------------------------------------------------------
def broadcast(x: torch.Tensor, group, src: int = 0, tag: str = "") -> torch.Tensor:
    """In-place, non-autograd broadcast from group rank ``src``, traced (``src`` records
    ``nbytes * (N-1)``, the others 0)."""
    n = group_size(group)
    if n > 1:
        _record(
            "broadcast", group, x.nbytes * (n - 1) if group_rank(group) == src else 0, tag, "fwd"
        )
        dist.broadcast(x, src=group_ranks(group)[src], group=_carrier(x, group))
    return x


def scatter(
    chunks: Optional[Sequence[torch.Tensor]], out: torch.Tensor, group, src: int = 0, tag: str = ""
) -> torch.Tensor:
    """Non-autograd scatter: group rank ``src`` sends ``chunks[i]`` (all shaped like ``out``) to
    group rank ``i``; fills and returns ``out``. Traced (``src`` records the bytes of the chunks it
    sends to others, the others 0)."""
    n = group_size(group)
    me = group_rank(group)
    if me == src and (chunks is None or len(chunks) != n):
        raise ValueError(
            f"scatter: src must pass one chunk per group rank ({n}), got "
            f"{None if chunks is None else len(chunks)}"
        )
    if n == 1:
        return out.copy_(chunks[0])
    _record("scatter", group, out.nbytes * (n - 1) if me == src else 0, tag, "fwd")
    dist.scatter(
        out,
        [c.contiguous() for c in chunks] if me == src else None,
        src=group_ranks(group)[src],
        group=_carrier(out, group),
    )
    return out


# ----------------------------------------------------------------------------------------------
# Replicated <-> sharded autograd helpers (Megatron's copy-to / gather-from parallel region)
# ----------------------------------------------------------------------------------------------
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A replicated input feeds every rank: its gradient is the sum of the ranks' gradients.
        grad = grad.contiguous().clone()
        n = group_size(ctx.group)
        _record("all_reduce", ctx.group, grad.nbytes * (n - 1) // n, ctx.tag, "bwd")
        dist.all_reduce(grad, group=_carrier(grad, ctx.group))
        return grad, None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, tag):
        ctx.group, ctx.dim, ctx.n, ctx.r = group, dim, group_size(group), group_rank(group)
        return all_gather_cat(x, group, dim=dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        # The gathered output is replicated, so each rank keeps the slice of its own input.
        return grad.tensor_split(ctx.n, dim=ctx.dim)[ctx.r].contiguous(), None, None, None


def copy_to_group(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward (for replicated inputs/params)."""
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group, tag)


def gather_from_group(x: torch.Tensor, group, dim: int = 0, tag: str = "") -> torch.Tensor:
    """All-gather along ``dim`` (replicated output); backward keeps this rank's slice."""
    if group_size(group) == 1:
        return x
    return _GatherFromGroup.apply(x, group, check_dim("dim", dim, x), tag)
