"""Index maps of multi-modal sequence parallelism (MM-SP, LongVILA's two-stage sharding): stage 1
(``frame_shards``: frames -> CP ranks for the encoder) and stage 2 (``sequence_layout``,
``reshard_plan``: visual tokens -> the LLM's zigzag shard, and inverses). Pure and rank-explicit; no
communication. Design: docs/architecture.md, "Capabilities" 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..checks import check_int, check_rank
from .zigzag import shard_global_ids, shard_owner

__all__ = [
    "FrameShards",
    "frame_shards",
    "SequenceLayout",
    "sequence_layout",
    "ReshardPlan",
    "reshard_plan",
    "visual_targets",
    "position_sources",
    "causal_work",
]


# ---------------------------------------------------------------------------------------------
# Stage 1: frames (units) over the CP group
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameShards:
    """Which CP rank encodes which unit (tubelet) of which video."""

    num_frames: Tuple[int, ...]  # per video
    tubelet_size: int
    cp_size: int
    counts: torch.Tensor  # [cp_size, n_videos] units of video j encoded by rank r
    owner: torch.Tensor  # [total_units] rank encoding global unit u
    local_index: torch.Tensor  # [total_units] index of unit u in its owner's local list

    @property
    def units_per_video(self) -> List[int]:
        return [f // self.tubelet_size for f in self.num_frames]

    @property
    def total_units(self) -> int:
        return int(self.owner.numel())

    def local_units(self, rank: int) -> torch.Tensor:
        """Global unit ids encoded by ``rank`` (ascending: video-major, then time)."""
        self._check_rank(rank)
        return torch.nonzero(self.owner == rank).flatten()

    def local_frames(self, rank: int) -> torch.Tensor:
        """Global frame ids (frames of all videos concatenated) of ``rank``'s units, in order."""
        u = self.local_units(rank)
        t = self.tubelet_size
        return (u[:, None] * t + torch.arange(t)[None]).flatten()

    def _check_rank(self, rank):
        check_rank("rank", rank, self.cp_size, "cp_size")


def frame_shards(num_frames: Sequence[int], cp_size: int, tubelet_size: int = 1) -> FrameShards:
    """Stage-1 split of every video's units over ``cp_size`` ranks (see the module docstring).

    ``num_frames[j]`` must be divisible by ``tubelet_size`` and give at least ``cp_size`` units:
    every CP rank encodes at least one tubelet of every video.

    Stage 1 (vision encoder + projector): every CP rank encodes a share of every video's *units*
    (tubelets of ``tubelet_size`` frames; a unit is the encoder's independent input, a frame for a
    per-frame ViT). Video ``j`` with ``n_j = num_frames[j] / tubelet_size`` units is cut into
    ``cp_size`` contiguous runs of ``n_j // cp_size`` or ``n_j // cp_size + 1`` units; the
    ``n_j % cp_size`` longer runs go to the ranks after the ones that got the previous video's
    longer runs (a rotating offset), so over a micro-batch the ranks' unit counts differ by at most
    one. A rank's local units are in global order (video-major), and unit ``u`` yields
    ``tokens_per_unit`` consecutive visual tokens.
    """
    check_int("cp_size", cp_size, 1)
    check_int("tubelet_size", tubelet_size, 1)
    frames = []
    for j, f in enumerate(list(num_frames)):
        if isinstance(f, torch.Tensor) and f.dim() == 0 and not f.is_floating_point():
            f = int(f)
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"num_frames[{j}] ({f!r}) must be a positive integer")
        if f % tubelet_size:
            raise ValueError(
                f"num_frames[{j}] ({f}) must be divisible by tubelet_size "
                f"({tubelet_size}): tubelets never straddle a shard boundary"
            )
        if f // tubelet_size < cp_size:
            raise ValueError(
                f"num_frames[{j}] ({f}) must be >= cp_size ({cp_size}) * tubelet_size "
                f"({tubelet_size}): every CP rank encodes at least one tubelet of every "
                f"video"
            )
        frames.append(f)
    counts = torch.zeros(cp_size, len(frames), dtype=torch.long)
    owner, local = [], []
    next_local = [0] * cp_size
    offset = 0
    for j, f in enumerate(frames):
        n = f // tubelet_size
        base, rem = divmod(n, cp_size)
        for r in range(cp_size):
            k = base + (1 if (r - offset) % cp_size < rem else 0)
            counts[r, j] = k
            owner += [r] * k
            local += list(range(next_local[r], next_local[r] + k))
            next_local[r] += k
        offset = (offset + rem) % cp_size
    return FrameShards(
        tuple(frames),
        tubelet_size,
        cp_size,
        counts,
        torch.tensor(owner, dtype=torch.long),
        torch.tensor(local, dtype=torch.long),
    )


# ---------------------------------------------------------------------------------------------
# Stage 2: the combined text + visual sequence and its CP layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceLayout:
    """Where every text and visual token sits in the padded combined batch ``[batch, seq_len]``."""

    batch: int
    text_len: int
    seq_len: int  # padded combined length (multiple of 2 * cp_size)
    lengths: torch.Tensor  # [batch] combined length of each sample (before padding)
    cp_size: int
    text_src: torch.Tensor  # [n_text] flat index b * text_len + i into input_ids
    text_pos: torch.Tensor  # [n_text] flat combined position b * seq_len + s
    visual_pos: torch.Tensor  # [n_visual] flat combined position, source order

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size


def sequence_layout(
    input_ids: torch.Tensor,
    image_token_index: int,
    tokens_per_video: Sequence[int],
    cp_size: int,
    seq_len: Optional[int] = None,
) -> SequenceLayout:
    """The combined sequence of a batch (``input_ids [batch, text_len]``).

    ``tokens_per_video[i]``: visual tokens of the ``i``-th image token (row-major). ``seq_len``:
    a minimum padded length (e.g. a pipeline's fixed length); the result is the smallest multiple of
    ``2 * cp_size`` that holds every sample and is at least ``seq_len``.

    Stage 2 (LLM): the combined sequence of a sample is its text with each image token replaced by
    its video's visual tokens (Megatron-Core's ``LLaVAModel`` convention: the visual tokens of the
    ``i``-th image token of the row-major ``input_ids`` are those of the ``i``-th video). The
    batch's combined sequences are padded to ``seq_len`` (a multiple of ``2 * cp_size``) and laid
    out by the zigzag scheme (``layouts.zigzag``: CP rank ``c`` holds chunks ``c`` and ``2N-1-c`` of
    every sample; what Megatron's RoPE and ``DistAttention2D(scheme="zigzag")`` assume).
    ``reshard_plan`` says, for one rank, which of its visual tokens go to which rank (send order:
    destination rank, then destination position) and where the received ones and its text tokens
    land; ``visual_targets`` / ``position_sources`` are the forward map and its inverse for all
    ranks.
    """
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
    ):
        raise ValueError(
            f"input_ids ({getattr(input_ids, 'dtype', type(input_ids).__name__)} "
            f"{tuple(getattr(input_ids, 'shape', ()))}) must be an integer tensor "
            f"[batch, text_len]"
        )
    check_int("cp_size", cp_size, 1)
    ids = input_ids.detach().cpu().long()
    B, T = ids.shape
    is_img = ids == image_token_index
    n_img = int(is_img.sum())
    tpv = [int(t) for t in tokens_per_video]
    if len(tpv) != n_img:
        raise ValueError(
            f"tokens_per_video ({len(tpv)} videos) must have one entry per image token "
            f"({image_token_index}) in input_ids ({n_img})"
        )
    if any(t < 1 for t in tpv):
        raise ValueError(f"tokens_per_video ({tpv}) must be positive")
    width = torch.ones(B, T, dtype=torch.long)
    width[is_img] = torch.tensor(tpv, dtype=torch.long)
    start = torch.cumsum(width, dim=1) - width  # combined start of each input token
    lengths = width.sum(dim=1)
    need = int(lengths.max()) if B else 0
    if seq_len is not None:
        need = max(need, check_int("seq_len", seq_len, 0))
    S = -(-need // (2 * cp_size)) * (2 * cp_size)
    rows = torch.arange(B)[:, None].expand(B, T)
    text_mask = ~is_img
    text_src = (rows * T + torch.arange(T)[None])[text_mask]
    text_pos = (rows * S + start)[text_mask]
    vis = []
    for b, i in torch.nonzero(is_img).tolist():
        s0 = int(start[b, i])
        vis.append(b * S + s0 + torch.arange(int(width[b, i])))
    visual_pos = torch.cat(vis) if vis else torch.zeros(0, dtype=torch.long)
    return SequenceLayout(B, T, S, lengths, cp_size, text_src, text_pos, visual_pos)


def _zigzag_flat(
    layout: SequenceLayout, flat_pos: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat combined positions -> (CP rank, flat local index b * local_len + local s)."""
    S, L = layout.seq_len, layout.local_len
    b, s = flat_pos // S, flat_pos % S
    if flat_pos.numel() == 0:
        return flat_pos.clone(), flat_pos.clone()
    rank, local = shard_owner(s, layout.cp_size, S, "zigzag")
    return rank, b * L + local


def visual_targets(layout: SequenceLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward map of stage 2: ``(rank, flat local index)`` of every visual token (source order)."""
    return _zigzag_flat(layout, layout.visual_pos)


def position_sources(
    layout: SequenceLayout, shards: FrameShards, tokens_per_unit: int, rank: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse map for ``rank``: for each of its ``batch * local_len`` positions (flat, ``b``-major)
    ``(kind, source rank, source index)``: kind 0 padding, 1 text (source index into the flattened
    ``input_ids``; source rank -1: every rank has the text), 2 visual (source index into the
    source rank's local visual tokens)."""
    S = layout.seq_len
    ids = shard_global_ids(rank, layout.cp_size, S, "zigzag")
    flat = (torch.arange(layout.batch)[:, None] * S + ids[None]).flatten()
    kind = torch.zeros(flat.numel(), dtype=torch.long)
    src_rank = torch.full_like(kind, -1)
    src_idx = torch.full_like(kind, -1)
    where = torch.full((layout.batch * S,), -1, dtype=torch.long)
    where[layout.text_pos] = torch.arange(layout.text_pos.numel())
    t = where[flat]
    kind[t >= 0], src_idx[t >= 0] = 1, layout.text_src[t[t >= 0]]
    where.fill_(-1)
    where[layout.visual_pos] = torch.arange(layout.visual_pos.numel())
    v = where[flat]
    sel = v >= 0
    unit = v[sel] // tokens_per_unit
    kind[sel] = 2
    src_rank[sel] = shards.owner[unit]
    src_idx[sel] = shards.local_index[unit] * tokens_per_unit + v[sel] % tokens_per_unit
    return kind, src_rank, src_idx


@dataclass(frozen=True)
class ReshardPlan:
    """One rank's part of the stage-2 all-to-all-v and of the assembly of its LLM shard."""

    rank: int
    send_index: torch.Tensor  # rows of the local visual tokens, in send order
    send_counts: List[int]  # per destination rank
    recv_counts: List[int]  # per source rank
    text_index: torch.Tensor  # flat input_ids indices of the text tokens this rank holds
    gather: torch.Tensor  # [batch * local_len] row of cat([zero, text, received]) per position
    positions: torch.Tensor  # [local_len] global (combined) position of each local token


def reshard_plan(
    layout: SequenceLayout, shards: FrameShards, tokens_per_unit: int, rank: int
) -> ReshardPlan:
    """Rank ``rank``'s send / receive lists and local assembly (see the module docstring)."""
    N = layout.cp_size
    if shards.cp_size != N:
        raise ValueError(f"shards.cp_size ({shards.cp_size}) must equal layout.cp_size ({N})")
    check_int("tokens_per_unit", tokens_per_unit, 1)
    n_vis = layout.visual_pos.numel()
    if n_vis != shards.total_units * tokens_per_unit:
        raise ValueError(
            f"visual tokens of the sequence ({n_vis}) must equal units ({shards.total_units})"
            f" * tokens_per_unit ({tokens_per_unit})"
        )
    dst, dst_local = visual_targets(layout)
    unit = torch.arange(n_vis) // tokens_per_unit
    src = shards.owner[unit] if n_vis else unit
    src_local = (
        shards.local_index[unit] * tokens_per_unit + torch.arange(n_vis) % tokens_per_unit
        if n_vis
        else unit
    )
    big = layout.batch * layout.local_len + 1
    # send: my tokens ordered by (destination rank, destination position)
    mine = torch.nonzero(src == rank).flatten()
    order = torch.argsort(dst[mine] * big + dst_local[mine])
    send_index = src_local[mine][order]
    send_counts = torch.bincount(dst[mine], minlength=N).tolist()
    # receive: tokens for me ordered by (source rank, my position) -- the senders' order
    theirs = torch.nonzero(dst == rank).flatten()
    rorder = torch.argsort(src[theirs] * big + dst_local[theirs])
    recv_local = dst_local[theirs][rorder]
    recv_counts = torch.bincount(src[theirs], minlength=N).tolist()
    # text tokens that land on me
    t_rank, t_local = _zigzag_flat(layout, layout.text_pos)
    tmine = torch.nonzero(t_rank == rank).flatten()
    text_index = layout.text_src[tmine]
    gather = torch.zeros(layout.batch * layout.local_len, dtype=torch.long)
    gather[t_local[tmine]] = 1 + torch.arange(tmine.numel())
    gather[recv_local] = 1 + tmine.numel() + torch.arange(recv_local.numel())
    positions = shard_global_ids(rank, N, layout.seq_len, "zigzag")
    return ReshardPlan(rank, send_index, send_counts, recv_counts, text_index, gather, positions)


def causal_work(
    layout: SequenceLayout, rank: int, cu_seqlens: Optional[torch.Tensor] = None
) -> int:
    """Causal attention work of ``rank``'s tokens: the number of (query, key) pairs its queries may
    attend (keys at or before the query, inside the query's sample -- or packed document when
    ``cu_seqlens`` over the combined sequence is given; padding attends nothing). Pure."""
    S = layout.seq_len
    q = shard_global_ids(rank, layout.cp_size, S, "zigzag")
    total = 0
    for b in range(layout.batch):
        n = int(layout.lengths[b])
        cu = torch.tensor([0, n]) if cu_seqlens is None else torch.as_tensor(cu_seqlens).long()
        doc = torch.searchsorted(cu, q, right=True) - 1
        valid = q < cu[-1]
        starts = cu[doc.clamp(min=0, max=cu.numel() - 2)]
        total += int(torch.where(valid, q - starts + 1, torch.zeros_like(q)).sum())
    return total
