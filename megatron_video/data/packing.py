"""Sequence packing of mixed images and videos into sequences of at most ``capacity`` tokens
(``plan_packing``, ``pack_sequence``), and ``pack_tokens`` / ``unpack_tokens``, exact inverses that
move per-sample tensors in and out. The packed layout is described on ``PackedSequence``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "PackedSample",
    "PackedSequence",
    "plan_packing",
    "pack_sequence",
    "pack_sequences",
    "pack_tokens",
    "unpack_tokens",
]

_STRATEGIES = ("first_fit_decreasing", "sequential")


@dataclass(frozen=True)
class PackedSample:
    """One sample inside a packed sequence: original ``index``, token span ``[start, start + length)``."""

    index: int
    start: int
    length: int
    num_frames: int
    tokens_per_frame: int


@dataclass(frozen=True, eq=False)
class PackedSequence:
    """Layout of one packed sequence (``total_length`` tokens, the last ``pad_length`` of them padding).

    Per-token tensors (``[total_length]``, int64): ``sample_id`` (original index; -1 on padding),
    ``position_in_sample``, ``frame_index`` and ``spatial_index`` (position within its frame); on
    padding they count within the pad document / are 0. ``cu_seqlens`` is int32 ``[num_docs + 1]``.

    Samples are given by their token counts after patchify (and tokens per frame, so each token
    knows its frame). A packed sequence is the concatenation of its samples in packed order, then
    one pad document to reach a multiple of ``pad_multiple`` (e.g. ``2 * CP`` for the zigzag split).
    ``cu_seqlens`` lists the document boundaries, pad document included, so "same document" masks
    (``masks.packed``) keep samples and padding apart.
    """

    samples: tuple
    total_length: int
    pad_length: int
    cu_seqlens: Tensor
    sample_id: Tensor
    position_in_sample: Tensor
    frame_index: Tensor
    spatial_index: Tensor

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.samples)

    @property
    def loss_mask(self) -> Tensor:
        return self.sample_id >= 0

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def _check_counts(token_counts: Sequence[int], tokens_per_frame) -> list[int]:
    counts = [int(c) for c in token_counts]
    for i, c in enumerate(counts):
        if c < 1:
            raise ValueError(f"token_counts[{i}] ({c}) must be >= 1")
    if tokens_per_frame is None:
        return counts  # one frame per sample
    if isinstance(tokens_per_frame, Integral):
        tokens_per_frame = [int(tokens_per_frame)] * len(counts)
    tpf = [int(t) for t in tokens_per_frame]
    if len(tpf) != len(counts):
        raise ValueError(
            f"tokens_per_frame has {len(tpf)} entries; must match token_counts ({len(counts)})"
        )
    for i, (c, t) in enumerate(zip(counts, tpf)):
        if t < 1 or c % t:
            raise ValueError(
                f"token_counts[{i}] ({c}) must be a multiple of tokens_per_frame[{i}] ({t}) >= 1"
            )
    return tpf


def plan_packing(
    token_counts: Sequence[int], capacity: int, strategy: str = "first_fit_decreasing"
) -> list[list[int]]:
    """Group sample indices into packs of at most ``capacity`` tokens.

    ``first_fit_decreasing`` fills best (largest first, ties by index); ``sequential`` keeps data order
    and opens a new pack whenever the next sample does not fit. Deterministic either way.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy ({strategy!r}) must be one of {_STRATEGIES}")
    if capacity < 1:
        raise ValueError(f"capacity ({capacity}) must be >= 1")
    counts = [int(c) for c in token_counts]
    for i, c in enumerate(counts):
        if not 1 <= c <= capacity:
            raise ValueError(f"token_counts[{i}] ({c}) must be in [1, capacity={capacity}]")
    packs: list[list[int]] = []
    used: list[int] = []
    if strategy == "sequential":
        for i, c in enumerate(counts):
            if not packs or used[-1] + c > capacity:
                packs.append([])
                used.append(0)
            packs[-1].append(i)
            used[-1] += c
        return packs
    for i in sorted(range(len(counts)), key=lambda j: (-counts[j], j)):
        slot = next((k for k, u in enumerate(used) if u + counts[i] <= capacity), None)
        if slot is None:
            packs.append([])
            used.append(0)
            slot = len(packs) - 1
        packs[slot].append(i)
        used[slot] += counts[i]
    return packs


def pack_sequence(
    order: Sequence[int],
    token_counts: Sequence[int],
    *,
    tokens_per_frame: Union[int, Sequence[int], None] = None,
    pad_multiple: int = 1,
    pad_to: Optional[int] = None,
) -> PackedSequence:
    """Layout of the samples ``order`` (indices into ``token_counts``) packed in that order.

    Padded to the next multiple of ``pad_multiple``, or to exactly ``pad_to`` (a multiple of it) for
    fixed shapes. ``tokens_per_frame`` (int or per sample; default: whole sample is one frame) gives
    each token's frame.
    """
    tpf = _check_counts(token_counts, tokens_per_frame)
    counts = [int(c) for c in token_counts]
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple ({pad_multiple}) must be >= 1")
    if not order:
        raise ValueError(f"order ({list(order)}) must name at least one sample")
    if len(set(order)) != len(order) or not all(0 <= i < len(counts) for i in order):
        raise ValueError(f"order ({list(order)}) must be distinct indices in [0, {len(counts)})")
    used = sum(counts[i] for i in order)
    total = -(-used // pad_multiple) * pad_multiple
    if pad_to is not None:
        if pad_to % pad_multiple or pad_to < used:
            raise ValueError(
                f"pad_to ({pad_to}) must be a multiple of pad_multiple ({pad_multiple}) and "
                f">= the packed length ({used})"
            )
        total = pad_to
    samples, ids, pos, frames, spatial, bounds = [], [], [], [], [], [0]
    for i in order:
        n, t = counts[i], tpf[i]
        samples.append(PackedSample(i, bounds[-1], n, n // t, t))
        p = torch.arange(n)
        ids.append(torch.full((n,), i))
        pos.append(p)
        frames.append(p // t)
        spatial.append(p % t)
        bounds.append(bounds[-1] + n)
    pad = total - used
    if pad:
        # The pad document: its own segment in cu_seqlens, so padding attends only to padding.
        ids.append(torch.full((pad,), -1))
        pos.append(torch.arange(pad))
        frames.append(torch.zeros(pad, dtype=torch.long))
        spatial.append(torch.zeros(pad, dtype=torch.long))
        bounds.append(total)
    return PackedSequence(
        tuple(samples),
        total,
        pad,
        torch.tensor(bounds, dtype=torch.int32),
        torch.cat(ids).long(),
        torch.cat(pos),
        torch.cat(frames),
        torch.cat(spatial),
    )


def pack_sequences(
    token_counts: Sequence[int],
    capacity: int,
    *,
    tokens_per_frame: Union[int, Sequence[int], None] = None,
    pad_multiple: int = 1,
    pad_to_capacity: bool = False,
    strategy: str = "first_fit_decreasing",
) -> list[PackedSequence]:
    """Plan packs (``plan_packing``) and lay each out (``pack_sequence``). ``capacity`` must be a
    multiple of ``pad_multiple`` so padding never exceeds it."""
    if pad_multiple < 1 or capacity % pad_multiple:
        raise ValueError(
            f"capacity ({capacity}) must be a multiple of pad_multiple ({pad_multiple}) >= 1"
        )
    return [
        pack_sequence(
            order,
            token_counts,
            tokens_per_frame=tokens_per_frame,
            pad_multiple=pad_multiple,
            pad_to=capacity if pad_to_capacity else None,
        )
        for order in plan_packing(token_counts, capacity, strategy)
    ]


def pack_tokens(
    tokens: Union[Sequence[Tensor], Mapping[int, Tensor]],
    packed: PackedSequence,
    *,
    dim: int = 0,
    pad_value: float = 0.0,
) -> Tensor:
    """Concatenate ``tokens[i]`` for the packed samples along ``dim``, then ``pad_value`` padding."""
    parts = []
    for s in packed.samples:
        t = tokens[s.index]
        if t.dim() == 0 or t.shape[dim] != s.length:
            raise ValueError(
                f"tokens[{s.index}] shape {tuple(t.shape)} must have {s.length} tokens in dim {dim}"
            )
        parts.append(t)
    if packed.pad_length:
        shape = list(parts[0].shape)
        shape[dim] = packed.pad_length
        parts.append(parts[0].new_full(shape, pad_value))
    return torch.cat(parts, dim=dim)


def unpack_tokens(
    packed_tokens: Tensor, packed: PackedSequence, *, dim: int = 0
) -> dict[int, Tensor]:
    """Inverse of ``pack_tokens``: ``{original index: that sample's tokens}`` (padding dropped)."""
    if packed_tokens.dim() == 0 or packed_tokens.shape[dim] != packed.total_length:
        raise ValueError(
            f"packed_tokens shape {tuple(packed_tokens.shape)} must have "
            f"{packed.total_length} tokens in dim {dim}"
        )
    return {s.index: packed_tokens.narrow(dim, s.start, s.length) for s in packed.samples}
