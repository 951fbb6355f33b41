"""Balanced SP for autoregressive teacher forcing (LongLive-2.0): pure, rank-explicit index maps
and masks, free of communication. Design: docs/architecture.md, "Capabilities" 2; the layout and
its ring balancing are described on ``BalancedSPLayout``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..checks import check_positive_int, check_rank
from ..ops.rules import CLEAN, EMPTY, FULL, NOISY, PARTIAL  # noqa: F401  (the one rule definition)
from ..ops.rules import teacher_forcing as teacher_forcing_rule

__all__ = [
    "BalancedSPLayout",
    "teacher_forcing_rule",
    "single_gpu_teacher_forcing_mask",
    "check_whole_blocks",
    "naive_slice_global_ids",
    "naive_identity_units",
    "ring_attention_work",
    "max_over_mean",
]


def check_whole_blocks(num_latent_frames: int, frames_per_block: int) -> None:
    """The one partial-block rule of teacher forcing, for every path (single-GPU mask, Balanced SP
    layout, work accounting): a clip is whole blocks, else ``ValueError``."""
    check_positive_int("num_latent_frames", num_latent_frames)
    check_positive_int("frames_per_block", frames_per_block)
    if num_latent_frames % frames_per_block:
        raise ValueError(
            f"num_latent_frames ({num_latent_frames}) must be a multiple of frames_per_block "
            f"({frames_per_block}): teacher forcing has no rule for a partial last block (as "
            f"LongLive, blocks are whole); trim the clip to whole blocks"
        )


def single_gpu_teacher_forcing_mask(
    num_latent_frames: int, tokens_per_frame: int, frames_per_block: int
) -> torch.Tensor:
    """Bool ``[2FS, 2FS]`` mask in the single-GPU order ``[clean 0..F-1 ; noisy 0..F-1]``."""
    F, S, nb = num_latent_frames, tokens_per_frame, frames_per_block
    check_positive_int("tokens_per_frame", S)
    check_whole_blocks(F, nb)
    g = torch.arange(2 * F * S)
    side, block = g // (F * S), (g % (F * S)) // S // nb
    return teacher_forcing_rule(side[:, None], block[:, None], side[None, :], block[None, :])


def ring_attention_work(
    unit_side: torch.Tensor, unit_block: torch.Tensor, unit_tokens: int, ring_size: int
) -> List[int]:
    """Unmasked (query, key) pairs whose query lies in each of ``ring_size`` contiguous slices.

    ``unit_side`` / ``unit_block`` give the identity of each unit (``unit_tokens`` tokens sharing one
    side and block) in attention order; after the Ulysses gather ring rank ``rho`` holds the
    ``rho``-th contiguous slice of that order as queries and visits every key over the ring.
    """
    n = unit_side.numel()
    if n % ring_size:
        raise ValueError(f"number of mask units ({n}) must be divisible by ring_size ({ring_size})")
    m = teacher_forcing_rule(
        unit_side[:, None], unit_block[:, None], unit_side[None, :], unit_block[None, :]
    )
    per_unit = m.sum(dim=1).to(torch.int64) * unit_tokens * unit_tokens
    return [int(x) for x in per_unit.view(ring_size, -1).sum(dim=1)]


def max_over_mean(values: Sequence[float]) -> float:
    """Imbalance ratio ``max / mean`` (1.0 = perfectly balanced)."""
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals)
    return max(vals) / mean if mean else float("inf")


def naive_slice_global_ids(
    num_latent_frames: int, tokens_per_frame: int, sp_size: int, rank: int
) -> torch.Tensor:
    """Naive Ulysses slicing (the baseline): rank ``r`` takes the ``r``-th contiguous slice of
    ``[clean ; noisy]``; returns the single-GPU ids it holds."""
    n = 2 * num_latent_frames * tokens_per_frame
    if n % sp_size:
        raise ValueError(
            f"2 * num_latent_frames * tokens_per_frame ({n}) must be divisible by "
            f"sp_size ({sp_size})"
        )
    per = n // sp_size
    return torch.arange(rank * per, (rank + 1) * per)


def naive_identity_units(
    num_latent_frames: int, frames_per_block: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(side, block) of each block-unit in the naive (single-GPU) order, for work accounting."""
    check_whole_blocks(num_latent_frames, frames_per_block)
    K = num_latent_frames // frames_per_block
    u = torch.arange(2 * K)
    return u // K, u % K


class BalancedSPLayout:
    """Balanced SP layout of ``[clean ; noisy]`` latents over ``sp_size`` ranks.

    The single-GPU sequence over ``F`` latent frames of ``S`` tokens is
    ``[clean 0..F-1 ; noisy 0..F-1]``; its global token id is ``g = side*F*S + f*S + s`` (side 0 =
    clean, 1 = noisy). Rank ``r`` of the SP group (size ``P``) owns a set of latent frames as *both*
    its clean and its noisy copy, local order ``[clean_r ; noisy_r]`` (frame-major inside each
    half). The local sequences concatenate in rank order after the Ulysses gather, so the attention
    order is rank-major ``[c_0 n_0 c_1 n_1 ...]``: no permutation is applied at run time; the
    teacher-forcing mask is built in that order from each token's identity (side, global frame ->
    block of ``nb`` frames):

        clean -> clean  iff blk_k <= blk_q      noisy -> clean  iff blk_k <  blk_q
        noisy -> noisy  iff blk_k == blk_q      clean -> noisy  never

    Frame assignment. ``ring_size == 1`` (or ``ring_balance=False``): rank ``r`` owns the contiguous
    frames ``[r*F/P, (r+1)*F/P)``. With a ring of ``R > 1`` the ring slice ``rho`` (CP ranks
    ``rho*U .. rho*U+U-1``, CP index ``c = rho*U + u``) would otherwise hold frames
    ``[rho*F/R, (rho+1)*F/R)`` and later slices would do more unmasked work (the mask is
    block-causal). Ring balancing cuts the frames into ``2R`` chunks and gives ring slice ``rho``
    the zigzag pair ``rho`` and ``2R-1-rho`` (mirrored blocks: every slice has the same unmasked
    work); inside the slice its ``F/R`` frames are split contiguously over the ``U`` Ulysses ranks.
    The mask is still built from identities, so the assignment changes only which frames a rank
    loads.

    Args:
        num_latent_frames: ``F``, latent frames of the sample.
        tokens_per_frame: ``S``, tokens of one latent frame (after patchify).
        frames_per_block: ``nb``, latent frames per autoregressive block.
        sp_size: ``P``, the SP (= CP) group size ``U * R``.
        ring_size: ``R``, ring degree of 2D attention (CP index ``c = rho*U + u``).
        ring_balance: zigzag pairing of early and late chunks over ring slices (default: ``R > 1``).
        world_size, num_heads, ulysses_size: optional, validated when given
            (``world_size % P == 0``, ``num_heads % U == 0``, ``U * R == P``).
    """

    def __init__(
        self,
        num_latent_frames: int,
        tokens_per_frame: int,
        frames_per_block: int,
        sp_size: int,
        *,
        ring_size: int = 1,
        ring_balance: Optional[bool] = None,
        world_size: Optional[int] = None,
        num_heads: Optional[int] = None,
        ulysses_size: Optional[int] = None,
    ):
        F, S, nb, P, R = num_latent_frames, tokens_per_frame, frames_per_block, sp_size, ring_size
        for name, v in (
            ("num_latent_frames", F),
            ("tokens_per_frame", S),
            ("frames_per_block", nb),
            ("sp_size", P),
            ("ring_size", R),
        ):
            check_positive_int(name, v)
        if F % (P * nb):  # implies check_whole_blocks (whole blocks per rank)
            raise ValueError(
                f"num_latent_frames ({F}) must be divisible by sp_size ({P}) * "
                f"frames_per_block ({nb})"
            )
        if P % R:
            raise ValueError(f"ring_size ({R}) must divide sp_size ({P})")
        U = P // R
        if ulysses_size is not None:
            check_positive_int("ulysses_size", ulysses_size)
            if ulysses_size * R != P:
                raise ValueError(
                    f"ulysses_size ({ulysses_size}) * ring_size ({R}) must equal sp_size ({P})"
                )
        if world_size is not None:
            check_positive_int("world_size", world_size)
            if world_size % P:
                raise ValueError(f"world_size ({world_size}) must be divisible by sp_size ({P})")
        if num_heads is not None:
            check_positive_int("num_heads", num_heads)
            if num_heads % U:
                raise ValueError(f"num_heads ({num_heads}) must be divisible by ulysses_size ({U})")
        balance = (R > 1) if ring_balance is None else bool(ring_balance)
        if balance and R > 1 and F % (2 * R * nb):
            raise ValueError(
                f"num_latent_frames ({F}) must be divisible by 2 * ring_size ({R}) * frames_per_block "
                f"({nb}) for ring balancing (zigzag pairs of 2*ring_size chunks of whole blocks); "
                f"pass ring_balance=False for contiguous ranks"
            )
        self.num_latent_frames, self.tokens_per_frame, self.frames_per_block = F, S, nb
        self.sp_size, self.ring_size, self.ulysses_size = P, R, U
        self.ring_balance = balance and R > 1
        self.frames_per_rank = F // P
        self.num_blocks = F // nb
        self.local_len = 2 * self.frames_per_rank * S
        self.unit_tokens = nb * S

        self._frames = [torch.tensor(fr, dtype=torch.int64) for fr in self._assign_frames()]
        owner_rank = torch.empty(F, dtype=torch.int64)
        owner_local = torch.empty(F, dtype=torch.int64)
        for r, fr in enumerate(self._frames):
            owner_rank[fr] = r
            owner_local[fr] = torch.arange(fr.numel())
        self._owner_rank, self._owner_local = owner_rank, owner_local
        self._tables = None

    # -- frame assignment -----------------------------------------------------------------
    def _assign_frames(self) -> List[List[int]]:
        F, P, R, U, Fp = (
            self.num_latent_frames,
            self.sp_size,
            self.ring_size,
            self.ulysses_size,
            self.frames_per_rank,
        )
        if not self.ring_balance:
            return [list(range(r * Fp, (r + 1) * Fp)) for r in range(P)]
        chunk = F // (2 * R)
        out = []
        for rho in range(R):
            frames = list(range(rho * chunk, (rho + 1) * chunk)) + list(
                range((2 * R - 1 - rho) * chunk, (2 * R - rho) * chunk)
            )
            out.extend(frames[u * Fp : (u + 1) * Fp] for u in range(U))
        return out

    def _check_rank(self, rank: int) -> None:
        check_rank("rank", rank, self.sp_size, "sp_size")

    def rank_frames(self, rank: int) -> torch.Tensor:
        """Global latent frames owned by ``rank``, in local order (ascending)."""
        self._check_rank(rank)
        return self._frames[rank].clone()

    def rank_segments(self, rank: int) -> List[Tuple[int, int]]:
        """The rank's frames as maximal contiguous ranges ``[start, end)`` (1 or 2 of them)."""
        fr = self.rank_frames(rank).tolist()
        segs, start = [], fr[0]
        for a, b in zip(fr, fr[1:] + [None]):
            if b != a + 1:
                segs.append((start, a + 1))
                start = b
        return segs

    # -- token maps -----------------------------------------------------------------------
    def local_global_ids(self, rank: int) -> torch.Tensor:
        """Single-GPU id of every local token of ``rank`` (local order ``[clean_r ; noisy_r]``)."""
        return self.local_to_global(rank, torch.arange(self.local_len))

    def local_to_global(self, rank: int, local_index: torch.Tensor) -> torch.Tensor:
        self._check_rank(rank)
        F, S, Fp = self.num_latent_frames, self.tokens_per_frame, self.frames_per_rank
        li = torch.as_tensor(local_index, dtype=torch.int64)
        if li.numel() and (li.min() < 0 or li.max() >= self.local_len):
            raise ValueError(f"local_index must lie in [0, local_len ({self.local_len}))")
        side, lf, s = li // (Fp * S), (li % (Fp * S)) // S, li % S
        return side * F * S + self._frames[rank][lf] * S + s

    def global_to_local(self, global_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``local_to_global``: ``(rank, local_index)`` of each single-GPU id."""
        F, S, Fp = self.num_latent_frames, self.tokens_per_frame, self.frames_per_rank
        g = torch.as_tensor(global_ids, dtype=torch.int64)
        if g.numel() and (g.min() < 0 or g.max() >= 2 * F * S):
            raise ValueError(f"global_ids must lie in [0, 2*F*S ({2 * F * S}))")
        side, f, s = g // (F * S), (g % (F * S)) // S, g % S
        return self._owner_rank[f], side * Fp * S + self._owner_local[f] * S + s

    def attention_order_global_ids(self) -> torch.Tensor:
        """Single-GPU id at each attention position (rank-major ``[c_0 n_0 c_1 n_1 ...]``)."""
        return torch.cat([self.local_global_ids(r) for r in range(self.sp_size)])

    def attention_positions(self, global_ids: torch.Tensor) -> torch.Tensor:
        """Inverse of ``attention_order_global_ids``: attention position of each single-GPU id."""
        rank, local = self.global_to_local(global_ids)
        return rank * self.local_len + local

    # -- identities and masks -------------------------------------------------------------
    def identity_tables(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(side, frame, block)`` of every attention position (int64 ``[2FS]`` each)."""
        if self._tables is None:
            F, S = self.num_latent_frames, self.tokens_per_frame
            g = self.attention_order_global_ids()
            frame = (g % (F * S)) // S
            self._tables = (g // (F * S), frame, frame // self.frames_per_block)
        return self._tables

    def mask_predicate(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``fn(q_idx, k_idx) -> bool`` on attention positions (broadcasting), from identities."""
        side, _, block = self.identity_tables()

        def fn(q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
            return teacher_forcing_rule(side[q_idx], block[q_idx], side[k_idx], block[k_idx])

        return fn

    def teacher_forcing_mask(self) -> torch.Tensor:
        """Dense bool ``[2FS, 2FS]`` mask in attention order (True = attend)."""
        side, _, block = self.identity_tables()
        return teacher_forcing_rule(side[:, None], block[:, None], side[None, :], block[None, :])

    def unit_identities(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(side, block)`` of each unit of ``nb*S`` tokens in attention order. Every rank's
        halves consist of whole blocks, so one unit is one (side, block) and the mask is constant
        on unit tiles."""
        side, _, block = self.identity_tables()
        return side[:: self.unit_tokens], block[:: self.unit_tokens]

    def block_mask(self) -> torch.Tensor:
        """Unit-level bool ``[2F/nb, 2F/nb]`` mask; ``dense == block_mask`` repeated by
        ``unit_tokens`` along both dims."""
        side, block = self.unit_identities()
        return teacher_forcing_rule(side[:, None], block[:, None], side[None, :], block[None, :])

    def block_status(
        self, q_block_tokens: int, k_block_tokens: Optional[int] = None
    ) -> torch.Tensor:
        """Tile map for ring skip-lists / FlexAttention: int8 ``[ceil(N/bq), ceil(N/bk)]`` with
        0 = fully masked, 1 = partial, 2 = fully visible (``N = 2FS``; tiles of arbitrary size)."""
        bq = q_block_tokens
        bk = bq if k_block_tokens is None else k_block_tokens
        check_positive_int("q_block_tokens", bq)
        check_positive_int("k_block_tokens", bk)
        N, ut = 2 * self.num_latent_frames * self.tokens_per_frame, self.unit_tokens
        m = self.block_mask().to(torch.int64)
        cs = torch.zeros(m.shape[0] + 1, m.shape[1] + 1, dtype=torch.int64)
        cs[1:, 1:] = m.cumsum(0).cumsum(1)
        # unit range [lo, hi] covered by each tile
        qs = torch.arange(0, N, bq)
        ks = torch.arange(0, N, bk)
        qlo, qhi = qs // ut, (torch.clamp(qs + bq, max=N) - 1) // ut + 1
        klo, khi = ks // ut, (torch.clamp(ks + bk, max=N) - 1) // ut + 1
        cnt = cs[qhi][:, khi] - cs[qlo][:, khi] - cs[qhi][:, klo] + cs[qlo][:, klo]
        area = (qhi - qlo)[:, None] * (khi - klo)[None, :]
        return torch.where(cnt == area, FULL, torch.where(cnt == 0, EMPTY, PARTIAL)).to(torch.int8)

    def block_status_ids(self, q_ids: torch.Tensor, k_ids: torch.Tensor) -> int:
        """0/1/2 (empty/partial/full) for arbitrary attention-position sets (the mask is constant
        per unit, so only the distinct units matter)."""
        side, block = self.unit_identities()
        uq = torch.unique(torch.as_tensor(q_ids, dtype=torch.int64) // self.unit_tokens)
        uk = torch.unique(torch.as_tensor(k_ids, dtype=torch.int64) // self.unit_tokens)
        m = teacher_forcing_rule(
            side[uq][:, None], block[uq][:, None], side[uk][None, :], block[uk][None, :]
        )
        return FULL if bool(m.all()) else (EMPTY if not bool(m.any()) else PARTIAL)

    # -- positions and loss ---------------------------------------------------------------
    def rope_frame_positions(self, rank: int, per_token: bool = True) -> torch.Tensor:
        """Temporal RoPE position (global latent frame) of each local token (or local frame, with
        ``per_token=False``); both halves share the positions of the rank's frames."""
        fr = self.rank_frames(rank).repeat(2)
        return fr.repeat_interleave(self.tokens_per_frame) if per_token else fr

    def loss_mask(self, rank: int) -> torch.Tensor:
        """Bool ``[2*F/P*S]``: True on the loss-bearing (noisy) half of the local sequence."""
        self._check_rank(rank)
        half = self.local_len // 2
        return torch.cat([torch.zeros(half, dtype=torch.bool), torch.ones(half, dtype=torch.bool)])

    @property
    def num_loss_tokens(self) -> int:
        """Global number of loss tokens (``F*S``): the loss normaliser."""
        return self.num_latent_frames * self.tokens_per_frame

    def loss_tokens_per_rank(self) -> List[int]:
        return [int(self.loss_mask(r).sum()) for r in range(self.sp_size)]

    # -- balance accounting ---------------------------------------------------------------
    def attention_work_per_ring_rank(self) -> List[int]:
        """Unmasked (query, key) pairs per ring slice (queries after the Ulysses gather)."""
        side, block = self.unit_identities()
        return ring_attention_work(side, block, self.unit_tokens, self.ring_size)

    def attention_work_per_rank(self) -> List[float]:
        """Unmasked pairs per CP rank: its ring slice's pairs over the ``U`` head shards."""
        ring = self.attention_work_per_ring_rank()
        return [ring[c // self.ulysses_size] / self.ulysses_size for c in range(self.sp_size)]

    def balance_report(self) -> dict:
        """``max/mean`` of loss tokens and of unmasked attention work per rank (from counts)."""
        return {
            "loss_tokens_max_over_mean": max_over_mean(self.loss_tokens_per_rank()),
            "attention_work_max_over_mean": max_over_mean(self.attention_work_per_rank()),
        }

    def __repr__(self) -> str:
        return (
            f"BalancedSPLayout(F={self.num_latent_frames}, S={self.tokens_per_frame}, "
            f"nb={self.frames_per_block}, P={self.sp_size}=U{self.ulysses_size}xR{self.ring_size}, "
            f"ring_balance={self.ring_balance})"
        )
