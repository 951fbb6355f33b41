"""Attention masks as immutable functions of GLOBAL token indices (the engine plans on them).

A mask answers "may query ``q`` attend key ``k``?" for global ids, per tile: ``tile_status``
(EMPTY / PARTIAL / FULL grid; C++ kernels for :class:`RuleMask`), ``dense``, ``lower_triangle``.
Masks are values: frozen after construction, equal and hashed by their content (identity for
subclasses that do not define ``_value``), so a mask keys the plan cache (``attention.plans``).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..ops import masks as _ops
from ..ops.rules import EMPTY, FULL, PARTIAL

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "AttentionMask",
    "RuleMask",
    "full",
    "causal",
    "block_causal",
    "packed",
    "predicate",
    "from_dense",
    "VideoRows",
    "video_rows",
    "is_lower_triangle",
]


def is_lower_triangle(m: torch.Tensor) -> bool:
    """True iff the bool tile ``m`` is square and exactly its lower triangle (``j <= i``)."""
    n = m.shape[0]
    return m.shape[1] == n and torch.equal(
        m, torch.ones(n, n, dtype=torch.bool, device=m.device).tril()
    )


def _gather_mod(fn: Callable, q_cols, k_cols) -> Callable:
    """``mask_mod(b, h, qi, ki) = fn(*(c[qi] for c in q_cols), *(c[ki] for c in k_cols))`` with
    clamped scalar gathers only (Inductor's flex lowering rejects reshapes of gathered values)."""
    lq, lk = int(q_cols[0].shape[0]), int(k_cols[0].shape[0])

    def mod(b, h, qi, ki):
        qx, kx = qi.clamp(max=lq - 1), ki.clamp(max=lk - 1)
        return fn(*(c[qx] for c in q_cols), *(c[kx] for c in k_cols))

    return mod


def _tile_edges(n: int, tile: int):
    return [(a, min(a + tile, n)) for a in range(0, n, tile)]


class _Frozen(type):
    """Metaclass: an instance is frozen once its constructor returns (masks are values)."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        object.__setattr__(obj, "_frozen", True)
        return obj


class AttentionMask(metaclass=_Frozen):
    """Base class. ``default_scheme`` is the sequence layout that balances this mask's work;
    ``position_independent`` is True only when the mask ignores token positions (``full()``), so
    that any sequence layout gives the same attention.

    Instances are immutable once constructed (setting an attribute raises ``AttributeError``): a
    plan built for a mask stays right. ``_value()`` (None: identity) is the content that equality
    and hashing use; a subclass whose verdicts depend on state must keep that state unchanged.
    """

    default_scheme = "contiguous"
    position_independent = False
    tile_hint = None  # ids per block on which the verdict is constant (aligns the engine's tiles)

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"{self!r}.{name}: masks are immutable values (they key the plan "
                f"cache); build a new mask instead"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"{self!r}.{name}: masks are immutable values")
        object.__delattr__(self, name)

    def _value(self) -> Optional[Tuple]:
        """Hashable content that determines every verdict, or None (compare by identity)."""
        return None

    def __eq__(self, other):
        if self is other:
            return True
        mine = self._value()
        if mine is None or type(other) is not type(self):
            return False
        return mine == other._value()

    def __hash__(self):
        mine = self._value()
        return object.__hash__(self) if mine is None else hash((type(self).__qualname__, mine))

    def dense(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(q_ids), len(k_ids)]``; True where query ``q_ids[i]`` may attend ``k_ids[j]``."""
        raise NotImplementedError

    def block_status(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> int:
        """``EMPTY`` (0), ``PARTIAL`` (1) or ``FULL`` (2) for ONE tile ``q_ids x k_ids``."""
        if q_ids.numel() == 0 or k_ids.numel() == 0:
            return EMPTY
        d = self.dense(q_ids, k_ids)
        if not bool(d.any()):
            return EMPTY
        return FULL if bool(d.all()) else PARTIAL

    def tile_status(
        self, q_ids: torch.Tensor, k_ids: torch.Tensor, q_tile: int, k_tile: int
    ) -> torch.Tensor:
        """uint8 ``[ceil(len(q_ids)/q_tile), ceil(len(k_ids)/k_tile)]`` of tile verdicts (one tile
        at a time)."""
        qe, ke = _tile_edges(q_ids.numel(), q_tile), _tile_edges(k_ids.numel(), k_tile)
        out = torch.empty(len(qe), len(ke), dtype=torch.uint8)
        for i, (a, b) in enumerate(qe):
            for j, (c, d) in enumerate(ke):
                out[i, j] = self.block_status(q_ids[a:b], k_ids[c:d])
        return out

    def lower_triangle(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> bool:
        """True only if the tile ``q_ids x k_ids`` is exactly the lower triangle of its positions
        (query ``i`` attends key ``j`` iff ``j <= i``): the fused kernels' causal flag then replaces
        the tile's mask. False may be conservative (the tile's mask is passed instead). Default: the
        tile's dense form (one tile, as the engine calls it)."""
        if q_ids.numel() == 0 or k_ids.numel() != q_ids.numel():
            return False
        return is_lower_triangle(self.dense(q_ids, k_ids))

    def tile_starts(self) -> Optional[torch.Tensor]:
        """Sorted ids at which the engine starts a new tile (a run of consecutive ids is cut
        there), so that tiles do not straddle a boundary of the mask's structure; None: none."""
        return None

    def keys_needed(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Bool ``[len(k_ids)]``: keys that some query of ``q_ids`` may attend (a superset is
        fine), or None for "all of them" (the default). Ring attention sends only these keys
        to a ring rank holding ``q_ids``."""
        return None

    def pair(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Elementwise verdict on broadcastable global id tensors (FlexAttention's ``mask_mod``
        traces it on scalars: gathers and elementwise ops only, no reshape). Subclasses that run
        on FlexAttention define it; the engine takes the fused SDPA kernels for masks that do not."""
        raise NotImplementedError(f"{type(self).__name__}.pair (FlexAttention needs it)")

    @property
    def has_pair(self) -> bool:
        """True when the mask defines ``pair`` (or its own ``mask_mod``): FlexAttention can run it."""
        t = type(self)
        return t.pair is not AttentionMask.pair or t.mask_mod is not AttentionMask.mask_mod

    def mask_mod(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> Callable:
        """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over positions of ``q_ids`` / ``k_ids``:
        scalar gathers of the ids (indices clamped: compiled kernels may probe a partial last
        block's padding, then discard it) into ``pair``."""
        return _gather_mod(self.pair, (q_ids,), (k_ids,))


class RuleMask(AttentionMask):
    """A mask given by an ``ops`` rule on token identities derived from global ids.

    Subclasses set ``rule`` (a key of ``ops.RULES``) and implement ``identities(ids, role)`` ->
    ``ops.TokenIds`` for ``role`` ``"q"`` or ``"k"`` (with ``doc`` on both sides or neither).
    """

    rule = "full"

    def identities(self, ids: torch.Tensor, role: str) -> "_ops.TokenIds":
        raise NotImplementedError

    def _ids(self, q_ids, k_ids):
        return self.identities(q_ids.long(), "q"), self.identities(k_ids.long(), "k")

    def dense(self, q_ids, k_ids):
        return _ops.dense_mask(*self._ids(q_ids, k_ids), self.rule)

    def block_status(self, q_ids, k_ids):
        if q_ids.numel() == 0 or k_ids.numel() == 0:
            return EMPTY
        return int(self.tile_status(q_ids, k_ids, q_ids.numel(), k_ids.numel())[0, 0])

    def tile_status(self, q_ids, k_ids, q_tile, k_tile):
        return _ops.block_mask_status(*self._ids(q_ids, k_ids), self.rule, q_tile, k_tile)

    def lower_triangle(self, q_ids, k_ids):
        # O(len) on identities, no tile mask (``ops.lower_triangle``)
        if q_ids.numel() == 0 or q_ids.numel() != k_ids.numel():
            return False
        return _ops.lower_triangle(*self._ids(q_ids, k_ids), self.rule)

    def mask_mod(self, q_ids, k_ids):
        return _ops.mask_mod(*self._ids(q_ids, k_ids), self.rule)


class _Full(RuleMask):
    position_independent = True
    rule = "full"

    def identities(self, ids, role):
        return _ops.TokenIds(pos=ids)

    def dense(self, q_ids, k_ids):
        return torch.ones(len(q_ids), len(k_ids), dtype=torch.bool, device=q_ids.device)

    def tile_status(self, q_ids, k_ids, q_tile, k_tile):
        return torch.full(
            (-(-q_ids.numel() // q_tile), -(-k_ids.numel() // k_tile)), FULL, dtype=torch.uint8
        )

    def _value(self):
        return ()

    def __repr__(self):
        return "full()"


class _Causal(RuleMask):
    default_scheme = "zigzag"
    rule = "causal"

    def identities(self, ids, role):
        return _ops.TokenIds(pos=ids)

    def _value(self):
        return ()

    def __repr__(self):
        return "causal()"


class _BlockCausal(RuleMask):
    default_scheme = "zigzag"

    def __init__(self, block_tokens: int):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens ({block_tokens!r}) must be a positive integer")
        self.block_tokens = block_tokens
        self.tile_hint = block_tokens

    rule = "block_causal"

    def identities(self, ids, role):
        return _ops.TokenIds(block=torch.div(ids, self.block_tokens, rounding_mode="floor"))

    def _value(self):
        return (self.block_tokens,)

    def __repr__(self):
        return f"block_causal({self.block_tokens})"


class _Packed(RuleMask):
    def __init__(self, cu_seqlens, inner: Optional[AttentionMask] = None):
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError(
                f"cu_seqlens ({cu_seqlens!r}) must be a 1-D integer sequence of at least 2 offsets"
            )
        cu = cu.long().cpu().clone()  # its own copy: the caller may change theirs
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens ({cu.tolist()}) must start at 0 and be non-decreasing")
        if inner is not None and not isinstance(inner, AttentionMask):
            raise ValueError(f"inner ({inner!r}) must be an AttentionMask or None")
        self._cu = tuple(cu.tolist())  # the content (hashable); the tensor below is private
        self._cu_t = cu
        self.inner = inner
        # Causal-like inner masks inherit the zigzag balance.
        self.default_scheme = inner.default_scheme if inner is not None else "contiguous"
        # Inner masks that are rules become one rule with documents (C++ tile status); any other
        # inner mask is evaluated one tile at a time.
        self.rule = (
            "full"
            if inner is None
            else "causal"
            if isinstance(inner, _Causal)
            else "block_causal"
            if isinstance(inner, _BlockCausal)
            else None
        )

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The document offsets (a copy: the mask's own cannot be changed)."""
        return self._cu_t.clone()

    def _value(self):
        return (self._cu, self.inner)

    def _doc(self, ids):
        """Document of each id; ``-1`` for padding past ``cu_seqlens[-1]`` (never attends/attended)."""
        cu = self._cu_t.to(ids.device)
        doc = torch.searchsorted(cu, ids, right=True) - 1
        return torch.where(ids < cu[-1], doc, torch.full_like(doc, -1)), cu

    def identities(self, ids, role):
        doc, cu = self._doc(ids)
        # padding (doc -1) must match nothing, not even other padding: -1 for queries, -2 for keys
        doc = torch.where(doc >= 0, doc, torch.full_like(doc, -1 if role == "q" else -2))
        rel = ids - cu[doc.clamp(min=0)]  # document-relative position
        if self.rule == "block_causal":
            return _ops.TokenIds(
                doc=doc, block=torch.div(rel, self.inner.block_tokens, rounding_mode="floor")
            )
        return _ops.TokenIds(doc=doc, pos=rel)

    def tile_starts(self):
        """Every document's first id (and the padding's): no tile holds two documents, so a
        full document's tiles are FULL, not masked."""
        return self._cu_t[1:]

    def keys_needed(self, q_ids, k_ids):
        """Keys of the documents the queries are in (padding attends nothing)."""
        dq, _ = self._doc(q_ids)
        dk, _ = self._doc(k_ids)
        return torch.isin(dk, dq[dq >= 0])

    def tile_status(self, q_ids, k_ids, q_tile, k_tile):
        if self.rule is None:
            return AttentionMask.tile_status(self, q_ids, k_ids, q_tile, k_tile)
        return RuleMask.tile_status(self, q_ids, k_ids, q_tile, k_tile)

    def block_status(self, q_ids, k_ids):
        if self.rule is None:
            return AttentionMask.block_status(self, q_ids, k_ids)
        return RuleMask.block_status(self, q_ids, k_ids)

    def mask_mod(self, q_ids, k_ids):
        if self.rule is not None:
            return RuleMask.mask_mod(self, q_ids, k_ids)
        (dq, cu), (dk, _) = self._doc(q_ids), self._doc(k_ids)
        q_rel, k_rel = q_ids - cu[dq.clamp(min=0)], k_ids - cu[dk.clamp(min=0)]
        inner = self.inner.pair if self.inner is not None else None

        def fn(dq_, rq, dk_, rk):
            m = (dq_ == dk_) & (dq_ >= 0)
            return m if inner is None else m & inner(rq, rk)

        return _gather_mod(fn, (dq, q_rel), (dk, k_rel))

    @property
    def has_pair(self) -> bool:
        return self.inner is None or self.rule is not None or self.inner.has_pair

    def lower_triangle(self, q_ids, k_ids):
        if self.rule is None:
            return AttentionMask.lower_triangle(self, q_ids, k_ids)
        return RuleMask.lower_triangle(self, q_ids, k_ids)

    def dense(self, q_ids, k_ids):
        if self.rule is not None:
            return RuleMask.dense(self, q_ids, k_ids)
        dq, cu = self._doc(q_ids)
        dk, _ = self._doc(k_ids)
        m = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
        if self.inner is not None:
            # The inner mask sees document-relative positions (e.g. block_causal restarts per doc).
            q_rel = q_ids - cu[dq.clamp(min=0)]
            k_rel = k_ids - cu[dk.clamp(min=0)]
            m = m & self.inner.dense(q_rel, k_rel)
        return m

    def __repr__(self):
        return f"packed({list(self._cu)}, inner={self.inner!r})"


class _Predicate(AttentionMask):
    def __init__(self, fn: Callable, default_scheme: str = "contiguous"):
        if not callable(fn):
            raise ValueError(
                f"fn ({fn!r}) must be callable as fn(q_idx [sq,1], k_idx [1,sk]) -> bool"
            )
        if default_scheme not in ("zigzag", "contiguous"):
            raise ValueError(
                f"default_scheme ({default_scheme!r}) must be 'zigzag' or 'contiguous'"
            )
        self.fn = fn
        self.default_scheme = default_scheme

    def dense(self, q_ids, k_ids):
        m = self.fn(q_ids[:, None], k_ids[None, :])
        shape = (len(q_ids), len(k_ids))
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise ValueError(
                f"predicate fn must return a bool tensor (got "
                f"{type(m).__name__} {getattr(m, 'dtype', '')})"
            )
        return m.expand(shape)

    def pair(self, q, k):
        return self.fn(q, k)

    def _value(self):
        return (self.fn, self.default_scheme)  # fn by identity: it must be a pure function

    def __repr__(self):
        return f"predicate({getattr(self.fn, '__name__', self.fn)!r})"


def full() -> AttentionMask:
    """Every query attends every key."""
    return _Full()


def causal() -> AttentionMask:
    """Query ``q`` attends keys ``k <= q``."""
    return _Causal()


def block_causal(block_tokens: int) -> AttentionMask:
    """Attend all keys of the same or an earlier block of ``block_tokens`` tokens (e.g. a frame)."""
    return _BlockCausal(block_tokens)


def packed(cu_seqlens, inner: Optional[AttentionMask] = None) -> AttentionMask:
    """Documents ``[cu[i], cu[i+1])`` packed in one sequence attend only within themselves.

    ``inner`` (optional) is applied within each document on document-relative positions. Tokens at
    or past ``cu_seqlens[-1]`` are padding: they attend nothing (zero output) and are never attended.
    """
    return _Packed(cu_seqlens, inner)


def predicate(fn: Callable, default_scheme: str = "contiguous") -> AttentionMask:
    """Any mask given as ``fn(q_idx [sq,1], k_idx [1,sk]) -> bool [sq,sk]`` on global indices."""
    return _Predicate(fn, default_scheme)


class VideoRows(AttentionMask):
    """Attention within rows of a frame-major video token sequence (``positions`` tokens a frame):
    ``"spatial"`` = same frame, ``"temporal"`` = same spatial position (global token ids). A core
    attention that sees the whole sequence (all-to-all) may cut the rows instead of masking."""

    def __init__(self, positions: int, pattern: str):
        if not isinstance(positions, int) or positions < 1:
            raise ValueError(f"positions ({positions!r}) must be a positive int")
        if pattern not in ("spatial", "temporal"):
            raise ValueError(f"pattern ({pattern!r}) must be 'spatial' or 'temporal'")
        self.positions, self.pattern = positions, pattern

    def dense(self, q_ids, k_ids):
        n = self.positions
        q, k = q_ids.reshape(-1, 1), k_ids.reshape(1, -1)
        return (q // n == k // n) if self.pattern == "spatial" else (q % n == k % n)

    def pair(self, q, k):
        n = self.positions
        return (q // n == k // n) if self.pattern == "spatial" else (q % n == k % n)

    def _value(self):
        return (self.positions, self.pattern)

    def __repr__(self):
        return f"video_rows({self.positions}, {self.pattern!r})"


def video_rows(positions: int, pattern: str) -> VideoRows:
    """Same-frame (``"spatial"``) or same-position (``"temporal"``) attention of a video sequence."""
    return VideoRows(positions, pattern)


class _Dense(AttentionMask):
    def __init__(self, table: torch.Tensor, copy: bool = True):
        if not isinstance(table, torch.Tensor) or table.dtype != torch.bool or table.dim() != 2:
            raise ValueError(
                f"table ({getattr(table, 'dtype', type(table).__name__)} "
                f"{tuple(getattr(table, 'shape', ()))}) must be a 2-D bool tensor [sq, sk]"
            )
        # a private copy (the caller's table may change, this one not); ``copy=False`` only for a
        # mask that lives for one call (``engine.local_attention``)
        self._table = table.clone() if copy else table

    def dense(self, q_ids, k_ids):
        t = self._table
        return t[q_ids.to(t.device)][:, k_ids.to(t.device)].to(q_ids.device)

    def mask_mod(self, q_ids, k_ids):
        t = self._table.to(q_ids.device)
        return _gather_mod(lambda q, k: t[q, k], (q_ids,), (k_ids,))

    def __repr__(self):
        return f"from_dense({tuple(self._table.shape)})"


def from_dense(table: torch.Tensor, copy: bool = True) -> AttentionMask:
    """A mask read from a bool ``[sq, sk]`` table (True = attend) one tile at a time; it keeps a
    copy of ``table`` (``copy=False``: the caller's own, which must then not change)."""
    return _Dense(table, copy)
