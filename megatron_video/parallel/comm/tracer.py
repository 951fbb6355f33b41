"""``CommTracer``: sees every communication call of ``parallel.comm`` (tests and benchmarks assert
exact call and byte counts; the byte convention is on ``CommTracer``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .groups import group_ranks, group_size

__all__ = ["CommEvent", "CommTracer", "record_skipped"]


@dataclass
class CommEvent:
    op: str  # "all_to_all", "send", "recv", "all_reduce", "all_gather", "shape_check"
    group_size: int
    bytes_sent: int  # bytes leaving this rank (the convention is on CommTracer)
    intra_node: bool  # every rank of the group (or both P2P peers) on this rank's node
    tag: str = ""  # free-form label set by the caller ("ulysses.q", "ring.kv", ...)
    direction: str = "fwd"  # "fwd" or "bwd" (autograd backward)


_ACTIVE: List["CommTracer"] = []


class CommTracer(contextlib.ContextDecorator):
    """Record every communication call made inside the ``with`` block on this rank.

    >>> with CommTracer() as t:
    ...     y = all_to_all(x, group, scatter_dim=2, gather_dim=1)
    >>> t.count("all_to_all"), t.bytes("all_to_all")

    Byte convention (what the tracer records as ``bytes_sent`` by this rank):

    * all-to-all: the bytes leaving this rank, i.e. ``nbytes * (N-1)/N`` (the self chunk stays);
    * ring send: the bytes of every tensor sent to the next rank;
    * all-reduce: ``nbytes * (N-1)/N`` (the ring-algorithm volume per rank);
    * all-gather: ``nbytes * (N-1)`` (this rank's input reaches every other rank);
    * all-to-all-v: the bytes of the rows sent to the other ranks (exact, from the split sizes); the
      split-size exchange before it is recorded as ``op="a2a_counts"``;
    * shape / value checks (``check_same_shape``, ``check_same_values``) are recorded with
      ``op="shape_check"`` so they never mix with data traffic;
    * ring sends a routed ring skips (``record_skipped``): ``op="skip_send"`` / ``"skip_recv"``,
      one 0-byte event per tensor, on the side that skips it.
    """

    def __init__(self):
        self.events: List[CommEvent] = []

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return False

    def _filter(self, op=None, direction=None, intra_node=None, tag=None):
        for e in self.events:
            if op is not None and e.op != op:
                continue
            if direction is not None and e.direction != direction:
                continue
            if intra_node is not None and e.intra_node != intra_node:
                continue
            if tag is not None and not e.tag.startswith(tag):
                continue
            yield e

    def count(self, op=None, direction=None, intra_node=None, tag=None) -> int:
        return sum(1 for _ in self._filter(op, direction, intra_node, tag))

    def bytes(self, op=None, direction=None, intra_node=None, tag=None) -> int:
        return sum(e.bytes_sent for e in self._filter(op, direction, intra_node, tag))

    def summary(self) -> Dict[Tuple[str, str, bool], Tuple[int, int]]:
        """``{(op, direction, intra_node): (calls, bytes)}``."""
        out: Dict[Tuple[str, str, bool], Tuple[int, int]] = {}
        for e in self.events:
            key = (e.op, e.direction, e.intra_node)
            c, b = out.get(key, (0, 0))
            out[key] = (c + 1, b + e.bytes_sent)
        return out

    def table(self) -> str:
        rows = [f"{'op':<12} {'dir':<4} {'link':<6} {'calls':>6} {'bytes':>14}"]
        for (op, d, intra), (c, b) in sorted(self.summary().items()):
            rows.append(f"{op:<12} {d:<4} {'intra' if intra else 'inter':<6} {c:>6} {b:>14,}")
        return "\n".join(rows)


def _ranks_per_node() -> int:
    v = os.environ.get("LOCAL_WORLD_SIZE")
    if v is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return int(v)


def _same_node(global_ranks: Sequence[int]) -> bool:
    rpn = _ranks_per_node()
    return len({r // rpn for r in global_ranks}) <= 1


def record_skipped(group, sends: int, recvs: int, tag: str, direction: str) -> None:
    """Count ring sends a plan skipped (``op="skip_send"``, ``"skip_recv"``: one event per tensor
    not sent / not received, 0 bytes), on the side that skips them."""
    for _ in range(sends):
        _record("skip_send", group, 0, tag, direction)
    for _ in range(recvs):
        _record("skip_recv", group, 0, tag, direction)


def _record(
    op: str, group, nbytes: int, tag: str, direction: str, peers: Optional[Sequence[int]] = None
):
    if not _ACTIVE:
        return
    ranks = group_ranks(group) if peers is None else list(peers)
    ev = CommEvent(
        op=op,
        group_size=group_size(group),
        bytes_sent=int(nbytes),
        intra_node=_same_node(ranks),
        tag=tag,
        direction=direction,
    )
    for t in _ACTIVE:
        t.events.append(ev)
