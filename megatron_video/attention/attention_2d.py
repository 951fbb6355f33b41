"""2D context-parallel attention: Ulysses all-to-all (inside a node) x P2P ring (across nodes).

``dist_attention`` = all-to-all (scatter heads, gather the sequence sorted by global id) -> exact
ring attention (``attention.ring``) -> inverse all-to-all. The layout is explicit (``scheme=``); the
plans it implies are built once and kept (``attention.plans``). Map: ``docs/architecture.md``.
"""

from __future__ import annotations

import functools
from numbers import Real
from typing import List, Optional, Sequence, Tuple

import torch

from ..layouts.zigzag import SCHEMES, as_placement, check_seq_len, concat_global_ids
from ..parallel.comm import check_same_shape
from ..parallel.topology import local_groups
from . import engine, kernels
from .masks import AttentionMask
from .plans import PlanCache
from .ring import RingPlan, RingStats, ring_attention
from .ulysses import check_heads, heads_to_seq, prepare_kv, seq_to_heads

__all__ = ["dist_attention", "ring_token_ids", "resolve_scheme"]


def resolve_scheme(mask: Optional[AttentionMask], scheme, groups=None):
    """The sequence layout ``dist_attention`` assumes for its inputs: ``scheme`` when given (a
    name of ``SCHEMES`` or a ``layouts.placement.Placement``).

    ``scheme=None`` is accepted only where the layout cannot change the result: one CP rank
    (``groups`` None or ``cp_size == 1``: every layout is the identity) or a mask that ignores
    positions (None or ``masks.full()``); then ``"contiguous"`` is used. Otherwise ``ValueError``:
    the layout cannot be read off the data, and a mask on global token indices would be silently
    wrong under a guessed one (``mask.default_scheme`` is only the layout that balances the mask).
    """
    if mask is not None and not isinstance(mask, AttentionMask):
        raise ValueError(
            f"mask ({type(mask).__name__}) must be None or a megatron_video.attention."
            f"masks.AttentionMask (build one with masks.full/causal/block_causal/packed/"
            f"predicate)"
        )
    if scheme is None:
        cp_size = 1 if groups is None else groups.cp_size
        if cp_size == 1 or mask is None or mask.position_independent:
            return "contiguous"
        raise ValueError(
            f"scheme (None) must be given for mask {mask!r} over {cp_size} CP ranks: pass "
            f"scheme='zigzag' or 'contiguous', the layout q, k, v were cut with (e.g. by "
            f"layouts.shard_sequence(x, groups, dim=1, scheme=...)); this mask's balanced layout is "
            f"{mask.default_scheme!r}"
        )
    if as_placement(scheme) is None and scheme not in SCHEMES:
        raise ValueError(
            f"scheme ({scheme!r}) must be one of {SCHEMES}, a layouts.placement.Placement or None"
        )
    return scheme


def ring_token_ids(
    cp_ranks: Sequence[int],
    ulysses_ranks: Sequence[int],
    ring_ranks: Sequence[int],
    ulysses_size: int,
    ring_size: int,
    placement: str,
    seq_len: int,
    scheme: str,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Pure index map of the 2D layout (ranks are global ranks, lists in group-rank order).

    Returns ``(gathered, ring_ids)``: the global ids of this rank's sequence right after the Ulysses
    all-to-all (shards concatenated in Ulysses group-rank order), and for each ring position ``j``
    the sorted global ids that ring rank holds during ring attention.
    """
    n = len(cp_ranks)
    cp_of = {g: c for c, g in enumerate(cp_ranks)}
    gathered = concat_global_ids([cp_of[g] for g in ulysses_ranks], n, seq_len, scheme)
    ulysses_cp, _ = local_groups(list(range(n)), ulysses_size, ring_size, placement)
    ring_ids = []
    for g in ring_ranks:
        members = next(grp for grp in ulysses_cp if cp_of[g] in grp)
        ring_ids.append(torch.sort(concat_global_ids(members, n, seq_len, scheme)).values)
    return gathered, ring_ids


@functools.lru_cache(maxsize=64)
def _layout(
    cp_ranks: tuple,
    ulysses_ranks: tuple,
    ring_ranks: tuple,
    ulysses_size: int,
    ring_size: int,
    placement: str,
    seq_len: int,
    scheme: str,
):
    """``(ring_ids, order, inverse)``: ``ring_token_ids``' ring ids and the sort permutation of the
    gathered ids (None when sorted) with its inverse; a pure function of integers, memoised
    (callers never modify the tensors)."""
    gathered, ring_ids = ring_token_ids(
        cp_ranks, ulysses_ranks, ring_ranks, ulysses_size, ring_size, placement, seq_len, scheme
    )
    order = torch.argsort(gathered)
    if torch.equal(order, torch.arange(order.numel())):
        return tuple(ring_ids), None, None
    return tuple(ring_ids), order, torch.argsort(order)


@functools.lru_cache(maxsize=64)
def _layout_on(layout_key: tuple, device: str):
    """``_layout`` with ``order`` / ``inverse`` on ``device`` (copied once, not per call)."""
    ring_ids, order, inverse = _layout(*layout_key)
    if order is None or device == "cpu":
        return ring_ids, order, inverse
    return ring_ids, order.to(device), inverse.to(device)


_PROBED = PlanCache(256)  # masks whose ``dense`` passed the probe below (by value)


def _probe_mask(mask: AttentionMask) -> None:
    """A bad predicate must fail here, not inside the ring with P2P in flight (once per mask)."""

    def probe():
        one = torch.zeros(1, dtype=torch.long)
        m = mask.dense(one, one)
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (1, 1):
            raise ValueError(
                f"mask ({mask!r}).dense(q_ids, k_ids) must return a bool tensor "
                f"[len(q_ids), len(k_ids)] (got {type(m).__name__} "
                f"{getattr(m, 'dtype', '')} {tuple(getattr(m, 'shape', ()))})"
            )
        return True

    _PROBED.get(mask, probe)


@functools.lru_cache(maxsize=64)
def _local_ids(s: int) -> tuple:
    return (torch.arange(s),)


def _validate(q, k, v, groups, mask, softmax_scale, backend, scheme, tile):
    kernels.check_qkv_tensors(q, k, v, seq="s_local")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, s_local and head_dim"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes ({q.dtype}, {k.dtype}, {v.dtype}) must be equal")
    if softmax_scale is not None and (not isinstance(softmax_scale, Real) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale ({softmax_scale!r}) must be None or a positive number")
    if backend != "auto" and backend not in kernels.available_backends():
        raise ValueError(
            f"backend ({backend!r}) must be 'auto' or one of {kernels.available_backends()}"
        )
    if tile is not None:
        engine.check_tile(tile, engine.engine_backend(backend, q, mask), q.device)
    U = 1 if groups is None else groups.ulysses_size
    N = 1 if groups is None else groups.cp_size
    check_heads(q.shape[2], k.shape[2], U)
    if scheme == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"s_local ({q.shape[1]}) must be even for scheme 'zigzag' (each CP rank "
            f"holds two of 2*cp_size = {2 * N} chunks)"
        )
    check_seq_len(q.shape[1] * N, N, scheme)
    if mask is not None:
        _probe_mask(mask)


def _scheme_code(scheme) -> int:
    """A small integer naming the layout (a placement by its content), compared across ranks."""
    placement = as_placement(scheme)
    if placement is None:
        return SCHEMES.index(scheme)
    return len(SCHEMES) + int(placement.digest[:3], 16)


def _ring_layout(q, k, v, groups, scheme):
    """``(U, R, ulysses group, ring group, ring rank, layout key, ring ids, order, inverse)`` of
    ``groups`` for this ``s_local`` and ``scheme`` (cached per layout); with CP the ranks must
    agree on the shapes and the scheme."""
    if groups is None and as_placement(scheme) is not None:  # one rank, tokens in its order
        U, R, ug, rg, ring_rank = 1, 1, None, None, 0
        layout_key = ((0,), (0,), (0,), 1, 1, "ulysses_inner", q.shape[1], scheme)
        ring_ids, order, inverse = _layout_on(layout_key, str(q.device))
    elif groups is None:
        U, R, N, ug, rg, ring_rank = 1, 1, 1, None, None, 0
        layout_key = ("local", q.shape[1])
        ring_ids, order, inverse = _local_ids(q.shape[1]), None, None
    else:
        U, R, N = groups.ulysses_size, groups.ring_size, groups.cp_size
        ug, rg, ring_rank = groups.ulysses_group, groups.ring_group, groups.ring_rank
        layout_key = (
            tuple(groups.cp_ranks),
            tuple(groups.ulysses_ranks),
            tuple(groups.ring_ranks),
            U,
            R,
            groups.placement,
            q.shape[1] * N,
            scheme,
        )
        ring_ids, order, inverse = _layout_on(layout_key, str(q.device))
        if N > 1:
            # The scheme rides along as the length of an empty tensor: ranks that disagree on the
            # layout would otherwise silently compute garbage.
            check_same_shape(
                {"q": q, "k": k, "v": v, "scheme": torch.empty(_scheme_code(scheme))},
                groups.cp_group,
                "dist_attention",
            )
    return U, R, ug, rg, ring_rank, layout_key, ring_ids, order, inverse


def dist_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups=None,
    mask: Optional[AttentionMask] = None,
    softmax_scale: Optional[float] = None,
    scheme=None,
    backend: str = "auto",
    stats: Optional[RingStats] = None,
    tile: Optional[int] = None,
) -> torch.Tensor:
    """Exact context-parallel attention over the U x R groups of ``groups``.

    ``q [b, s_local, h, d]``, ``k, v [b, s_local, h_kv, d]`` laid out by
    ``layouts.shard_sequence(x, groups, dim=1, scheme=scheme)``; returns ``[b, s_local, h, d]`` in
    the same layout. ``groups`` is a ``VideoParallelGroups`` (None: one process, no communication).
    ``scheme=None``: see ``resolve_scheme`` (exact or ``ValueError``, never a guessed layout); with
    one CP rank both named layouts are the identity and any ``s_local`` is fine. ``scheme`` may be a
    ``layouts.placement.Placement`` (per call: packed clips placed by ``plan_placement``); ring
    sends that no later hop needs are then skipped on both sides (``attention.ring``). ``tile`` is
    the engine's tile side in tokens (``attention.engine``; None: ``engine.choose_tile``, 512 aligned to the
    mask's frames / blocks); ``backend`` its kernel family (``"auto"``: math for
    float64, FlexAttention on CUDA, torch's fused CPU kernel otherwise). ``stats`` (a ``RingStats``)
    counts ring steps, skipped tiles, kernel calls and the largest mask / score buffer. Input
    errors (including a mask whose
    ``dense`` does not return a bool tensor) raise ``ValueError`` before any collective; shapes
    that differ between the CP ranks raise ``ValueError`` on every rank instead of hanging.
    """
    scheme = resolve_scheme(mask, scheme, groups)
    if (groups is None or groups.cp_size == 1) and as_placement(scheme) is None:
        scheme = "contiguous"  # one CP rank: both layouts are the identity (any s_local)
    _validate(q, k, v, groups, mask, softmax_scale, backend, scheme, tile)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    U, R, ug, rg, ring_rank, layout_key, ring_ids, order, inverse = _ring_layout(
        q, k, v, groups, scheme
    )

    # Every ring rank's tokens sorted by global id: a permutation riding on the Ulysses all-to-all's
    # unpacking copy (a local one without Ulysses). A mask that ignores positions gives the same
    # attention in any token order (q, k and v share it), so it needs none.
    if mask is None or mask.position_independent:
        order = inverse = None
    if U > 1:
        q = seq_to_heads(q, ug, "ulysses.q", order)
        k = seq_to_heads(prepare_kv(k, U), ug, "ulysses.k", order)
        v = seq_to_heads(prepare_kv(v, U), ug, "ulysses.v", order)
    elif order is not None:
        q, k, v = (x.index_select(1, order) for x in (q, k, v))

    kernel = engine.engine_backend(backend, q, mask)
    plan = RingPlan(
        group=rg,
        ring_rank=ring_rank,
        ring_size=R,
        ids=ring_ids,
        mask=mask,
        softmax_scale=scale,
        backend=kernel,
        stats=stats,
        tile=tile if tile is not None else engine.choose_tile(mask, kernel, q.device),
        ids_key=layout_key,
        device=str(q.device),
        release_kv=U > 1 or order is not None,
    )
    out = ring_attention(q, k, v, plan)

    if U > 1:
        out = heads_to_seq(out, ug, "ulysses.out", order, inverse)
    elif order is not None:
        out = out.index_select(1, inverse)
    return out
