"""The tiled local attention engine: linear memory, masks compiled to tiles on global token ids.

``plan_block`` cuts a block's (q ids x k ids) into tiles, classifies them EMPTY / PARTIAL / FULL and
groups them into kernel calls; ``block_forward`` / ``block_backward`` run them with fused kernels
merged through the log-sum-exp. Plans are host data, built once and reused (``attention.plans``).
Package map: ``docs/architecture.md``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..ops.rules import EMPTY, FULL, PARTIAL
from . import kernels
from .masks import AttentionMask, is_lower_triangle
from .plans import PLANS

__all__ = [
    "DEFAULT_TILE",
    "DEBUG_ENV",
    "EngineStats",
    "Call",
    "BlockPlan",
    "check_tile",
    "choose_tile",
    "kernel_block_size",
    "id_runs",
    "increasing_spans",
    "run_tiles",
    "plan_block",
    "plan_for",
    "cached_plan",
    "block_forward",
    "block_backward",
    "local_attention",
]

DEFAULT_TILE = 512
# PARTIAL tile masks a plan keeps (host, and one copy per device on first use); past it they are
# evaluated per call. Elements (bools) per plan.
MASK_CACHE_ELEMENTS = 1 << 24
DEBUG_ENV = "MEGATRON_VIDEO_CHECK_MASKS"
CAUSAL = (
    3  # a call kind: PARTIAL tile whose mask is exactly the lower triangle (kernel's causal flag)
)


@dataclass
class EngineStats:
    """Work and memory counters of the engine (forward and backward), accumulated over calls.

    ``steps`` blocks were planned (``steps_skipped`` had no visible pair at all); their tile grids
    held ``tiles`` tiles of which ``tiles_skipped`` EMPTY, ``tiles_full`` FULL, ``tiles_partial``
    PARTIAL; ``kernel_calls`` fused-kernel calls ran. ``max_mask_elements`` is the largest mask
    evaluated or allocated at once, ``max_score_elements`` the largest explicit score matrix
    (``"math"`` backend), both per (batch, head).
    """

    steps: int = 0
    steps_skipped: int = 0
    tiles: int = 0
    tiles_skipped: int = 0
    tiles_full: int = 0
    tiles_partial: int = 0
    kernel_calls: int = 0
    bwd_steps: int = 0
    bwd_steps_skipped: int = 0
    bwd_tiles: int = 0
    bwd_tiles_skipped: int = 0
    bwd_kernel_calls: int = 0
    max_mask_elements: int = 0
    max_score_elements: int = 0
    mask_seconds: float = 0.0

    def _mask(self, n: int) -> None:
        self.max_mask_elements = max(self.max_mask_elements, int(n))

    def _scores(self, n: int) -> None:
        self.max_score_elements = max(self.max_score_elements, int(n))

    def _plan(self, direction: str, plan: Optional["BlockPlan"]) -> None:
        """Count one ring step's block (None: a step whose K/V never reach this rank, routed
        away because none of its queries may attend them: skipped, no tiles)."""
        p = "" if direction == "fwd" else "bwd_"
        setattr(self, p + "steps", getattr(self, p + "steps") + 1)
        if plan is None:
            setattr(self, p + "steps_skipped", getattr(self, p + "steps_skipped") + 1)
            return
        setattr(self, p + "steps_skipped", getattr(self, p + "steps_skipped") + int(not plan.calls))
        setattr(self, p + "tiles", getattr(self, p + "tiles") + plan.num_tiles)
        setattr(self, p + "tiles_skipped", getattr(self, p + "tiles_skipped") + plan.counts[EMPTY])
        setattr(self, p + "kernel_calls", getattr(self, p + "kernel_calls") + len(plan.calls))
        if direction == "fwd":
            self.tiles_full += plan.counts[FULL]
            self.tiles_partial += plan.counts[PARTIAL]


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


def _debug() -> bool:
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
    debug = _debug() if debug is None else debug
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


# ----------------------------------------------------------------------------------------------
# Kernels on [b, h, s, d] views (q, k, v already expanded to q's heads)
# ----------------------------------------------------------------------------------------------
def _bias(m: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))[
        None, None
    ]


def _fwd_sdpa(q, k, v, call, m, scale):
    causal = call.kind == CAUSAL
    bias = _bias(m, q.dtype) if call.kind == PARTIAL else None
    if not q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]


def _bwd_sdpa(do, q, k, v, o, lse, call, m, scale):
    causal = call.kind == CAUSAL
    bias = _bias(m, q.dtype) if call.kind == PARTIAL else None
    if not q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        sq, sk = q.shape[2], k.shape[2]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale
        )
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, bias, o, lse, zero, zero, 0.0, [True, True, True, False], causal, scale=scale
    )[:3]


def _fwd_math(q, k, v, call, m, scale):
    acc = kernels.accumulation_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", p, v.to(acc)).to(q.dtype), lse


def _bwd_math(do, q, k, v, o, lse, call, m, scale):
    acc = kernels.accumulation_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    p = torch.exp(s - lse.to(acc)[..., None])
    do_ = do.to(acc)
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do_)
    dp = torch.einsum("bhqd,bhkd->bhqk", do_, v.to(acc))
    delta = (do_ * o.to(acc)).sum(-1)
    ds = p * (dp - delta[..., None])
    return (
        torch.einsum("bhqk,bhkd->bhqd", ds, k.to(acc)) * scale,
        torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)) * scale,
        dv,
    )


def _merge(out_acc, lse_acc, o, lse):
    """Online-softmax merge of a partial result into the accumulators (in place, [b, h, s, *])."""
    new = torch.logaddexp(lse_acc, lse)
    shift = torch.where(torch.isneginf(new), 0.0, new)  # rows still without keys stay 0 / -inf
    # The weights exp(lse_acc - new) and exp(lse - new) sum to 1, so the merge is one fused pass
    # out += w * (o - out) with no temporary of the output's size (w = 0 / 1 on rows without keys).
    out_acc.lerp_(o.to(out_acc.dtype), torch.exp(lse - shift)[..., None])
    lse_acc.copy_(new)


def _heads_first(x: torch.Tensor, heads: int, contiguous: bool) -> torch.Tensor:
    """``[b, s, hk, d] -> [b, h, s, d]`` with kv heads repeated to ``heads`` (GQA)."""
    x = kernels._expand_kv(x, heads).transpose(1, 2)
    return x.contiguous() if contiguous else x


def _flex_block_mask(plan: BlockPlan, device):
    """FlexAttention ``BlockMask`` of the block: PARTIAL tiles masked by ``mask_mod`` on global ids,
    FULL tiles without it, EMPTY tiles absent (built once per plan)."""
    from torch.nn.attention.flex_attention import BlockMask

    from ..ops.masks import flex_block_fields

    if plan.flex is None:
        qi, ki = plan.q_ids.to(device), plan.k_ids.to(device)
        mod = plan.mask.mask_mod(qi, ki) if plan.mask is not None else None
        fields = flex_block_fields(plan.status.to(device))
        plan.flex = BlockMask.from_kv_blocks(
            *fields,
            BLOCK_SIZE=(plan.tile, plan.tile),
            mask_mod=mod,
            seq_lengths=(qi.numel(), ki.numel()),
        )
    return plan.flex


def _flex_plan(q_ids, k_ids, mask, tile, stats) -> BlockPlan:
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


def _rows(x: torch.Tensor, rows: slice, dim: int, batch: int = 1, step: int = 0) -> torch.Tensor:
    """``x`` narrowed to ``rows`` along ``dim``; with ``batch > 1`` the blocks ``rows + i * step``
    stacked along dim 0 (a strided view; ``x.shape[0]`` must be 1)."""
    if batch == 1:
        return x.narrow(dim, rows.start, rows.stop - rows.start)
    size, stride = list(x.shape), list(x.stride())
    size[dim] = rows.stop - rows.start
    size[0], stride[0] = batch, step * stride[dim]
    return x.as_strided(size, stride, x.storage_offset() + rows.start * stride[dim])


def _runnable(plan: BlockPlan, order, b: int):
    """``(index, call)`` in ``order``; batched calls split into single ones unless batch is 1."""
    for index in order:
        c = plan.calls[index]
        for one in [c] if c.batch == 1 or b == 1 else c.blocks():
            yield index, one


def _fwd_call(qt, kt, vt, plan, index, c, scale, fwd, stats, acc_dtype):
    """``(o, lse)`` of one call (``[batch, h, n, d]``, ``[batch, h, n]``), rows without keys
    zero / -inf."""
    if fwd is _fwd_math and stats is not None:
        stats._scores((c.q.stop - c.q.start) * (c.k.stop - c.k.start))
    m = (
        plan.tile_mask(c, qt.device, stats, index)
        if (c.kind == PARTIAL or fwd is _fwd_math)
        else None
    )
    n, qs, ks = c.batch, c.q_step, c.k_step
    o, lse = fwd(
        _rows(qt, c.q, 2, n, qs), _rows(kt, c.k, 2, n, ks), _rows(vt, c.k, 2, n, ks), c, m, scale
    )
    lse = lse.to(acc_dtype)
    dead = plan.dead_rows(index, qt.device) if c.kind == PARTIAL else None
    if dead is not None:  # fused kernels report lse = 0 (or NaN) for rows without keys
        lse = lse.masked_fill(dead, float("-inf"))
        o = o.masked_fill(dead[:, None], 0.0)
    return o, lse


def block_forward(
    out_acc: Optional[torch.Tensor],
    lse_acc: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    backend: str,
    stats: Optional[EngineStats] = None,
    fresh: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Attention of ``q [b, sq, h, d]`` over ``k, v [b, sk, hk, d]`` merged into the accumulators
    ``out_acc [b, h, sq, d]`` and ``lse_acc [b, h, sq]`` (accumulation dtype, in place); returns
    the accumulators.

    ``fresh``: the accumulators hold nothing yet, so a call whose rows no earlier call touched is
    written instead of merged. With ``fresh`` the accumulators may be ``None``: a first call that
    covers every row in the accumulation dtype then becomes them (no zero fill, no copy); otherwise
    they are allocated (``accumulators``). Without any call they stay as given.
    """
    if not plan.calls:
        return out_acc, lse_acc
    if out_acc is None and not fresh:
        raise ValueError("block_forward: out_acc / lse_acc may be None only with fresh=True")
    h = q.shape[2]
    if backend == "flex":
        from .kernels import _compiled_flex

        qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
        bm = _flex_block_mask(plan, q.device)
        o, lse = _compiled_flex(q.device.type)(
            qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=k.shape[2] != h, return_lse=True
        )
        if out_acc is None:
            out_acc, lse_acc = accumulators(q)
        _merge(out_acc, lse_acc, o, lse.to(lse_acc.dtype))  # flex: -inf on rows without keys
        return out_acc, lse_acc
    qt = q.transpose(1, 2)
    acc_dtype = kernels.accumulation_dtype(q.dtype)
    kt, vt = _heads_first(k, h, False), _heads_first(v, h, False)
    fwd = _fwd_math if backend == "math" else _fwd_sdpa
    touched = []  # q rows written in this block
    for index, c in _runnable(plan, range(len(plan.calls)), q.shape[0]):
        o, lse = _fwd_call(qt, kt, vt, plan, index, c, scale, fwd, stats, acc_dtype)
        rows = c.q_rows
        if out_acc is None:
            if c.batch == 1 and rows == (0, q.shape[1]) and o.dtype == acc_dtype:
                out_acc, lse_acc = o, lse  # the kernel's fresh buffers become the accumulators
                touched.append(rows)
                continue
            out_acc, lse_acc = accumulators(q)
        out_c = _rows(out_acc, c.q, 2, c.batch, c.q_step)
        lse_c = _rows(lse_acc, c.q, 2, c.batch, c.q_step)
        if fresh and not any(a < rows[1] and rows[0] < e for a, e in touched):
            out_c.copy_(o)
            lse_c.copy_(lse)
        else:
            _merge(out_c, lse_c, o, lse)
        touched.append(rows)
    return out_acc, lse_acc


def _grad_zeros(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, _, d = x.shape
    return torch.zeros(b, s, heads, d, dtype=kernels.accumulation_dtype(x.dtype), device=x.device)


def _accumulate(
    acc: Optional[torch.Tensor],
    rows: slice,
    g: torch.Tensor,
    like: torch.Tensor,
    heads: int,
    batch: int = 1,
    step: int = 0,
) -> torch.Tensor:
    """``acc[:, rows] += g`` (``g [b, h, n, d]``; batched: block ``i`` at ``rows + i * step``); a
    missing ``acc`` becomes ``g`` itself when ``g`` covers every row in the accumulation dtype (no
    zero fill, no copy), else zeros first."""
    g = g.transpose(1, 2)
    if acc is None:
        if (
            batch == 1
            and rows.start == 0
            and rows.stop == like.shape[1]
            and g.dtype == kernels.accumulation_dtype(like.dtype)
        ):
            return g
        acc = _grad_zeros(like, heads)
    _rows(acc, rows, 1, batch, step).add_(g)
    return acc


def block_backward(
    dq_acc: Optional[torch.Tensor],
    dk_acc: Optional[torch.Tensor],
    dv_acc: Optional[torch.Tensor],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    backend: str,
    stats: Optional[EngineStats] = None,
    fresh: bool = False,
):
    """Accumulate this block's ``dq [b, sq, h, d]`` and ``dk, dv [b, sk, h, d]`` (expanded heads,
    accumulation dtype) given the GLOBAL ``out [b, h, sq, d]`` and ``lse [b, h, sq]`` of the rows
    (``lse = +inf`` on rows without any visible key, so their gradients are zero); returns the
    accumulators. With ``fresh`` an accumulator may be None: the first call's gradient becomes it
    where it covers every position, else it is allocated; it stays None without any call."""
    if not plan.calls:
        return dq_acc, dk_acc, dv_acc
    if dq_acc is None or dk_acc is None or dv_acc is None:
        if not fresh:
            raise ValueError("block_backward: accumulators may be None only with fresh=True")
    h = q.shape[2]
    if backend == "flex":
        dq_acc = _grad_zeros(q, h) if dq_acc is None else dq_acc
        dk_acc = _grad_zeros(k, h) if dk_acc is None else dk_acc
        dv_acc = _grad_zeros(v, h) if dv_acc is None else dv_acc
        _flex_backward(dq_acc, dk_acc, dv_acc, dout, q, k, v, out, lse, plan, scale)
        return dq_acc, dk_acc, dv_acc
    # torch's CPU kernels take strided [b, h, s, d] views: no copies of q, k, v, out or dout per step
    qt = q.transpose(1, 2)
    kt, vt = _heads_first(k, h, False), _heads_first(v, h, False)
    bwd = _bwd_math if backend == "math" else _bwd_sdpa
    for index, c in _runnable(plan, plan.backward_order(), q.shape[0]):
        m = (
            plan.tile_mask(c, q.device, stats, index)
            if (c.kind == PARTIAL or backend == "math")
            else None
        )
        n, qs, ks = c.batch, c.q_step, c.k_step
        g = bwd(  # each part dropped once accumulated: not held while the next is allocated
            _rows(dout, c.q, 2, n, qs),
            _rows(qt, c.q, 2, n, qs),
            _rows(kt, c.k, 2, n, ks),
            _rows(vt, c.k, 2, n, ks),
            _rows(out, c.q, 2, n, qs),
            _rows(lse, c.q, 2, n, qs),
            c,
            m,
            scale,
        )
        g = list(g)
        dq_acc = _accumulate(dq_acc, c.q, g.pop(0), q, h, n, qs)
        dk_acc = _accumulate(dk_acc, c.k, g.pop(0), k, h, n, ks)
        dv_acc = _accumulate(dv_acc, c.k, g.pop(0), v, h, n, ks)
    return dq_acc, dk_acc, dv_acc


def _flex_backward(dq_acc, dk_acc, dv_acc, dout, q, k, v, out, lse, plan, scale):
    """Recompute the block under autograd and back-propagate the merged output's gradient.

    With ``w = exp(lse_block - lse)``: ``d out_block = w * dout`` and
    ``d lse_block = w * rowsum(dout * (out_block - out))`` (the LSE merge's derivative).
    """
    from .kernels import _compiled_flex

    h = q.shape[2]
    with torch.enable_grad():
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        bm = _flex_block_mask(plan, q.device)
        o, lb = _compiled_flex(q.device.type)(
            qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=k.shape[2] != h, return_lse=True
        )
        glob = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
        w = torch.exp(lb.detach().to(glob.dtype) - glob)
        w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        g_o = (w[..., None] * dout.to(w.dtype)).to(o.dtype)
        g_l = (w * (dout.to(w.dtype) * (o.detach().to(w.dtype) - out.to(w.dtype))).sum(-1)).to(
            lb.dtype
        )
        dq, dk, dv = torch.autograd.grad((o, lb), (qt, kt, vt), (g_o, g_l), allow_unused=True)
    hk = k.shape[2]
    dq_acc += dq.transpose(1, 2).to(dq_acc.dtype)
    # dk/dv come back with the kv heads of k; spread them on the expanded accumulator's first copy
    rep = h // hk
    dk = dk.transpose(1, 2).to(dk_acc.dtype)
    dv = dv.transpose(1, 2).to(dv_acc.dtype)
    if rep == 1:
        dk_acc += dk
        dv_acc += dv
    else:
        dk_acc.view(*dk_acc.shape[:2], hk, rep, dk_acc.shape[-1])[:, :, :, 0] += dk
        dv_acc.view(*dv_acc.shape[:2], hk, rep, dv_acc.shape[-1])[:, :, :, 0] += dv


def plan_for(
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    mask: Optional[AttentionMask],
    tile: int,
    backend: str,
    stats: Optional[EngineStats] = None,
) -> BlockPlan:
    """The plan a backend runs: fixed tiles over the block for ``"flex"``, run tiles otherwise."""
    t0 = time.perf_counter()
    if backend == "flex":
        plan = _flex_plan(q_ids, k_ids, mask, tile, stats)
    else:
        plan = plan_block(q_ids, k_ids, mask, tile, merge=backend != "math", stats=stats)
    if stats is not None:
        stats.mask_seconds += time.perf_counter() - t0
    return plan


def cached_plan(
    ids_key,
    q_ids: torch.Tensor,
    k_ids: torch.Tensor,
    mask: Optional[AttentionMask],
    tile: int,
    backend: str,
    device,
    stats: Optional[EngineStats] = None,
    cache: bool = True,
) -> BlockPlan:
    """``plan_for`` through the plan cache: ``ids_key`` (hashable) must determine ``q_ids`` and
    ``k_ids``; ``cache=False`` builds without keeping (a mask that lives for one call)."""
    debug = _debug()
    key = ("block", ids_key, mask, tile, backend, str(device), debug) if cache else None
    return PLANS.get(key, lambda: plan_for(q_ids, k_ids, mask, tile, backend, stats))


def engine_backend(backend: str, q: torch.Tensor) -> str:
    """The engine's kernel family for ``backend`` and ``q``: ``"math"``, ``"sdpa"`` or ``"flex"``."""
    if backend == "auto":
        if q.dtype == torch.float64:
            return "math"
        if q.is_cuda and kernels._flex() is not None:
            return "flex"
        return "sdpa" if (q.is_cuda or kernels._has_cpu_flash()) else "math"
    if backend not in ("math", "sdpa", "flex", "flash_attn"):
        raise ValueError(f"backend ({backend!r}) must be 'auto' or one of {kernels.BACKENDS}")
    if backend not in kernels.available_backends():
        raise ValueError(
            f"backend ({backend!r}) is not available here (available: "
            f"{kernels.available_backends()})"
        )
    if backend == "flash_attn":  # torch's flash kernel runs the unmasked fp16/bf16 calls on CUDA
        return "sdpa"
    if backend == "flex" and not q.is_cuda:
        return (
            "sdpa"  # FlexAttention has no backward on CPU; same tiles through the CPU flash kernel
        )
    return backend


def accumulators(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zero ``out [b, h, s, d]`` and ``-inf`` ``lse [b, h, s]`` in the accumulation dtype."""
    b, s, h, d = q.shape
    acc = kernels.accumulation_dtype(q.dtype)
    return (
        torch.zeros(b, h, s, d, dtype=acc, device=q.device),
        torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device),
    )


class _EngineAttention(torch.autograd.Function):
    """One block (all queries x all keys) through the engine, with its own backward."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, backend, stats):
        out, lse = block_forward(None, None, q, k, v, plan, scale, backend, stats, fresh=True)
        if out is None:  # no visible pair at all
            out, lse = accumulators(q)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.backend, ctx.stats = plan, scale, backend, stats
        ctx.mark_non_differentiable(lse)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        hk, h = k.shape[2], q.shape[2]
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        dq, dk, dv = block_backward(
            None,
            None,
            None,
            dout.transpose(1, 2).to(q.dtype),
            q,
            k,
            v,
            out,
            lse,
            ctx.plan,
            ctx.scale,
            ctx.backend,
            ctx.stats,
            fresh=True,
        )
        dq = _grad_zeros(q, h) if dq is None else dq
        dk = _grad_zeros(k, h) if dk is None else dk
        dv = _grad_zeros(v, h) if dv is None else dv
        return (
            dq.to(q.dtype),
            kernels._reduce_kv(dk, hk).to(k.dtype),
            kernels._reduce_kv(dv, hk).to(v.dtype),
            None,
            None,
            None,
            None,
        )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    tile: Optional[int] = None,
    stats: Optional[EngineStats] = None,
):
    """Autograd-aware single-process attention through the engine: ``(out [b, sq, h, d], lse [b, h, sq])``.

    ``q [b, sq, h, d]``, ``k, v [b, sk, h_kv, d]`` (any ``sk``, e.g. cross-attention); ``mask`` is None,
    an ``AttentionMask`` on positions ``0..sq-1`` x ``0..sk-1``, or a bool ``[sq, sk]`` tensor (read one
    tile at a time). A ``[b, h, sq, sk]`` mask takes the dense kernels of ``attention.kernels``.
    Gradients flow through ``out``.
    """
    from .masks import AttentionMask, from_dense

    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return kernels.dense_local_attention(q, k, v, mask, softmax_scale, backend)
    kernels._check(q, k, v, mask if isinstance(mask, torch.Tensor) else None)
    one_call = isinstance(mask, torch.Tensor)
    if one_call:
        mask = from_dense(mask, copy=False)  # lives for this call only: its plan is not kept
    elif mask is not None and not isinstance(mask, AttentionMask):
        raise ValueError(
            f"mask ({type(mask).__name__}) must be None, an AttentionMask or a bool tensor"
        )
    kernel = engine_backend(backend, q)
    tile = (
        choose_tile(mask, kernel, q.device) if tile is None else check_tile(tile, kernel, q.device)
    )
    scale = kernels._scale(softmax_scale, q.shape[-1])
    sq, sk = q.shape[1], k.shape[1]
    plan = cached_plan(
        ("local", sq, sk),
        torch.arange(sq),
        torch.arange(sk),
        mask,
        tile,
        kernel,
        q.device,
        stats,
        cache=not one_call,
    )
    if stats is not None:
        stats._plan("fwd", plan)
    return _EngineAttention.apply(q, k, v, plan, scale, kernel, stats)
