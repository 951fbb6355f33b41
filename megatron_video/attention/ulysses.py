"""Ulysses (head-parallel) all-to-all: scatter heads / gather sequence, and back.

GQA: the ``H`` query heads must divide by the group size ``U``. K/V heads are either split
(``H_kv % U == 0``: rank ``u`` gets kv heads ``[u*H_kv/U, (u+1)*H_kv/U)``, matching its query
heads) or, when ``U % H_kv == 0``, replicated to ``U`` heads before the all-to-all so that rank
``u`` gets kv head ``u // (U/H_kv)`` (the one its query heads use); autograd sums the replicas'
gradients. Anything else raises ``ValueError`` (checked before any collective by the caller).
"""
from __future__ import annotations

import torch

from ..parallel.comm import all_to_all

__all__ = ["check_heads", "kv_heads_for_a2a", "seq_to_heads", "heads_to_seq", "prepare_kv"]


def check_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> None:
    """Raise ``ValueError`` unless the head counts work with a Ulysses group of ``ulysses_size``."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if num_heads % ulysses_size:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by ulysses_size ({ulysses_size})")
    if num_kv_heads % ulysses_size and ulysses_size % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide or be divisible by ulysses_size "
                         f"({ulysses_size}) (split or replicated GQA kv heads)")


def kv_heads_for_a2a(num_kv_heads: int, ulysses_size: int) -> int:
    """KV heads that enter the all-to-all: ``H_kv`` when split, ``U`` when replicated."""
    return num_kv_heads if num_kv_heads % ulysses_size == 0 else ulysses_size


def prepare_kv(x: torch.Tensor, ulysses_size: int) -> torch.Tensor:
    """Replicate kv heads to ``U`` when ``U % H_kv == 0`` and ``H_kv < U`` (else unchanged)."""
    h_kv = x.shape[2]
    rep = kv_heads_for_a2a(h_kv, ulysses_size) // h_kv
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def seq_to_heads(x: torch.Tensor, group, tag: str = "ulysses") -> torch.Tensor:
    """``[b, s_local, h, d] -> [b, U*s_local, h/U, d]`` (concatenated in group-rank order)."""
    return all_to_all(x, group, scatter_dim=2, gather_dim=1, tag=tag)


def heads_to_seq(x: torch.Tensor, group, tag: str = "ulysses") -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``[b, U*s_local, h/U, d] -> [b, s_local, h, d]``."""
    return all_to_all(x, group, scatter_dim=1, gather_dim=2, tag=tag)
