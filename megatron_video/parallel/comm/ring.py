"""Ring P2P: ``RingExchange`` (batched sends to the next ring rank, receives from the previous
one) and the autograd ``ring_shift``, traced."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .groups import _carrier, group_rank, group_ranks, group_size
from .tracer import _record

__all__ = ["RingExchange", "ring_shift"]


class RingExchange:
    """Post sends to the next ring rank and receives from the previous one; ``wait()`` for them.

    ``shift=+1`` sends to ``(i+1) % R`` and receives from ``(i-1) % R``; ``shift=-1`` the reverse
    (used to send dK/dV back to their owners); a shift that is a multiple of ``R`` (or a ring of
    one) copies locally, with no communication. Posting happens in ``__init__`` so callers overlap
    the transfer with compute on the current block. Every rank of the ring posts a batch: a
    direction with nothing to move carries one pad byte (``device``: where it lives when there are
    no tensors), so the first batch on a group, where NCCL builds the group's communicator, is
    joined by all its ranks. That needs what the ring already keeps: a rank sends nothing to its
    next rank exactly when that rank receives nothing from it.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group,
        shift: int = 1,
        tag: str = "",
        direction: str = "fwd",
        recv: Optional[Sequence[torch.Tensor]] = None,
        device=None,
    ):
        ranks = group_ranks(group)
        n = len(ranks)
        me = group_rank(group)
        self.dst = ranks[(me + shift) % n]
        self.src = ranks[(me - shift) % n]
        self._reqs = []
        if self.dst == ranks[me]:  # shift % n == 0 (e.g. a ring of one): nothing leaves this rank
            self.recv = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
            self._sent = None
            return
        # contiguous receive buffers: gloo rejects strided ones, and senders send contiguous data.
        # ``recv`` (given when what arrives differs from what leaves, both sides knowing the plan)
        # are the buffers to fill, possibly fewer or more than the tensors sent.
        self.recv = (
            [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            if recv is None
            else list(recv)
        )
        tensors = [t.contiguous() for t in tensors]
        for t in tensors:
            _record("send", group, t.nbytes, tag, direction, peers=[ranks[me], self.dst])
        if device is None:
            if not tensors and not self.recv:
                raise ValueError("RingExchange: device must be given when nothing moves (pads)")
            device = (list(tensors) + list(self.recv))[0].device
        sends = list(tensors) or [torch.zeros(1, dtype=torch.uint8, device=device)]  # pads
        recvs = list(self.recv) or [torch.empty(1, dtype=torch.uint8, device=device)]
        ops = [
            dist.P2POp(dist.isend, t, self.dst, _carrier(t, group), i) for i, t in enumerate(sends)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.src, _carrier(t, group), i) for i, t in enumerate(recvs)
        ]
        # one batch: NCCL fuses it into one group call, so a send and a receive between the same
        # two ranks (a ring of two) cannot wait on each other; gloo posts the ops one by one
        self._reqs = dist.batch_isend_irecv(ops)
        self._sent = sends + recvs  # keep alive until wait()

    def wait(self) -> List[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self._reqs, self._sent = [], None
        return self.recv


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, shift, tag):
        ctx.group, ctx.shift, ctx.tag = group, shift, tag
        return RingExchange([x], group, shift, tag, "fwd").wait()[0]

    @staticmethod
    def backward(ctx, grad):
        return (
            RingExchange([grad], ctx.group, -ctx.shift, ctx.tag, "bwd").wait()[0],
            None,
            None,
            None,
        )


def ring_shift(x: torch.Tensor, group, shift: int = 1, tag: str = "") -> torch.Tensor:
    """Autograd ring exchange: returns the tensor of ring rank ``(i - shift) % R``."""
    if shift % group_size(group) == 0:  # a ring of one, or a full turn: the identity
        return x
    return _RingShift.apply(x, group, shift, tag)
