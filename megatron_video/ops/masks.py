"""Attention masks from per-token identities (``TokenIds``), dense and at block granularity
(``block_mask_status``: the ring skip-list, and a FlexAttention ``BlockMask``). The rules are
defined once in ``ops.rules`` (and ``csrc/mask_rules.h`` for the kernels). Design:
docs/architecture.md, "Capabilities" 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, NamedTuple

import torch

from ._backend import extension_for
from .rules import EMPTY, FIELDS, FULL, ORDER_KEY, PARTIAL, RULES
from .rules import allowed as _allowed

_ROWS = ("side", "block", "doc", "pos")


@dataclass(frozen=True)
class TokenIds:
    """Per-token identity vectors (1-D integer tensors of one length); unused fields may be None.

    Each token carries ``side`` (0 clean, 1 noisy), ``block`` (global latent frame // frames per
    block), ``doc`` (document id, for packing) and ``pos`` (position). When both sides carry ``doc``
    the rule is ANDed with ``doc_q == doc_k`` (packed documents, e.g. ``causal`` within each
    document). Tokens may come in any order: the ids define it.
    """

    side: torch.Tensor | None = None
    block: torch.Tensor | None = None
    doc: torch.Tensor | None = None
    pos: torch.Tensor | None = None

    @classmethod
    def from_frames(
        cls, frame: torch.Tensor, frames_per_block: int, *, side=None, doc=None, pos=None
    ) -> "TokenIds":
        """Ids whose block is ``frame // frames_per_block`` (global latent frame per token)."""
        if not isinstance(frames_per_block, int) or frames_per_block < 1:
            raise ValueError(f"frames_per_block ({frames_per_block!r}) must be a positive int")
        if not isinstance(frame, torch.Tensor) or frame.dim() != 1 or frame.dtype.is_floating_point:
            raise ValueError(
                f"frame ({getattr(frame, 'shape', type(frame).__name__)}) must be a 1-D "
                "integer tensor"
            )
        if frame.numel() and int(frame.min()) < 0:
            raise ValueError(f"frame (min {int(frame.min())}) must be >= 0")
        return cls(
            side=side,
            block=torch.div(frame, frames_per_block, rounding_mode="floor"),
            doc=doc,
            pos=pos,
        )

    def present(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def _check_ids(name: str, ids: TokenIds, needs: tuple[str, ...]) -> tuple[int, torch.device]:
    if not isinstance(ids, TokenIds):
        raise ValueError(f"{name} ({type(ids).__name__}) must be a TokenIds")
    given = ids.present()
    for field in needs:
        if field not in given:
            raise ValueError(f"{name}.{field} (None) is required by this rule")
    if not given:
        raise ValueError(f"{name} (no fields) must carry at least one id vector")
    length = device = None
    for field, t in given.items():
        if (
            not isinstance(t, torch.Tensor)
            or t.dim() != 1
            or t.dtype.is_floating_point
            or t.dtype == torch.bool
        ):
            raise ValueError(
                f"{name}.{field} ({getattr(t, 'shape', type(t).__name__)}) must be a 1-D "
                "integer tensor"
            )
        length = t.numel() if length is None else length
        device = t.device if device is None else device
        if t.numel() != length or t.device != device:
            raise ValueError(
                f"{name}.{field} (length {t.numel()}, {t.device}) must match the other fields "
                f"(length {length}, {device})"
            )
    side = given.get("side")
    if side is not None and side.numel() and bool(((side != 0) & (side != 1)).any()):
        raise ValueError(
            f"{name}.side (values {sorted(set(side.unique().tolist()))}) must be 0 (clean) or 1 (noisy)"
        )
    return length, device


def _packed(ids: TokenIds, length: int, device: torch.device) -> torch.Tensor:
    """[4, L] int64 rows (side, block, doc, pos); absent rows are zeros, never read by the rule."""
    out = torch.zeros(4, length, dtype=torch.int64, device=device)
    for row, field in enumerate(_ROWS):
        t = getattr(ids, field)
        if t is not None:
            out[row] = t
    return out


def _prepare(q: TokenIds, k: TokenIds, rule: str):
    if rule not in RULES:
        raise ValueError(f"rule ({rule!r}) must be one of {tuple(RULES)}")
    lq, dq = _check_ids("q", q, FIELDS[rule])
    lk, dk = _check_ids("k", k, FIELDS[rule])
    if dq != dk:
        raise ValueError(f"q ({dq}) and k ({dk}) must be on one device")
    if (q.doc is None) != (k.doc is None):
        raise ValueError(
            f"doc (q: {q.doc is not None}, k: {k.doc is not None}) must be given for both "
            "q and k or for neither"
        )
    return _packed(q, lq, dq), _packed(k, lk, dk), q.doc is not None


def _dense_rows(rule: str, same_doc: bool, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    return _allowed(rule, same_doc, tuple(qi[:, :, None]), tuple(ki[:, None, :]))


def dense_mask(q: TokenIds, k: TokenIds, rule: str) -> torch.Tensor:
    """Bool ``[Lq, Lk]``: True where query ``i`` may attend to key ``j``."""
    qi, ki, same_doc = _prepare(q, k, rule)
    ext = extension_for(qi.device)
    if ext is None:
        return _dense_rows(rule, same_doc, qi, ki)
    return ext.dense_mask(qi, ki, RULES[rule], same_doc)


def dense_mask_reference(q: TokenIds, k: TokenIds, rule: str) -> torch.Tensor:
    """Pure-PyTorch ``dense_mask`` (broadcast comparisons)."""
    qi, ki, same_doc = _prepare(q, k, rule)
    return _dense_rows(rule, same_doc, qi, ki)


def lower_triangle(q: TokenIds, k: TokenIds, rule: str) -> bool:
    """True only if ``dense_mask(q, k, rule)`` is exactly the lower triangle ``j <= i`` (square),
    decided in O(length) without building the mask; False may be conservative.

    Sufficient condition: the rule orders tokens by one key (``pos`` for ``causal``, ``block`` for
    ``block_causal`` and for an all-clean ``teacher_forcing`` tile), q and k carry identical keys
    that strictly increase along the tile, and (with documents) one document on both sides. Then
    the rule's ``key_k <= key_q`` holds exactly for ``j <= i``.
    """
    qi, ki, same_doc = _prepare(q, k, rule)
    n = qi.shape[1]
    if n == 0 or ki.shape[1] != n:
        return False
    if rule not in ORDER_KEY:
        return False
    if rule == "teacher_forcing" and (bool(qi[0].any()) or bool(ki[0].any())):
        return False  # teacher forcing orders by block only when all clean (clean->clean)
    row = _ROWS.index(ORDER_KEY[rule])
    key = qi[row]
    if not torch.equal(key, ki[row]) or (n > 1 and not bool((key[1:] > key[:-1]).all())):
        return False
    if same_doc:
        d = qi[2]
        return bool(torch.equal(d, ki[2])) and bool((d == d[0]).all())
    return True


def _check_tile(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive int (tokens per block)")
    return value


def block_mask_status(
    q: TokenIds, k: TokenIds, rule: str, q_block: int, k_block: int
) -> torch.Tensor:
    """uint8 ``[ceil(Lq/q_block), ceil(Lk/k_block)]``: 0 empty, 1 partial, 2 full (over the tile's
    real tokens)."""
    _check_tile("q_block", q_block)
    _check_tile("k_block", k_block)
    qi, ki, same_doc = _prepare(q, k, rule)
    ext = extension_for(qi.device)
    if ext is None:
        return _status_reference(rule, same_doc, qi, ki, q_block, k_block)
    return ext.block_status(qi, ki, RULES[rule], same_doc, q_block, k_block)


def block_mask_status_reference(
    q: TokenIds, k: TokenIds, rule: str, q_block: int, k_block: int
) -> torch.Tensor:
    """Pure-PyTorch ``block_mask_status``: dense mask by row chunks, any/all per tile."""
    _check_tile("q_block", q_block)
    _check_tile("k_block", k_block)
    qi, ki, same_doc = _prepare(q, k, rule)
    return _status_reference(rule, same_doc, qi, ki, q_block, k_block)


def _status_reference(rule, same_doc, qi, ki, q_block, k_block) -> torch.Tensor:
    lq, lk = qi.shape[1], ki.shape[1]
    nq, nk = -(-lq // q_block), -(-lk // k_block)
    status = torch.empty(nq, nk, dtype=torch.uint8, device=qi.device)
    pad_k = nk * k_block - lk
    tiles_per_chunk = max(
        1, (1 << 22) // max(1, q_block * lk)
    )  # bounds the dense chunk to ~4M bools
    for t0 in range(0, nq, tiles_per_chunk):
        r0, r1 = t0 * q_block, min(lq, (t0 + tiles_per_chunk) * q_block)
        m = _dense_rows(rule, same_doc, qi[:, r0:r1], ki)
        rows = -(-(r1 - r0) // q_block) * q_block
        shape = (rows // q_block, q_block, nk, k_block)
        # Padding is False for "any allowed" and True for "all allowed": it never changes a verdict.
        any_ = (
            torch.nn.functional.pad(m, (0, pad_k, 0, rows - (r1 - r0)), value=False)
            .view(shape)
            .any(3)
            .any(1)
        )
        all_ = (
            torch.nn.functional.pad(m, (0, pad_k, 0, rows - (r1 - r0)), value=True)
            .view(shape)
            .all(3)
            .all(1)
        )
        status[t0 : t0 + shape[0]] = torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(
            torch.uint8
        )
    return status


class FlexBlockFields(NamedTuple):
    """``BlockMask.from_kv_blocks`` inputs, ``[1, 1, nq]`` counts and ``[1, 1, nq, nk]`` indices (int32)."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor


def flex_block_fields(status: torch.Tensor) -> FlexBlockFields:
    """Partial tiles become FlexAttention's masked blocks, full tiles its full blocks (mask_mod skipped).

    Indices of each kind come first in ascending k order; the rest of each row is padding.
    """
    if not isinstance(status, torch.Tensor) or status.dim() != 2:
        raise ValueError(
            f"status ({getattr(status, 'shape', type(status).__name__)}) must be a 2-D tile status"
        )
    nk = status.shape[1]
    cols = torch.arange(nk, device=status.device)

    def kind(value: int):
        hit = status == value
        # Sorting key: matching columns keep their order ahead of all others (keys are unique).
        order = torch.argsort(torch.where(hit, cols, cols + nk), dim=1)
        return hit.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_idx = kind(PARTIAL)
    full_num, full_idx = kind(FULL)
    return FlexBlockFields(kv_num, kv_idx, full_num, full_idx)


def mask_mod(q: TokenIds, k: TokenIds, rule: str) -> Callable:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` evaluating ``rule`` on the ids."""
    qi, ki, same_doc = _prepare(q, k, rule)
    lq, lk = qi.shape[1], ki.shape[1]

    def mod(b, h, q_idx, kv_idx):
        # Clamped: compiled kernels may probe padded indices of a partial last block (then discarded).
        qx, kx = q_idx.clamp(max=lq - 1), kv_idx.clamp(max=lk - 1)
        return _allowed(
            rule, same_doc, tuple(qi[r][qx] for r in range(4)), tuple(ki[r][kx] for r in range(4))
        )

    return mod


def flex_block_mask(q: TokenIds, k: TokenIds, rule: str, q_block: int = 128, k_block: int = 128):
    """A ``torch.nn.attention.flex_attention.BlockMask`` (batch and heads broadcast) for ``rule``."""
    from torch.nn.attention.flex_attention import BlockMask

    status = block_mask_status(q, k, rule, q_block, k_block)
    lq, lk = _check_ids("q", q, ())[0], _check_ids("k", k, ())[0]
    return BlockMask.from_kv_blocks(
        *flex_block_fields(status),
        BLOCK_SIZE=(q_block, k_block),
        mask_mod=mask_mod(q, k, rule),
        seq_lengths=(lq, lk),
    )
