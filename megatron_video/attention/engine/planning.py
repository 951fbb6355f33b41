"""Tile planning, pure host code: a block's (q ids x k ids) cut into tiles, classified EMPTY /
PARTIAL / FULL on global ids and grouped into kernel calls (``plan_block``; ``flex_plan`` for
FlexAttention's fixed tiles). No device data is read and no kernel runs here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ...ops.rules import EMPTY, FULL, PARTIAL
from ..masks import AttentionMask, is_lower_triangle
from .stats import EngineStats

DEFAULT_TILE = 512
# PARTIAL tile masks a plan keeps (host, and one copy per device on first use); past it they are
# evaluated per call. Elements (bools) per plan.
MASK_CACHE_ELEMENTS = 1 << 24
DEBUG_ENV = "MEGATRON_VIDEO_CHECK_MASKS"
CAUSAL = (
    3  # a call kind: PARTIAL tile whose mask is exactly the lower triangle (kernel's causal flag)
)


def kernel_block_size(backend: str, device: torch.device) -> int:
    """Tokens per block of the kernel that runs tiles: tiles must be a multiple of it."""
    return 128 if backend == "flex" and device.type == "cuda" else 1


_CPU = torch.device("cpu")


def check_tile(tile, backend: str = "auto", device: torch.device = _CPU) -> int:
    """``tile`` as an int, or ``ValueError`` naming it (positive multiple of the kernel's block)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"tile ({tile!r}) must be a positive int (tokens per tile side)")
    blk = kernel_block_size(backend, device)
    if tile % blk:
        raise ValueError(
            f"tile ({tile}) must be a multiple of the {backend!r} kernel's block size ({blk})"
        )
    return tile


def choose_tile(mask: Optional[AttentionMask], backend: str, device: torch.device) -> int:
    """The default tile: ``DEFAULT_TILE``, aligned to the mask's own granularity when it has one.

    A mask whose verdict is constant on blocks of ``h = mask.tile_hint`` consecutive ids (a frame,
    an autoregressive block) gets tiles aligned to its blocks: ``h`` itself when
    ``256 <= h <= DEFAULT_TILE``, the largest divisor of ``h`` not above ``DEFAULT_TILE`` (and at least
    256) when ``h`` is larger, the largest multiple of ``h`` not above ``DEFAULT_TILE`` when smaller.
    FlexAttention on CUDA keeps its 128-token blocks' multiples.
    """
    blk = kernel_block_size(backend, device)
    h = getattr(mask, "tile_hint", None) if mask is not None else None
    if blk > 1 or not h or h <= 0:
        return DEFAULT_TILE
    if h > DEFAULT_TILE:
        d = max((x for x in range(256, DEFAULT_TILE + 1) if h % x == 0), default=None)
        return d or DEFAULT_TILE
    if h >= 256:
        return h
    return (DEFAULT_TILE // h) * h


def _spans(ids: torch.Tensor, breaks_after: torch.Tensor) -> List[Tuple[int, int]]:
    """``(start, end)`` of the spans of ``ids`` cut after every position ``p`` where
    ``breaks_after[p]`` (a bool over ``ids[:-1]``)."""
    n = ids.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(breaks_after).flatten() + 1).tolist()
    edges = [0] + breaks + [n]
    return list(zip(edges[:-1], edges[1:]))


def id_runs(ids: torch.Tensor, starts: Optional[torch.Tensor] = None) -> List[Tuple[int, int]]:
    """``(start, end)`` of maximal runs of consecutive ids (``ids[p+1] == ids[p] + 1``), also cut
    before every id in ``starts`` (e.g. ``AttentionMask.tile_starts``); pure."""
    cut = ids[1:] != ids[:-1] + 1
    if starts is not None and ids.numel() > 1:
        cut = cut | torch.isin(ids[1:], starts)
    return _spans(ids, cut)


def run_tiles(
    ids: torch.Tensor, tile: int, starts: Optional[torch.Tensor] = None
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """``(runs, tiles)``: each run of consecutive ids (cut before ``starts``) cut into tiles of
    ``tile`` positions."""
    runs = id_runs(ids, starts)
    tiles = [(a, min(a + tile, e)) for s, e in runs for a in range(s, e, tile)]
    return runs, tiles


@dataclass(frozen=True)
class Call:
    """One kernel call: queries ``q`` x keys ``k`` (position slices), ``kind`` FULL / CAUSAL / PARTIAL.

    ``batch > 1``: ``batch`` equal blocks in one call (a batched kernel over strided views), block
    ``i`` being ``q + i * q_step`` x ``k + i * k_step`` (disjoint rows and keys: e.g. the diagonal
    tiles of a block-diagonal part of the mask)."""

    q: slice
    k: slice
    kind: int
    batch: int = 1
    q_step: int = 0
    k_step: int = 0

    @property
    def q_rows(self) -> Tuple[int, int]:
        """First and last + 1 query row any block of the call touches."""
        return self.q.start, self.q.stop + (self.batch - 1) * self.q_step

    def blocks(self) -> List["Call"]:
        """The call as ``batch`` single calls."""
        qs, ks = self.q_step, self.k_step
        return [
            Call(
                slice(self.q.start + i * qs, self.q.stop + i * qs),
                slice(self.k.start + i * ks, self.k.stop + i * ks),
                self.kind,
            )
            for i in range(self.batch)
        ]


@dataclass
class BlockPlan:
    """The calls that compute one (q ids x k ids) block, and the tile counts behind them.

    PARTIAL calls keep no mask: ``tile_mask(call)`` evaluates it (one tile) when a kernel needs it,
    so a plan kept from the forward for the backward stays small.
    """

    calls: List[Call]
    q_ids: torch.Tensor
    k_ids: torch.Tensor
    mask: Optional[AttentionMask]
    tile: int
    counts: dict = field(default_factory=lambda: {EMPTY: 0, PARTIAL: 0, FULL: 0})
    status: Optional[torch.Tensor] = None  # uint8 [q tiles, k tiles]
    flex: Optional[object] = None  # a FlexAttention BlockMask, built on first use
    # PARTIAL calls, by index in ``calls``: host masks (within MASK_CACHE_ELEMENTS) and rows without
    # any key (only where there are such rows), both found at planning time; device copies by
    # (kind, index, device) on first use, so running a plan never reads device data on the host
    masks: dict = field(default_factory=dict, repr=False)
    dead: dict = field(default_factory=dict, repr=False)
    _on_device: dict = field(default_factory=dict, repr=False)
    _bwd_order: Optional[tuple] = field(default=None, repr=False)

    def backward_order(self) -> tuple:
        """Indices of ``calls`` in the order the backward runs them: widest key range first, then
        widest query range, so that a call covering every key (query) row gives the fresh dK / dV
        (dQ) accumulators themselves instead of zeros plus a temporary of the same size."""
        if self._bwd_order is None:
            span = [(c.k.stop - c.k.start, c.q.stop - c.q.start) for c in self.calls]
            self._bwd_order = tuple(
                sorted(range(len(span)), key=lambda i: (-span[i][0], -span[i][1]))
            )
        return self._bwd_order

    @property
    def num_tiles(self) -> int:
        return sum(self.counts.values())

    def _device_copy(self, kind: str, index: int, host: torch.Tensor, device) -> torch.Tensor:
        key = (kind, index, str(device))
        if key not in self._on_device:
            self._on_device[key] = host.to(device)
        return self._on_device[key]

    def tile_mask(
        self, call: Call, device, stats: Optional["EngineStats"] = None, index: Optional[int] = None
    ) -> Optional[torch.Tensor]:
        """Bool mask of a PARTIAL call (lower triangle for CAUSAL, None for FULL); ``index`` (its
        position in ``calls``) reads the plan's kept mask."""
        if call.kind == FULL:
            return None
        n_q, n_k = call.q.stop - call.q.start, call.k.stop - call.k.start
        if stats is not None:
            stats._mask(n_q * n_k)
        if call.kind == CAUSAL:
            return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
        if index is not None and index in self.masks:
            return self._device_copy("mask", index, self.masks[index], device)
        t0 = time.perf_counter()
        m = self.mask.dense(self.q_ids[call.q], self.k_ids[call.k]).to(device)
        if stats is not None:
            stats.mask_seconds += time.perf_counter() - t0
        return m

    def dead_rows(self, index: int, device) -> Optional[torch.Tensor]:
        """Bool rows of PARTIAL call ``index`` that see no key (None when every row sees one)."""
        if index not in self.dead:
            return None
        return self._device_copy("dead", index, self.dead[index], device)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "0").strip() not in ("", "0", "false", "False")


def _check_tile_verdict(
    mask: AttentionMask, qi: torch.Tensor, ki: torch.Tensor, st: int, stats: Optional[EngineStats]
) -> None:
    d = mask.dense(qi, ki)
    if stats is not None:
        stats._mask(d.numel())
    ok = {
        EMPTY: not bool(d.any()),
        FULL: bool(d.all()),
        PARTIAL: bool(d.any()) and not bool(d.all()),
    }[st]
    if not ok:
        name = {EMPTY: "EMPTY", FULL: "FULL", PARTIAL: "PARTIAL"}[st]
        raise ValueError(
            f"mask ({mask!r}) classifies the tile q ids [{int(qi[0])}..{int(qi[-1])}] x "
            f"k ids [{int(ki[0])}..{int(ki[-1])}] as {name}, but its dense form disagrees "
            f"(tile_status / block_status must agree with dense)"
        )


def _status_grid(q_ids, k_ids, mask, tile, stats, debug):
    starts = mask.tile_starts() if mask is not None else None
    q_runs, q_tiles = run_tiles(q_ids, tile, starts)
    k_runs, k_tiles = run_tiles(k_ids, tile, starts)
    nq, nk = len(q_tiles), len(k_tiles)
    if mask is None or mask.position_independent:
        return q_tiles, k_tiles, torch.full((nq, nk), FULL, dtype=torch.uint8)
    rows = []
    for qa, qe in q_runs:
        cols = []
        for ka, ke in k_runs:
            st = mask.tile_status(q_ids[qa:qe], k_ids[ka:ke], tile, tile)
            if stats is not None:
                stats._mask(getattr(mask, "last_mask_elements", 0))
            cols.append(torch.as_tensor(st, dtype=torch.uint8).cpu())
        rows.append(torch.cat(cols, dim=1))
    status = torch.cat(rows, dim=0)
    if tuple(status.shape) != (nq, nk):
        raise ValueError(
            f"mask ({mask!r}).tile_status returned shape {tuple(status.shape)}, expected "
            f"({nq}, {nk}) tiles"
        )
    if debug:
        for i, (qa, qe) in enumerate(q_tiles):
            for j, (ka, ke) in enumerate(k_tiles):
                _check_tile_verdict(mask, q_ids[qa:qe], k_ids[ka:ke], int(status[i, j]), stats)
    return q_tiles, k_tiles, status


def plan_block(
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    mask: Optional[AttentionMask],
    tile: int,
    merge: bool = True,
    stats: Optional[EngineStats] = None,
    debug: Optional[bool] = None,
) -> BlockPlan:
    """The kernel calls for queries ``q_ids`` x keys ``k_ids`` (global ids, 1-D), pure but for ``stats``.

    ``merge`` groups FULL tiles into larger calls (fused kernels, whose memory does not grow with
    the call); without it every call covers at most one tile pair (the ``"math"`` backend).
    ``debug`` (default: the ``MEGATRON_VIDEO_CHECK_MASKS`` environment variable) checks every tile
    verdict against the mask's dense form of that tile and raises ``ValueError`` on a disagreement.
    """
    q_ids, k_ids = q_ids.long().cpu(), k_ids.long().cpu()
    debug = debug_enabled() if debug is None else debug
    q_tiles, k_tiles, status = _status_grid(q_ids, k_ids, mask, tile, stats, debug)
    plan = BlockPlan(calls=[], q_ids=q_ids, k_ids=k_ids, mask=mask, tile=tile, status=status)
    for value in (EMPTY, PARTIAL, FULL):
        plan.counts[value] = int((status == value).sum())
    kinds = {}

    def partial_kind(i: int, j: int) -> int:
        """CAUSAL when the PARTIAL tile's mask is exactly the lower triangle, else PARTIAL."""
        if (i, j) not in kinds:
            qi, ki = q_ids[q_tiles[i][0] : q_tiles[i][1]], k_ids[k_tiles[j][0] : k_tiles[j][1]]
            if stats is not None:  # rule masks decide on identities; others evaluate this one tile
                stats._mask(qi.numel() * ki.numel())
            low = bool(mask.lower_triangle(qi, ki))
            if low and debug and not is_lower_triangle(mask.dense(qi, ki)):
                raise ValueError(
                    f"mask ({mask!r}).lower_triangle says the tile q ids [{int(qi[0])}.."
                    f"{int(qi[-1])}] x k ids [{int(ki[0])}..{int(ki[-1])}] is the lower "
                    f"triangle, but its dense form disagrees"
                )
            kinds[i, j] = CAUSAL if low else PARTIAL
        return kinds[i, j]

    work = status.clone()  # tiles still to be covered by a call
    if merge:
        _causal_diagonals(plan, q_ids, k_ids, q_tiles, k_tiles, work, partial_kind)
    full = (work == FULL).tolist()
    rects = _fewest_rectangles(full) if merge else _single_tiles(full)
    plan.calls.extend(
        Call(
            slice(q_tiles[i0][0], q_tiles[i1 - 1][1]),
            slice(k_tiles[j0][0], k_tiles[j1 - 1][1]),
            FULL,
        )
        for i0, i1, j0, j1 in rects
    )
    if merge:
        plan.calls = _batch_equal_calls(plan.calls, q_ids.numel() // 4, k_ids.numel() // 4)
    for i, row in enumerate(work.tolist()):
        for j, st in enumerate(row):
            if st == PARTIAL:
                plan.calls.append(Call(slice(*q_tiles[i]), slice(*k_tiles[j]), partial_kind(i, j)))
    _keep_partials(plan, stats)
    return plan


Rect = Tuple[int, int, int, int]  # tile rows [i0, i1) x tile columns [j0, j1)


def _single_tiles(full: List[List[bool]]) -> List[Rect]:
    return [(i, i + 1, j, j + 1) for i, row in enumerate(full) for j, f in enumerate(row) if f]


def _row_groups(full: List[List[bool]]) -> List[Rect]:
    """Each row's maximal FULL runs; consecutive rows with the same runs share them."""
    out, group, start = [], None, 0
    for i, row in enumerate(full + [[]]):
        runs, j = [], 0
        while j < len(row):
            if row[j]:
                j0 = j
                while j + 1 < len(row) and row[j + 1]:
                    j += 1
                runs.append((j0, j + 1))
            j += 1
        if runs != group or i == len(full):
            out.extend((start, i, a, e) for a, e in group or ())
            group, start = runs, i
    return out


def _greedy_rectangles(full: List[List[bool]]) -> List[Rect]:
    """From each uncovered FULL tile (row-major), the larger of two rectangles of uncovered FULL
    tiles: its widest run extended down as far as it fits, or its tallest run extended right."""
    free = [list(row) for row in full]
    nq, nk = len(free), len(free[0]) if free else 0
    out = []
    for i in range(nq):
        for j in range(nk):
            if not free[i][j]:
                continue
            w = next((x for x in range(j + 1, nk) if not free[i][x]), nk) - j
            h = next((y for y in range(i + 1, nq) if not all(free[y][j : j + w])), nq) - i
            h2 = next((y for y in range(i + 1, nq) if not free[y][j]), nq) - i
            w2 = (
                next(
                    (x for x in range(j + 1, nk) if not all(free[y][x] for y in range(i, i + h2))),
                    nk,
                )
                - j
            )
            if h2 * w2 > h * w:
                h, w = h2, w2
            for y in range(i, i + h):
                free[y][j : j + w] = [False] * w
            out.append((i, i + h, j, j + w))
    return out


def _fewest_rectangles(full: List[List[bool]]) -> List[Rect]:
    """A partition of the FULL tiles into rectangles (one kernel call each): the shorter of the
    row grouping and the greedy cover (``_greedy_rectangles``), exact either way. On a tie the
    greedy cover, which takes a staircase by columns: each backward call then holds gradient
    temporaries of one key tile and the query rows (rows would hold two key-wide ones)."""
    rows, greedy = _row_groups(full), _greedy_rectangles(full)
    return greedy if len(greedy) <= len(rows) else rows


def _batch_equal_calls(calls: List[Call], max_q: int, max_k: int) -> List[Call]:
    """FULL calls of one shape whose blocks step by a constant (query, key) offset, at least
    their own size (disjoint rows and keys), become one batched call (``Call.batch``) of at most
    ``max_q`` query rows and ``max_k`` keys in all: its gradient temporaries stay a fraction of
    the accumulators (a whole block diagonal in one call would double them)."""
    by_shape: dict = {}
    for c in calls:
        if c.kind == FULL:
            by_shape.setdefault((c.q.stop - c.q.start, c.k.stop - c.k.start), []).append(c)
    out = [c for c in calls if c.kind != FULL]
    for (lq, lk), group in by_shape.items():
        left = {(c.q.start, c.k.start): c for c in group}
        for c in sorted(group, key=lambda c: (c.q.start, c.k.start)):
            if (c.q.start, c.k.start) not in left:
                continue
            del left[c.q.start, c.k.start]
            step = next(
                (
                    (a - c.q.start, b - c.k.start)
                    for a, b in sorted(left)
                    if a - c.q.start >= lq and b - c.k.start >= lk
                ),
                None,
            )
            n = 1
            while (
                step is not None
                and (n + 1) * lq <= max_q
                and (n + 1) * lk <= max_k
                and (c.q.start + n * step[0], c.k.start + n * step[1]) in left
            ):
                del left[c.q.start + n * step[0], c.k.start + n * step[1]]
                n += 1
            out.append(c if n == 1 else Call(c.q, c.k, FULL, n, *step))
    return out


def _keep_partials(plan: BlockPlan, stats: Optional[EngineStats]) -> None:
    """Evaluate every PARTIAL call's mask once, at planning time: its rows without keys, and the
    mask itself while the plan's budget (``MASK_CACHE_ELEMENTS``) lasts."""
    budget = MASK_CACHE_ELEMENTS
    for index, c in enumerate(plan.calls):
        if c.kind != PARTIAL:
            continue
        m = plan.mask.dense(plan.q_ids[c.q], plan.k_ids[c.k]).cpu()
        if stats is not None:
            stats._mask(m.numel())
        dead = ~m.any(-1)
        if bool(dead.any()):
            plan.dead[index] = dead
        if m.numel() <= budget:
            plan.masks[index] = m
            budget -= m.numel()


def increasing_spans(ids: torch.Tensor) -> List[Tuple[int, int]]:
    """``(start, end)`` of maximal spans of strictly increasing ids (unions of ``id_runs``), pure."""
    return _spans(ids, ids[1:] <= ids[:-1])


def _tile_spans(tiles, spans):
    """For each span ``(start, end)`` (a union of runs), the index range of its tiles in ``tiles``."""
    starts = [t[0] for t in tiles]
    out, i = [], 0
    for a, e in spans:
        i0 = starts.index(a, i)
        i = i0
        while i < len(tiles) and tiles[i][1] <= e:
            i += 1
        out.append((i0, i))
    return out


def _causal_diagonals(plan, q_ids, k_ids, q_tiles, k_tiles, work, partial_kind) -> None:
    """One causal call for each pair of identical spans of strictly increasing ids whose tiles form
    a causal staircase (FULL below the diagonal, lower-triangle tiles on it, EMPTY above): the
    kernel's causal flag on positions then equals the mask inside the whole span (``j <= i`` iff
    ``id_j <= id_i``), so one call replaces one call per tile row (and a zigzag shard's two chunks
    take one call, not three)."""
    q_sp, k_sp = increasing_spans(q_ids), increasing_spans(k_ids)
    q_ti, k_ti = _tile_spans(q_tiles, q_sp), _tile_spans(k_tiles, k_sp)
    for (qa, qe), (i0, i1) in zip(q_sp, q_ti):
        for (ka, ke), (j0, j1) in zip(k_sp, k_ti):
            n = i1 - i0
            if (
                qe - qa != ke - ka
                or n < 2
                or j1 - j0 != n
                or not torch.equal(q_ids[qa:qe], k_ids[ka:ke])
            ):
                continue  # not the same ids (identical ids give identical tiles), or a single tile
            sub = work[i0:i1, j0:j1]
            below = torch.ones(n, n, dtype=torch.bool).tril(-1)
            if not (bool((sub[below] == FULL).all()) and bool((sub[below.T] == EMPTY).all())):
                continue
            if not all(
                int(sub[t, t]) == PARTIAL
                and partial_kind(i0 + t, j0 + t) == CAUSAL
                or (int(sub[t, t]) == FULL and q_tiles[i0 + t][1] - q_tiles[i0 + t][0] == 1)
                for t in range(n)
            ):
                continue
            plan.calls.append(Call(slice(qa, qe), slice(ka, ke), CAUSAL))
            work[i0:i1, j0:j1] = EMPTY


def flex_plan(q_ids, k_ids, mask, tile, stats) -> BlockPlan:
    """Fixed-size tiles over the whole block (FlexAttention's BlockMask has one block size)."""
    q_ids, k_ids = q_ids.long().cpu(), k_ids.long().cpu()
    if mask is None or mask.position_independent:
        nq, nk = -(-q_ids.numel() // tile), -(-k_ids.numel() // tile)
        status = torch.full((nq, nk), FULL, dtype=torch.uint8)
    else:
        status = torch.as_tensor(
            mask.tile_status(q_ids, k_ids, tile, tile), dtype=torch.uint8
        ).cpu()
    plan = BlockPlan(calls=[], q_ids=q_ids, k_ids=k_ids, mask=mask, tile=tile, status=status)
    for value in (EMPTY, PARTIAL, FULL):
        plan.counts[value] = int((status == value).sum())
    if plan.counts[EMPTY] < status.numel():
        plan.calls = [Call(slice(0, q_ids.numel()), slice(0, k_ids.numel()), FULL)]
    return plan
