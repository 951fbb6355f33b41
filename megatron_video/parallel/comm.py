"""All communication of megatron_video: autograd all-to-all(-v), ring P2P, collectives, and
``CommTracer``, which sees every call (tests and benchmarks assert exact call and byte counts; the
byte convention is on ``CommTracer``). Design: docs/architecture.md, "Capabilities" 1.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import weakref
from dataclasses import dataclass
from numbers import Integral
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "CommEvent",
    "CommTracer",
    "all_to_all",
    "all_to_all_single",
    "ring_shift",
    "RingExchange",
    "record_skipped",
    "check_same_shape",
    "shape_check_scope",
    "check_dim",
    "group_ranks",
    "group_size",
    "group_rank",
    "host_group",
    "drop_host_groups",
    "all_reduce",
    "all_gather_cat",
    "copy_to_group",
    "gather_from_group",
    "broadcast",
    "scatter",
    "all_to_all_v",
    "exchange_counts",
    "check_same_values",
]


# ----------------------------------------------------------------------------------------------
# Tracer
# ----------------------------------------------------------------------------------------------
@dataclass
class CommEvent:
    op: str  # "all_to_all", "send", "recv", "all_reduce", "all_gather", "shape_check"
    group_size: int
    bytes_sent: int  # bytes leaving this rank (see module docstring)
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


# ----------------------------------------------------------------------------------------------
# Group helpers
# ----------------------------------------------------------------------------------------------
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


def check_dim(name: str, dim: int, x: torch.Tensor) -> int:
    """``dim`` normalised to ``[0, x.dim())``; ``ValueError`` outside ``[-x.dim(), x.dim())``."""
    nd = x.dim()
    if isinstance(dim, bool) or not isinstance(dim, Integral) or not -nd <= dim < nd:
        raise ValueError(
            f"{name} ({dim!r}) must be an integer in [-{nd}, {nd}) for a {nd}-D tensor "
            f"{tuple(x.shape)}"
        )
    return int(dim) % nd


# ----------------------------------------------------------------------------------------------
# Shape agreement (before any data collective, so a mismatch raises instead of hanging)
# ----------------------------------------------------------------------------------------------
_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
]


_SIG_WIDTH = 64
# newer torch calls it all_gather_single (and deprecates all_gather_into_tensor)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@functools.lru_cache(maxsize=256)
def _signature(sig: tuple) -> torch.Tensor:
    """The padded int64 signature tensor of ``sig`` (built once per signature, never modified)."""
    local = torch.full((_SIG_WIDTH,), -1, dtype=torch.int64)
    local[: len(sig)] = torch.tensor(sig, dtype=torch.int64)
    return local


_AGREED: contextvars.ContextVar[Optional[set]] = contextvars.ContextVar(
    "megatron_video_agreed_shapes", default=None
)


@contextlib.contextmanager
def shape_check_scope():
    """Inside it, ``check_same_shape`` compares each distinct (group, caller, shapes) once: a later
    identical call returns without a collective. Enter it once per micro-batch around code every
    rank runs alike (``VideoTransformerBlock`` does, around its layers), so per-layer checks cost
    one all-gather per distinct call per micro-batch. A mismatch still raises on every rank: the
    first call of a signature checks on every rank, and later calls are the same on every rank
    because every rank runs the same layers. A scope starts empty (nested ones too); do not hold
    one across micro-batches, whose shapes may differ between ranks."""
    token = _AGREED.set(set())
    try:
        yield
    finally:
        _AGREED.reset(token)


def check_same_shape(tensors: Dict[str, torch.Tensor], group, where: str = "") -> None:
    """Raise ``ValueError`` on every rank if the named tensors' shapes/dtypes differ across ``group``.

    One small all-gather of the shape signature; recorded by the tracer as ``shape_check``
    (inside ``shape_check_scope``: once per distinct call).
    """
    if group is None or group_size(group) == 1:
        return
    sig = []
    for _name, t in tensors.items():
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
        sig.extend([t.dim(), code] + list(t.shape))
    if len(sig) > _SIG_WIDTH:
        raise ValueError(f"check_same_shape: too many dims to compare ({len(sig)} > {_SIG_WIDTH})")
    agreed, key = _AGREED.get(), (id(group), where, tuple(tensors), tuple(sig))
    if agreed is not None and key in agreed:
        return
    local = _signature(tuple(sig))
    n = group_size(group)
    gathered = torch.empty(n * _SIG_WIDTH, dtype=torch.int64)
    _record("shape_check", group, local.nbytes * (n - 1), where, "fwd")
    _all_gather_single(gathered, local, group=host_group(group))
    gathered = gathered.view(n, _SIG_WIDTH)
    if torch.equal(gathered, gathered[:1].expand(n, -1)):
        if agreed is not None:
            agreed.add(key)
        return
    r = next(r for r in range(n) if not torch.equal(gathered[r], gathered[0]))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    raise ValueError(
        f"{where or 'collective'}: tensor shapes/dtypes differ between ranks of the group "
        f"(this rank {group_rank(group)}: {shapes}, {[t.dtype for t in tensors.values()]}; "
        f"group rank {r} differs from group rank 0); every rank must pass the same shapes"
    )


# ----------------------------------------------------------------------------------------------
# All-to-all
# ----------------------------------------------------------------------------------------------
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


def check_same_values(values: Dict[str, torch.Tensor], group, where: str = "") -> None:
    """Raise ``ValueError`` on every rank if the named tensors' values differ across ``group``.

    Each tensor is reduced to (numel, CRC32 of its bytes); one small all-gather of those
    fingerprints (``op="shape_check"``). Used where every rank must hold the same metadata (e.g.
    the token ids that decide where each visual token goes) before uneven collectives.
    """
    if group is None or group_size(group) == 1:
        return
    import zlib

    sig = []
    for t in values.values():
        t = torch.as_tensor(t).detach().cpu().contiguous()
        sig += [t.numel(), zlib.crc32(t.numpy().tobytes()) if t.numel() else 0]
    local = torch.tensor(sig, dtype=torch.int64)
    gathered = [torch.empty_like(local) for _ in range(group_size(group))]
    _record("shape_check", group, local.nbytes * (group_size(group) - 1), where, "fwd")
    dist.all_gather(gathered, local, group=host_group(group))
    names = list(values)
    for r, g in enumerate(gathered):
        if not torch.equal(g, gathered[0]):
            diff = [
                names[i // 2]
                for i in range(0, len(sig), 2)
                if not torch.equal(g[i : i + 2], gathered[0][i : i + 2])
            ]
            raise ValueError(
                f"{where or 'collective'}: {', '.join(sorted(set(diff)))} differ between "
                f"ranks of the group (group rank {r} vs group rank 0); every rank must "
                f"pass the same values"
            )


# ----------------------------------------------------------------------------------------------
# Ring P2P
# ----------------------------------------------------------------------------------------------
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
