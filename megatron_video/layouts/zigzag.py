"""Sequence layouts for context parallelism: zigzag (causal balance), contiguous and explicit
placements (any token-to-rank map: ``layouts.placement.Placement``, e.g. packed clips), as pure,
rank-explicit index maps (``*_global_ids``, their inverse ``shard_owner``) and the tensor ops that
apply them (``shard_sequence`` / ``unshard_sequence``). Design: docs/architecture.md,
"Capabilities" 1.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..checks import check_dim, check_int

__all__ = [
    "SCHEMES",
    "as_placement",
    "check_seq_len",
    "zigzag_global_ids",
    "contiguous_global_ids",
    "shard_global_ids",
    "shard_owner",
    "concat_global_ids",
    "shard_sequence",
    "unshard_sequence",
    "global_token_ids",
]

SCHEMES = ("zigzag", "contiguous")


# What the functions below use of an explicit layout (``layouts.placement.Placement``, which is
# built from these schemes and so cannot be imported here).
_EXPLICIT_LAYOUT = ("cp_size", "seq_len", "rank_ids", "owner")


def as_placement(scheme):
    """``scheme`` if it is an explicit layout (a ``layouts.placement.Placement``), else None."""
    if isinstance(scheme, str):
        return None
    return scheme if all(hasattr(scheme, a) for a in _EXPLICIT_LAYOUT) else None


def check_seq_len(seq_len: int, cp_size: int, scheme) -> None:
    """Raise ``ValueError`` unless ``seq_len`` can be laid out over ``cp_size`` ranks by ``scheme``
    (a name of ``SCHEMES`` or a ``Placement`` over exactly these ranks and tokens)."""
    placement = as_placement(scheme)
    if placement is not None:
        if placement.cp_size != cp_size or placement.seq_len != seq_len:
            raise ValueError(
                f"scheme ({placement!r}) must place seq_len ({seq_len}) tokens over cp_size "
                f"({cp_size}) ranks"
            )
        return
    if scheme not in SCHEMES:
        raise ValueError(f"scheme ({scheme!r}) must be one of {SCHEMES}")
    check_int("cp_size", cp_size, 1)
    check_int("seq_len", seq_len, 0)
    parts = 2 * cp_size if scheme == "zigzag" else cp_size
    if seq_len % parts:
        rule = f"2 * cp_size ({2 * cp_size})" if scheme == "zigzag" else f"cp_size ({cp_size})"
        raise ValueError(f"seq_len ({seq_len}) must be divisible by {rule} for scheme {scheme!r}")


def _check_rank(cp_rank: int, cp_size: int) -> None:
    check_int("cp_size", cp_size, 1)
    check_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must be < cp_size ({cp_size})")


def zigzag_global_ids(cp_rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """Global token indices held by CP rank ``cp_rank``: chunks ``c`` and ``2N-1-c`` of ``2N``."""
    _check_rank(cp_rank, cp_size)
    check_seq_len(seq_len, cp_size, "zigzag")
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange(late * c, (late + 1) * c)]
    )


def contiguous_global_ids(cp_rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """Global token indices held by CP rank ``cp_rank``: ``[c*S/N, (c+1)*S/N)``."""
    _check_rank(cp_rank, cp_size)
    check_seq_len(seq_len, cp_size, "contiguous")
    n = seq_len // cp_size
    return torch.arange(cp_rank * n, (cp_rank + 1) * n)


def shard_global_ids(
    cp_rank: int, cp_size: int, seq_len: int, scheme: str = "zigzag"
) -> torch.Tensor:
    """Local index -> global index map of CP rank ``cp_rank`` (a LongTensor of length S/N).

    A sequence of ``seq_len`` tokens is split over ``cp_size`` CP ranks (CP index ``c`` as in
    ``parallel.topology``). ``"contiguous"``: rank ``c`` holds tokens ``[c*S/N, (c+1)*S/N)``.
    ``"zigzag"``: the sequence is cut into ``2N`` chunks; rank ``c`` holds chunk ``c`` followed by
    chunk ``2N-1-c`` (the layout Megatron's ``get_batch_on_this_cp_rank`` produces), so every rank
    gets the same causal work. A ``layouts.placement.Placement`` gives its own rows (packed clips
    placed by ``plan_placement``). Nothing is recorded: the consumer of a layout
    (``attention.dist_attention(..., scheme=...)``) is told the scheme explicitly.
    """
    check_seq_len(seq_len, cp_size, scheme)
    placement = as_placement(scheme)
    if placement is not None:
        return placement.rank_ids(cp_rank)
    fn = zigzag_global_ids if scheme == "zigzag" else contiguous_global_ids
    return fn(cp_rank, cp_size, seq_len)


def shard_owner(
    global_ids: torch.Tensor, cp_size: int, seq_len: int, scheme: str = "zigzag"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse map: global indices -> ``(cp_rank, local_index)`` (elementwise LongTensors)."""
    check_seq_len(seq_len, cp_size, scheme)
    g = torch.as_tensor(global_ids, dtype=torch.long)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= seq_len):
        raise ValueError(f"global_ids must lie in [0, seq_len) = [0, {seq_len})")
    placement = as_placement(scheme)
    if placement is not None:
        rank, local = placement.owner()
        return rank[g], local[g]
    if scheme == "contiguous":
        n = seq_len // cp_size
        return g // n, g % n
    c = seq_len // (2 * cp_size)
    chunk = g // c
    early = chunk < cp_size
    rank = torch.where(early, chunk, 2 * cp_size - 1 - chunk)
    local = torch.where(early, g % c, c + g % c)
    return rank, local


def concat_global_ids(
    cp_ranks: Sequence[int], cp_size: int, seq_len: int, scheme: str = "zigzag"
) -> torch.Tensor:
    """Global indices of the concatenation of the shards of ``cp_ranks`` (in that order).

    This is what an all-to-all that gathers the sequence over a group produces.
    """
    return torch.cat([shard_global_ids(c, cp_size, seq_len, scheme) for c in cp_ranks])


def _rank_and_size(groups, cp_rank: Optional[int], cp_size: Optional[int]) -> Tuple[int, int]:
    if groups is not None:
        return groups.cp_rank, groups.cp_size
    if cp_rank is None or cp_size is None:
        raise ValueError("pass either groups (a VideoParallelGroups) or both cp_rank and cp_size")
    return cp_rank, cp_size


def shard_sequence(
    x: torch.Tensor,
    groups=None,
    dim: int = 1,
    scheme: str = "zigzag",
    *,
    cp_rank: Optional[int] = None,
    cp_size: Optional[int] = None,
) -> torch.Tensor:
    """This CP rank's shard of the full sequence ``x`` along ``dim`` (autograd-friendly copy).

    The rank comes from ``groups`` (``groups.cp_rank``, ``groups.cp_size``) or from the explicit
    ``cp_rank`` / ``cp_size``; no communication and no state: pass the same ``scheme`` to
    ``attention.dist_attention``.
    """
    rank, size = _rank_and_size(groups, cp_rank, cp_size)
    dim = check_dim("dim", dim, x)
    ids = shard_global_ids(rank, size, x.shape[dim], scheme).to(x.device)
    return x.index_select(dim, ids)


def unshard_sequence(
    shards: Sequence[torch.Tensor], dim: int = 1, scheme: str = "zigzag"
) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full sequence from every CP rank's shard (in CP order)."""
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per CP rank (got 0)")
    n = len(shards)
    dim = check_dim("dim", dim, shards[0])
    if len({tuple(s.shape) for s in shards}) != 1:
        raise ValueError(
            f"shards must all have the same shape (got {[tuple(s.shape) for s in shards]})"
        )
    seq_len = shards[0].shape[dim] * n
    cat = torch.cat(list(shards), dim=dim)  # position p holds global id concat_ids[p]
    concat_ids = concat_global_ids(range(n), n, seq_len, scheme)
    inverse = torch.argsort(concat_ids).to(cat.device)
    return cat.index_select(dim, inverse)


def global_token_ids(
    groups=None,
    seq_len: int = 0,
    scheme: str = "zigzag",
    *,
    cp_rank: Optional[int] = None,
    cp_size: Optional[int] = None,
) -> torch.Tensor:
    """Global token indices of this rank's shard (for RoPE positions, labels and masks).

    ``seq_len`` is the global sequence length.
    """
    rank, size = _rank_and_size(groups, cp_rank, cp_size)
    return shard_global_ids(rank, size, seq_len, scheme)
