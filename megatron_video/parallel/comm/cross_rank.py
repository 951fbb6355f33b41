"""Cross-rank agreement checks before any data collective, so a mismatch raises on every rank
instead of hanging: ``check_same_shape`` (inside ``shape_check_scope``: once per distinct call)
and ``check_same_values``, both over ``host_group`` and traced as ``shape_check``; and
``agree_or_raise`` (a refusal on one rank raises on every rank: checkpoint checks, GRPO steps),
traced as ``agree``."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import all_reduce, broadcast
from .groups import group_rank, group_size, host_group
from .tracer import _record

__all__ = ["check_same_shape", "shape_check_scope", "check_same_values", "agree_or_raise"]


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


def agree_or_raise(reason: Optional[str], what: str) -> None:
    """Collective over the world: raise ``ValueError`` on every rank if any rank has a ``reason``
    (its own reason where it has one), so a refusal seen by one rank never leaves the others
    waiting in a later collective. One traced ``all_reduce`` (tag ``"agree"``)."""
    flag = torch.tensor([0.0 if reason is None else 1.0])  # a host flag (host_group)
    all_reduce(flag, None, tag="agree")
    if flag.item():
        src, first = _first_reason(reason)  # only after a refusal: two more host collectives
        raise ValueError(
            f"{what}: {reason}"
            if reason
            else f"{what}: refused on another rank (rank {src}: {first})"
        )


REASON_BYTES = 4096  # the refusal text shared with the other ranks (UTF-8, cut there)


def _first_reason(reason: Optional[str]) -> Tuple[int, str]:
    """``(rank, reason)`` of the lowest rank with a reason, on every rank (collective over the
    world), so the ranks that did not fail name the cause too."""
    rank, world = group_rank(None), group_size(None)
    src = torch.tensor([float(rank if reason is not None else world)])
    all_reduce(src, None, op=dist.ReduceOp.MIN, tag="agree.rank")
    src = int(src.item())
    buf = torch.zeros(REASON_BYTES, dtype=torch.uint8)
    if rank == src:
        data = (reason or "").encode()[:REASON_BYTES]
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    broadcast(buf, None, src=src, tag="agree.reason")
    return src, bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")
