"""Attention masks as functions of GLOBAL token indices.

A mask answers "may query token ``q`` attend to key token ``k``?" for global indices in the attention
sequence, so every ring step can build its block's mask from the global ids of its Q and KV shards,
whatever the layout. ``dense(q_ids, k_ids)`` gives the boolean block (True = attend);
``block_status`` classifies a block as ``EMPTY`` (skipped: no compute), ``PARTIAL`` or ``FULL``
(no mask needed). Subclass :class:`AttentionMask` (override ``dense`` and, if it can be done more
cheaply, ``block_status``) or wrap a function with :func:`predicate`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["EMPTY", "PARTIAL", "FULL", "AttentionMask", "full", "causal", "block_causal", "packed",
           "predicate"]

EMPTY, PARTIAL, FULL = 0, 1, 2


class AttentionMask:
    """Base class. ``default_scheme`` is the sequence layout that balances this mask's work;
    ``position_independent`` is True only when the mask ignores token positions (``full()``), so
    that any sequence layout gives the same attention."""

    default_scheme = "contiguous"
    position_independent = False

    def dense(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(q_ids), len(k_ids)]``; True where query ``q_ids[i]`` may attend ``k_ids[j]``."""
        raise NotImplementedError

    def block_status(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> int:
        """``EMPTY`` (0), ``PARTIAL`` (1) or ``FULL`` (2) for the block ``q_ids x k_ids``."""
        if q_ids.numel() == 0 or k_ids.numel() == 0:
            return EMPTY
        d = self.dense(q_ids, k_ids)
        if not bool(d.any()):
            return EMPTY
        return FULL if bool(d.all()) else PARTIAL


class _Full(AttentionMask):
    position_independent = True

    def dense(self, q_ids, k_ids):
        return torch.ones(len(q_ids), len(k_ids), dtype=torch.bool, device=q_ids.device)

    def block_status(self, q_ids, k_ids):
        return FULL if q_ids.numel() and k_ids.numel() else EMPTY

    def __repr__(self):
        return "full()"


def _monotone_status(q: torch.Tensor, k: torch.Tensor) -> int:
    """Status of ``k <= q`` from extremes alone (exact for any order of ids)."""
    if q.numel() == 0 or k.numel() == 0:
        return EMPTY
    if int(k.min()) > int(q.max()):
        return EMPTY
    return FULL if int(k.max()) <= int(q.min()) else PARTIAL


class _Causal(AttentionMask):
    default_scheme = "zigzag"

    def dense(self, q_ids, k_ids):
        return k_ids[None, :] <= q_ids[:, None]

    def block_status(self, q_ids, k_ids):
        return _monotone_status(q_ids, k_ids)

    def __repr__(self):
        return "causal()"


class _BlockCausal(AttentionMask):
    default_scheme = "zigzag"

    def __init__(self, block_tokens: int):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens ({block_tokens!r}) must be a positive integer")
        self.block_tokens = block_tokens

    def dense(self, q_ids, k_ids):
        b = self.block_tokens
        return (k_ids // b)[None, :] <= (q_ids // b)[:, None]

    def block_status(self, q_ids, k_ids):
        return _monotone_status(q_ids // self.block_tokens, k_ids // self.block_tokens)

    def __repr__(self):
        return f"block_causal({self.block_tokens})"


class _Packed(AttentionMask):
    def __init__(self, cu_seqlens, inner: Optional[AttentionMask] = None):
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError(f"cu_seqlens ({cu_seqlens!r}) must be a 1-D integer sequence of at "
                             f"least 2 offsets")
        cu = cu.long().cpu()
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens ({cu.tolist()}) must start at 0 and be non-decreasing")
        if inner is not None and not isinstance(inner, AttentionMask):
            raise ValueError(f"inner ({inner!r}) must be an AttentionMask or None")
        self.cu_seqlens = cu
        self.inner = inner
        # Causal-like inner masks inherit the zigzag balance.
        self.default_scheme = inner.default_scheme if inner is not None else "contiguous"

    def _doc(self, ids):
        """Document of each id; ``-1`` for padding past ``cu_seqlens[-1]`` (never attends/attended)."""
        cu = self.cu_seqlens.to(ids.device)
        doc = torch.searchsorted(cu, ids, right=True) - 1
        return torch.where(ids < cu[-1], doc, torch.full_like(doc, -1)), cu

    def dense(self, q_ids, k_ids):
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
        return f"packed({self.cu_seqlens.tolist()}, inner={self.inner!r})"


class _Predicate(AttentionMask):
    def __init__(self, fn: Callable, default_scheme: str = "contiguous"):
        if not callable(fn):
            raise ValueError(f"fn ({fn!r}) must be callable as fn(q_idx [sq,1], k_idx [1,sk]) -> bool")
        if default_scheme not in ("zigzag", "contiguous"):
            raise ValueError(f"default_scheme ({default_scheme!r}) must be 'zigzag' or 'contiguous'")
        self.fn = fn
        self.default_scheme = default_scheme

    def dense(self, q_ids, k_ids):
        m = self.fn(q_ids[:, None], k_ids[None, :])
        shape = (len(q_ids), len(k_ids))
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise ValueError(f"predicate fn must return a bool tensor (got "
                             f"{type(m).__name__} {getattr(m, 'dtype', '')})")
        return m.expand(shape)

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
