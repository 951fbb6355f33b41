"""Mask oracles for tests: boolean masks (True = attend) written from each rule's definition.

Independent of ``megatron_video.attention.masks`` and ``megatron_video.ops`` (``mask_for`` only
builds the library's mask object for a kind, for the code under test).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = [
    "allowed",
    "mask_for",
    "teacher_forcing_allowed",
    "teacher_forcing_oracle",
    "rule_allows",
    "dense_rule_oracle",
    "tile_status_oracle",
    "rank_major_teacher_forcing_ids",
]

KINDS = (
    "full",
    "causal",
    "block_causal",
    "packed",
    "packed_causal",
    "packed_block",
    "window",
    "none",
)


def _doc_ids(ids: torch.Tensor, cu: Sequence[int], pad: int) -> torch.Tensor:
    doc = torch.searchsorted(torch.tensor(cu), ids, right=True) - 1
    doc[ids >= cu[-1]] = pad  # tokens past the last document are padding: attend nothing
    return doc


def allowed(
    kind: str,
    q,
    k=None,
    *,
    block: Optional[int] = None,
    cu: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    inner_block: Optional[int] = None,
) -> torch.Tensor:
    """Bool ``[len q, len k]`` for global ids ``q``, ``k`` (LongTensors; an int ``S`` means
    ``arange(S)``, and ``k`` defaults to ``q``). ``block``: block_causal's block; ``cu``: packed
    documents' boundaries; ``window``: causal sliding window; ``inner_block``: block_causal inside
    each document (``packed_block``, on document-relative positions)."""
    q = torch.arange(q) if isinstance(q, int) else q
    k = q if k is None else (torch.arange(k) if isinstance(k, int) else k)
    Q, K = q[:, None], k[None, :]
    if kind == "full":
        return torch.ones(len(q), len(k), dtype=torch.bool)
    if kind == "none":
        return torch.zeros(len(q), len(k), dtype=torch.bool)
    if kind == "causal":
        return K <= Q
    if kind == "block_causal":
        return K // block <= Q // block
    if kind == "window":
        return (K <= Q) & (Q - K < window)
    if kind in ("packed", "packed_causal", "packed_block"):
        dq, dk = _doc_ids(q, cu, -1), _doc_ids(k, cu, -2)
        a = dq[:, None] == dk[None, :]
        if kind == "packed_causal":
            a &= K <= Q
        if kind == "packed_block":
            start = torch.tensor(cu)
            rq, rk = q - start[dq.clamp(min=0)], k - start[dk.clamp(min=0)]
            a &= rk[None, :] // inner_block <= rq[:, None] // inner_block
        return a
    raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")


def mask_for(kind: str, *, block=None, cu=None, window=None, inner_block=None):
    """The ``megatron_video.attention.masks`` object for ``kind`` (parameters as ``allowed``)."""
    from megatron_video.attention import masks

    if kind == "full":
        return masks.full()
    if kind == "causal":
        return masks.causal()
    if kind == "block_causal":
        return masks.block_causal(block)
    if kind == "packed":
        return masks.packed(cu)
    if kind == "packed_causal":
        return masks.packed(cu, inner=masks.causal())
    if kind == "packed_block":
        return masks.packed(cu, inner=masks.block_causal(inner_block))
    if kind == "window":
        return masks.predicate(lambda q, k: (k <= q) & (q - k < window))
    if kind == "none":
        return masks.predicate(
            lambda q, k: torch.zeros(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool)
        )
    raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")


def teacher_forcing_allowed(side_q, block_q, side_k, block_k) -> torch.Tensor:
    """Teacher forcing on (side, block) ids (side 0 = clean, 1 = noisy): clean sees clean of its and
    earlier blocks, noisy sees clean of earlier blocks and noisy of its own block, clean never
    sees noisy."""
    sq, bq = side_q[:, None], block_q[:, None]
    sk, bk = side_k[None, :], block_k[None, :]
    return (
        ((sq == 0) & (sk == 0) & (bk <= bq))
        | ((sq == 1) & (sk == 0) & (bk < bq))
        | ((sq == 1) & (sk == 1) & (bk == bq))
    )


def teacher_forcing_oracle(F: int, S: int, nb: int) -> torch.Tensor:
    """Single-GPU ``[clean; noisy]`` teacher-forcing mask, ``2 F S`` square: ``F`` frames of ``S``
    tokens, ``nb`` frames per block."""
    i = torch.arange(2 * F * S)
    side, block = i // (F * S), (i % (F * S)) // S // nb
    return teacher_forcing_allowed(side, block, side, block)


def rule_allows(rule: str, same_doc: bool, q: dict, k: dict) -> bool:
    """One pair under an ``ops`` rule; ``q`` / ``k`` map id field names (doc, pos, block, side) to
    ints. With ``same_doc`` tokens of different documents never attend."""
    if same_doc and q["doc"] != k["doc"]:
        return False
    if rule == "causal":
        return k["pos"] <= q["pos"]
    if rule == "block_causal":
        return k["block"] <= q["block"]
    if rule == "teacher_forcing":
        pair = (q["side"], k["side"])
        if pair == (0, 0):
            return k["block"] <= q["block"]
        if pair == (1, 0):
            return k["block"] < q["block"]
        if pair == (1, 1):
            return k["block"] == q["block"]
        return False  # clean -> noisy
    return True


def _tokens(ids) -> list:
    given = {name: t.tolist() for name, t in ids.present().items()}
    n = len(next(iter(given.values())))
    return [{name: v[i] for name, v in given.items()} for i in range(n)]


def dense_rule_oracle(q, k, rule: str) -> torch.Tensor:
    """Bool ``[len q, len k]`` for ``ops.TokenIds`` ``q``, ``k``, pair by pair (``rule_allows``)."""
    same_doc = q.doc is not None
    tq, tk = _tokens(q), _tokens(k)
    return torch.tensor(
        [[rule_allows(rule, same_doc, a, b) for b in tk] for a in tq], dtype=torch.bool
    ).reshape(len(tq), len(tk))


def tile_status_oracle(mask: torch.Tensor, qb: int, kb: int) -> torch.Tensor:
    """uint8 per ``qb x kb`` tile (the last ones may be short): 2 all allowed, 1 some, 0 none."""
    nq, nk = -(-mask.shape[0] // qb), -(-mask.shape[1] // kb)
    out = torch.zeros(nq, nk, dtype=torch.uint8)
    for i in range(nq):
        for j in range(nk):
            tile = mask[i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
            out[i, j] = 2 if bool(tile.all()) else (1 if bool(tile.any()) else 0)
    return out


def rank_major_teacher_forcing_ids(P: int, F: int, S: int, nb: int):
    """Model-sized ``ops.TokenIds``: rank-major teacher forcing over ``P`` ranks, ``F`` frames of
    ``S`` tokens, ``nb`` frames per block (each rank's clean half, then its noisy half)."""
    from megatron_video.ops import TokenIds

    side, frame = [], []
    for r in range(P):
        fr = torch.arange(r * F // P, (r + 1) * F // P).repeat_interleave(S).tolist()
        side += [0] * len(fr) + [1] * len(fr)
        frame += fr * 2
    return TokenIds.from_frames(
        torch.tensor(frame), nb, side=torch.tensor(side), pos=torch.arange(len(side))
    )
