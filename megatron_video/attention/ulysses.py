"""Ulysses (head-parallel) all-to-all: scatter heads / gather sequence, and back.

GQA with any head counts: kv heads enter the all-to-all as ``lcm(H_kv, U)`` heads (each repeated
``lcm / H_kv`` times when ``U`` does not divide ``H_kv``); autograd sums the replicas' gradients.
"""

from __future__ import annotations

import math

import torch

from ..parallel.comm import all_to_all

__all__ = ["check_heads", "kv_heads_for_a2a", "seq_to_heads", "heads_to_seq", "prepare_kv"]


def check_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> None:
    """Raise ``ValueError`` unless the head counts work with a Ulysses group of ``ulysses_size``."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    if num_heads % ulysses_size:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by ulysses_size ({ulysses_size})"
        )


def kv_heads_for_a2a(num_kv_heads: int, ulysses_size: int) -> int:
    """KV heads that enter the all-to-all: ``lcm(H_kv, U)`` (``H_kv`` when ``U`` divides it)."""
    return num_kv_heads * ulysses_size // math.gcd(num_kv_heads, ulysses_size)


def prepare_kv(x: torch.Tensor, ulysses_size: int) -> torch.Tensor:
    """Repeat each kv head ``lcm(H_kv, U) / H_kv`` times (unchanged when ``U`` divides ``H_kv``)."""
    h_kv = x.shape[2]
    rep = kv_heads_for_a2a(h_kv, ulysses_size) // h_kv
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def seq_to_heads(x: torch.Tensor, group, tag: str = "ulysses", order=None) -> torch.Tensor:
    """``[b, s_local, h, d] -> [b, U*s_local, h/U, d]`` (concatenated in group-rank order).

    ``order`` (optional, 1-D): the gathered sequence is returned as ``gathered[:, order]`` (e.g.
    sorted by global id), the permutation riding on the all-to-all's unpacking copy."""
    return all_to_all(x, group, scatter_dim=2, gather_dim=1, tag=tag, gather_index=order)


def heads_to_seq(
    x: torch.Tensor, group, tag: str = "ulysses", order=None, inverse=None
) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``[b, U*s_local, h/U, d] -> [b, s_local, h, d]``; with the
    same ``order``, ``x`` is in that order (it is undone on the packing copy; ``inverse`` =
    ``argsort(order)`` if the caller has it)."""
    if inverse is None and order is not None:
        inverse = torch.argsort(order)
    return all_to_all(x, group, scatter_dim=1, gather_dim=2, tag=tag, scatter_index=inverse)
