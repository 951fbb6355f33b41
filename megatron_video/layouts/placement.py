"""Placement of a packed sequence over the CP ranks (dynamic CP without regrouping), as pure maps.

A packed micro-batch is one sequence of ``S`` tokens holding several clips (clip ``c`` owns the
global ids ``[start_c, start_c + tokens_c)``). ``Placement`` says which global ids each CP rank
holds (every rank ``S/N``, together a permutation of ``range(S)``); attention only needs those ids
(``attention.dist_attention(..., scheme=placement)``), so any clip-to-rank mapping is legal inside
the one CP group Megatron built. ``plan_placement`` chooses one from the clips alone: a short clip
whole inside one Ulysses group (whole on one ring rank after the all-to-all: no ring traffic), a
long clip split mirror-wise over the ring, minimising the slowest ring rank's cost
(``CostModel``: attention pairs after masking, linear work, ring bytes). Design:
docs/architecture.md, "Capabilities" 7.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..checks import check_int, check_rank
from ..parallel.topology import local_groups
from .balanced_sp import max_over_mean
from .zigzag import SCHEMES, shard_global_ids

__all__ = [
    "CLIP_KINDS",
    "Clip",
    "CostModel",
    "Placement",
    "PlacementPlan",
    "clip_pairs",
    "query_work",
    "plan_placement",
    "ring_members",
]


def _ids_digest(ids: torch.Tensor) -> str:
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).hexdigest()


class Placement:
    """Global token ids held by each CP rank: ``ids [N, S/N]`` (row ``c`` in CP rank ``c``'s local
    order), the rows together a permutation of ``range(S)``. Immutable and hashable by content (it
    keys the attention plan cache); ``rank_ids`` hands out copies."""

    __slots__ = ("_ids", "_key", "name")

    def __init__(self, ids, name: Optional[str] = None):
        t = torch.as_tensor(ids)
        if t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool or t.shape[0] < 1:
            raise ValueError(
                f"ids ({tuple(t.shape)} {t.dtype}) must be an integer tensor [cp_size, s_local]"
            )
        t = t.to(device="cpu", dtype=torch.long).contiguous().clone()
        s = t.numel()
        if not torch.equal(torch.sort(t.flatten()).values, torch.arange(s)):
            raise ValueError(
                f"ids must hold every global id of range({s}) exactly once (a permutation over "
                f"{t.shape[0]} CP ranks of {t.shape[1]} tokens each)"
            )
        self._ids, self.name = t, name
        self._key = (t.shape[0], t.shape[1], _ids_digest(t))

    @classmethod
    def from_scheme(cls, scheme: str, cp_size: int, seq_len: int) -> "Placement":
        """The placement of a static scheme (``"zigzag"`` / ``"contiguous"``)."""
        if scheme not in SCHEMES:
            raise ValueError(f"scheme ({scheme!r}) must be one of {SCHEMES}")
        ids = torch.stack([shard_global_ids(c, cp_size, seq_len, scheme) for c in range(cp_size)])
        return cls(ids, name=scheme)

    @property
    def cp_size(self) -> int:
        return self._ids.shape[0]

    @property
    def local_len(self) -> int:
        return self._ids.shape[1]

    @property
    def seq_len(self) -> int:
        return self._ids.numel()

    @property
    def digest(self) -> str:
        """Hex digest of the ids: the same on every process (Python's ``hash`` is not)."""
        return self._key[2]

    def rank_ids(self, cp_rank: int) -> torch.Tensor:
        """CP rank ``cp_rank``'s global ids in its local order (a copy)."""
        check_rank("cp_rank", cp_rank, self.cp_size, "cp_size")
        return self._ids[cp_rank].clone()

    def owner(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inverse map: ``(cp_rank, local_index)`` of every global id (``[S]`` each)."""
        rank = torch.empty(self.seq_len, dtype=torch.long)
        local = torch.empty(self.seq_len, dtype=torch.long)
        flat = self._ids.flatten()
        rank[flat] = torch.arange(self.cp_size).repeat_interleave(self.local_len)
        local[flat] = torch.arange(self.local_len).repeat(self.cp_size)
        return rank, local

    def shard(self, x: torch.Tensor, cp_rank: int, dim: int = 1) -> torch.Tensor:
        """CP rank ``cp_rank``'s shard of the full sequence ``x`` along ``dim``."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"x.shape[{dim}] ({x.shape[dim]}) must equal the placement's seq_len "
                f"({self.seq_len})"
            )
        return x.index_select(dim, self.rank_ids(cp_rank).to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of ``shard``: the full sequence from every CP rank's shard (in CP order)."""
        if len(shards) != self.cp_size:
            raise ValueError(
                f"shards ({len(shards)}) must hold one tensor per CP rank ({self.cp_size})"
            )
        cat = torch.cat(list(shards), dim=dim)
        inverse = torch.argsort(self._ids.flatten()).to(cat.device)
        return cat.index_select(dim, inverse)

    def __eq__(self, other) -> bool:
        return isinstance(other, Placement) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        what = self.name or f"#{self._key[2][:8]}"
        return f"Placement({what}, cp_size={self.cp_size}, seq_len={self.seq_len})"


# Attention inside a clip: full (T2V), causal, block-causal (blocks of ``block_tokens``) and
# teacher forcing (``[clean ; noisy]`` halves, blocks of ``block_tokens`` tokens per half).
CLIP_KINDS = ("full", "causal", "block_causal", "teacher_forcing")


@dataclass(frozen=True)
class Clip:
    """One clip of a packed sequence: ``tokens`` and the attention ``kind`` inside it."""

    tokens: int
    kind: str = "full"
    block_tokens: int = 0  # block_causal / teacher_forcing: tokens per block (per half for TF)

    def __post_init__(self):
        check_int("tokens", self.tokens, 1)
        if self.kind not in CLIP_KINDS:
            raise ValueError(f"kind ({self.kind!r}) must be one of {CLIP_KINDS}")
        if self.kind in ("block_causal", "teacher_forcing"):
            check_int("block_tokens", self.block_tokens, 1)
            half = self.tokens // 2 if self.kind == "teacher_forcing" else self.tokens
            if (self.kind == "teacher_forcing" and self.tokens % 2) or half % self.block_tokens:
                raise ValueError(
                    f"tokens ({self.tokens}) must be {'2 * ' if self.kind == 'teacher_forcing' else ''}"
                    f"a whole number of blocks of block_tokens ({self.block_tokens}) for kind "
                    f"{self.kind!r}"
                )


def query_work(clip: Clip) -> torch.Tensor:
    """Keys each query of ``clip`` attends to (int64 ``[tokens]``, in the clip's token order)."""
    n = clip.tokens
    pos = torch.arange(n, dtype=torch.long)
    if clip.kind == "full":
        return torch.full((n,), n, dtype=torch.long)
    if clip.kind == "causal":
        return pos + 1
    b = clip.block_tokens
    if clip.kind == "block_causal":
        return (pos // b + 1) * b
    half = n // 2  # teacher forcing: clean q sees clean blocks <= its own; noisy q sees clean
    blk = (pos % half) // b  # blocks < its own and its own noisy block: (blk + 1) * b either way
    return (blk + 1) * b


@functools.lru_cache(maxsize=4096)
def clip_pairs(clip: Clip) -> int:
    """Attention (query, key) pairs computed for ``clip`` after masking."""
    return int(query_work(clip).sum())


@dataclass(frozen=True)
class CostModel:
    """Relative cost of one ring rank's share of a layer: ``pair`` per attention pair, ``token``
    per token of linear work (projections, MLP), ``ring_token`` per K/V token sent over the ring.
    The defaults weigh a token of linear work like ``4·D`` pairs at ``D = 1536`` and a ring token
    like 64 pairs (ring sends overlap the attention they feed, so balance comes first); fit
    them to a machine with measured times (``benchmarks/mixed_lengths.py``)."""

    pair: float = 1.0
    token: float = 6144.0
    ring_token: float = 64.0

    def __post_init__(self):
        for name in ("pair", "token", "ring_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} ({v!r}) must be a number >= 0")

    def clip(self, clip: Clip) -> float:
        """Cost of ``clip`` alone, whole on one ring rank."""
        return self.pair * clip_pairs(clip) + self.token * clip.tokens


def ring_members(
    ulysses_size: int, ring_size: int, placement: str = "ulysses_inner"
) -> List[List[int]]:
    """CP indices of the Ulysses group that forms ring rank ``r``, for each ``r`` (pure)."""
    ug, _ = local_groups(list(range(ulysses_size * ring_size)), ulysses_size, ring_size, placement)
    return ug


@dataclass(frozen=True)
class PlacementPlan:
    """What ``plan_placement`` decided for one packed micro-batch.

    ``starts[c]``: clip ``c``'s first global id (clips in the given order, then ``pad`` padding
    tokens); ``ring_of[c]``: the ring rank holding clip ``c`` whole, or ``None`` when it is split
    over several ring ranks; ``shares[c][r]``: its tokens on ring rank ``r``. Per ring rank ``r``
    (every CP rank of it carries the same, the all-to-all splitting heads): ``pairs[r]`` the
    attention pairs its queries compute, ``ring_tokens[r]`` the K/V tokens it sends (tokens other
    ring ranks need, times the hops to the furthest), ``cost[r]`` the ``CostModel`` total.
    """

    placement: Placement
    clips: Tuple[Clip, ...]
    starts: Tuple[int, ...]
    pad: int
    ring_of: Tuple[Optional[int], ...]
    shares: Tuple[Tuple[int, ...], ...]
    pairs: Tuple[int, ...]
    ring_tokens: Tuple[int, ...]
    cost: Tuple[float, ...]
    ulysses_size: int
    ring_size: int

    @property
    def seq_len(self) -> int:
        return self.placement.seq_len

    @property
    def cu_seqlens(self) -> List[int]:
        """Document offsets: one document per clip, then the padding (if any) as its own."""
        cu = list(self.starts) + [self.starts[-1] + self.clips[-1].tokens]
        return cu + [self.seq_len] if self.pad else cu

    def balance(self) -> float:
        """``max / mean`` of the attention pairs per ring rank (1.0 = balanced)."""
        return max_over_mean(self.pairs)

    def summary(self) -> str:
        """One line for the run log: clips whole / split, padding, balance and ring traffic."""
        whole = sum(r is not None for r in self.ring_of)
        return (
            f"placement U{self.ulysses_size}xR{self.ring_size}: {len(self.clips)} clips "
            f"({whole} whole on one ring rank, {len(self.clips) - whole} split over the ring), "
            f"{self.seq_len} tokens ({self.pad} padding), attention pairs max/mean "
            f"{self.balance():.3f}, ring K/V tokens {sum(self.ring_tokens)}"
        )


def _per_token(clip: Clip, cost: CostModel, ring_size: int) -> float:
    """Variable cost of one token of ``clip`` split over the ring: its pairs and its ring hops
    (linear work is the same on every ring rank, which all hold ``S/R`` tokens)."""
    return cost.pair * clip_pairs(clip) / clip.tokens + cost.ring_token * (ring_size - 1)


def _split_order(clip: Clip) -> torch.Tensor:
    """Token order in which a split clip is dealt to ring ranks (consecutive runs): mirrored for
    position-dependent masks (a run of ``0, L-1, 1, L-2, ...`` has work proportional to its length
    under a causal mask); teacher forcing deals a frame's clean and noisy token together."""
    n = clip.tokens
    if clip.kind == "full":
        return torch.arange(n)
    m = n // 2 if clip.kind == "teacher_forcing" else n
    lo, hi = torch.arange(m), torch.arange(m - 1, -1, -1)
    mirrored = torch.stack([lo, hi], 1).flatten()[:m]
    if clip.kind == "teacher_forcing":
        return torch.stack([mirrored, mirrored + m], 1).flatten()
    return mirrored


def _water_fill(load: List[float], room: List[int], tokens: int, w: float, unit: int) -> List[int]:
    """Shares of ``tokens`` (multiples of ``unit``) over ranks with ``room`` left, lowest load
    first, each rank's load + share·w levelled (deterministic: ties by rank)."""
    share = [0] * len(load)
    left = tokens
    while left > 0:
        open_ = [r for r in range(len(load)) if room[r] - share[r] >= unit]
        if not open_:
            raise ValueError(
                f"the clips cannot be dealt to ring ranks in units of {unit} tokens: give the "
                f"packed sequence padding (seq_len) or an even token count per ring rank"
            )
        r = min(open_, key=lambda i: (load[i] + share[i] * w, i))
        others = [load[i] + share[i] * w for i in open_ if i != r]
        step = room[r] - share[r]
        if others and w > 0:
            level = min(others)  # raise rank r up to the next lowest, then re-evaluate
            step = min(step, max(unit, int((level - load[r] - share[r] * w) / w) + unit))
        step = min(step, left) // unit * unit or unit
        share[r] += step
        left -= step
    return share


def _deal_split(clips, split, whole_load, room, cost: CostModel, R: int, pad_index):
    """Shares ``{c: [tokens per ring rank]}`` of the split clips: dearest tokens first, each
    levelled onto the ring ranks with the lowest load (teacher forcing in clean+noisy pairs;
    the padding, which attends nothing and travels nowhere, last)."""
    load, room = list(whole_load), list(room)

    def w_of(c):
        return 0.0 if c == pad_index else _per_token(clips[c], cost, R)

    order = sorted(
        split, key=lambda c: (c == pad_index, clips[c].kind != "teacher_forcing", -w_of(c), c)
    )
    shares = {}
    for c in order:
        clip = clips[c]
        w = w_of(c)
        unit = 2 if clip.kind == "teacher_forcing" else 1
        sh = _water_fill(load, room, clip.tokens, w, unit)
        for r in range(R):
            load[r] += sh[r] * w
            room[r] -= sh[r]
        shares[c] = sh
    return shares, load


def _lpt_whole(clips, order, split, cap, cost: CostModel, R: int, fill_w: float):
    """Whole clips, dearest first, onto the ring rank with the lowest projected cost (its whole
    clips plus its remaining room at the split clips' mean token cost) that has room."""
    load, used, ring_of = [0.0] * R, [0] * R, {}
    for c in order:
        if c in split:
            continue
        clip = clips[c]
        fits = [r for r in range(R) if used[r] + clip.tokens <= cap]
        if not fits:
            split.add(c)
            continue
        w = cost.pair * clip_pairs(clip)
        r = min(fits, key=lambda i: (load[i] + w + (cap - used[i] - clip.tokens) * fill_w, i))
        ring_of[c] = r
        load[r] += w
        used[r] += clip.tokens
    return ring_of, load, used


def _to_split(order, ring_of, final, R: int, cost: CostModel, clips):
    """The whole clip of the most loaded ring rank to split next: the smallest whose cost covers
    that rank's excess over the mean (else its dearest), None when it holds none."""
    heavy = max(range(R), key=lambda r: (final[r], -r))
    excess = final[heavy] - sum(final) / R
    movable = [c for c in order if ring_of.get(c) == heavy]
    if not movable:
        return None
    covering = [c for c in movable if cost.pair * clip_pairs(clips[c]) >= excess]
    return covering[-1] if covering else movable[0]


def plan_placement(
    clips: Sequence[Clip],
    ulysses_size: int,
    ring_size: int,
    cost: Optional[CostModel] = None,
    seq_len: Optional[int] = None,
    placement: str = "ulysses_inner",
    tolerance: float = 0.02,
) -> PlacementPlan:
    """The placement of ``clips`` (packed in this order, then padding up to ``seq_len``, default the
    next multiple of ``U·R``) over ``U x R`` CP ranks that minimises the slowest ring rank's cost.

    Whole clips go to ring ranks by longest-processing-time first; clips that do not fit, and
    then, while the slowest ring rank is more than ``tolerance`` over the mean, a clip of the
    slowest rank, are split (mirror-dealt, so causal work follows the share) and levelled onto the
    least loaded ranks; the best plan seen wins. Deterministic: a pure function of its arguments,
    ties broken by index.
    """
    cost = cost or CostModel()
    U, R = check_int("ulysses_size", ulysses_size, 1), check_int("ring_size", ring_size, 1)
    N = U * R
    clips = tuple(clips)
    if not clips or not all(isinstance(c, Clip) for c in clips):
        raise ValueError(f"clips ({clips!r}) must be a non-empty sequence of placement.Clip")
    total = sum(c.tokens for c in clips)
    S = -(-total // N) * N if seq_len is None else check_int("seq_len", seq_len, 1)
    if S < total or S % N:
        raise ValueError(
            f"seq_len ({S}) must be a multiple of cp_size ({N}) and at least the clips' "
            f"{total} tokens"
        )
    pad, cap = S - total, S // R
    work = clips + ((Clip(pad),) if pad else ())  # padding: its own document, attends nothing
    pad_index = len(clips) if pad else None
    order = sorted(range(len(clips)), key=lambda c: (-clip_pairs(clips[c]), c))
    split = {pad_index} if pad else set()
    best = None
    for _ in range(len(clips) + 1):
        per_tok = [_per_token(work[c], cost, R) for c in split if c != pad_index]
        fill_w = sum(per_tok) / len(per_tok) if per_tok else 0.0
        ring_of, load, used = _lpt_whole(work, order, split, cap, cost, R, fill_w)
        shares, final = _deal_split(work, split, load, [cap - u for u in used], cost, R, pad_index)
        if best is None or max(final) < best[0] - 1e-9:
            best = (max(final), dict(ring_of), shares)
        if R == 1 or max(final) <= (1 + tolerance) * sum(final) / R:
            break
        nxt = _to_split(order, ring_of, final, R, cost, clips)
        if nxt is None:
            break
        split.add(nxt)
    _, ring_of, shares = _improve(best, work, order, cap, cost, R, pad_index)
    return _build_plan(work, clips, ring_of, shares, U, R, placement, cost, pad)


def _evaluate(work, ring_of, cap, cost: CostModel, R: int, pad_index):
    """``(peak, ring_of, shares)`` of fixed whole clips, the others split and levelled."""
    load, used = [0.0] * R, [0] * R
    for c, r in ring_of.items():
        load[r] += cost.pair * clip_pairs(work[c])
        used[r] += work[c].tokens
    if any(u > cap for u in used):
        return None
    split = {c for c in range(len(work)) if c not in ring_of}
    shares, final = _deal_split(work, split, load, [cap - u for u in used], cost, R, pad_index)
    return max(final), ring_of, shares


def _improve(best, work, order, cap, cost: CostModel, R: int, pad_index, rounds: int = 32):
    """Local search on the whole clips: move one off the slowest ring rank, or swap it with one
    of another rank, while the slowest rank gets faster (first improvement, in index order)."""
    for _ in range(rounds if R > 1 else 0):
        peak, ring_of, shares = best
        load = [0.0] * R
        for c, r in ring_of.items():
            load[r] += cost.pair * clip_pairs(work[c])
        heavy = max(range(R), key=lambda r: (load[r], -r))
        found = None
        for a in (c for c in order if ring_of.get(c) == heavy):
            for r in range(R):
                if r == heavy:
                    continue
                moves = [{**ring_of, a: r}] + [
                    {**ring_of, a: r, b: heavy} for b in order if ring_of.get(b) == r
                ]
                for cand in moves:
                    got = _evaluate(work, cand, cap, cost, R, pad_index)
                    if got is not None and got[0] < peak * (1 - 1e-6):
                        found = got
                        break
                if found:
                    break
            if found:
                break
        if found is None:
            return best
        best = found
    return best


def _dealt(work, n_clips: int, ring_of, shares, R: int):
    """First ids of the documents, the global ids of every ring rank (sorted) and the attention
    pairs of each ring rank's queries."""
    starts, s = [], 0
    for c in work:
        starts.append(s)
        s += c.tokens
    per_ring: List[List[torch.Tensor]] = [[] for _ in range(R)]
    pairs = [0] * R
    for c, clip in enumerate(work):
        ids = torch.arange(starts[c], starts[c] + clip.tokens)
        qw = query_work(clip) * (c < n_clips)  # the padding attends nothing
        if c in ring_of:
            per_ring[ring_of[c]].append(ids)
            pairs[ring_of[c]] += int(qw.sum())
            continue
        order = _split_order(clip)
        at = 0
        for r, n in enumerate(shares[c]):
            per_ring[r].append(ids[order[at : at + n]])
            pairs[r] += int(qw[order[at : at + n]].sum())
            at += n
    return starts, [torch.sort(torch.cat(p)).values for p in per_ring], pairs


def _ring_tokens(clips, ring_of, shares, R: int) -> List[int]:
    """K/V tokens each ring rank sends: those of its split clips, as far as the furthest ring
    rank holding a part of one."""
    out = [0] * R
    for j in range(R):
        mine = [c for c in range(len(clips)) if ring_of.get(c) is None and shares[c][j]]
        hops = [i for i in range(1, R) if any(shares[c][(j + i) % R] for c in mine)]
        out[j] = sum(shares[c][j] for c in mine) * max(hops, default=0)
    return out


def _build_plan(work, clips, ring_of, shares, U, R, placement, cost, pad) -> PlacementPlan:
    n_clips = len(clips)
    full_shares = tuple(
        tuple(clips[c].tokens if r == ring_of[c] else 0 for r in range(R))
        if c in ring_of
        else tuple(shares[c])
        for c in range(n_clips)
    )
    starts, ring_ids, pairs = _dealt(work, n_clips, ring_of, shares, R)
    members = ring_members(U, R, placement)
    rows = [None] * (U * R)
    for r in range(R):
        for u, cp in enumerate(members[r]):
            rows[cp] = ring_ids[r].view(U, -1)[u]
    ring = _ring_tokens(clips, ring_of, full_shares, R)
    cap = ring_ids[0].numel()
    return PlacementPlan(
        placement=Placement(torch.stack(rows), name=f"planned U{U}xR{R}"),
        clips=clips,
        starts=tuple(starts[:n_clips]),
        pad=pad,
        ring_of=tuple(ring_of.get(c) for c in range(n_clips)),
        shares=full_shares,
        pairs=tuple(pairs),
        ring_tokens=tuple(ring),
        cost=tuple(
            cost.pair * p + cost.token * cap + cost.ring_token * t for p, t in zip(pairs, ring)
        ),
        ulysses_size=U,
        ring_size=R,
    )
