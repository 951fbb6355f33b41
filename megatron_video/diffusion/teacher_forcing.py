"""Teacher-forcing objective for autoregressive video diffusion under Balanced SP
(``TeacherForcingObjective``; its local sequence, loss normalisation and model contract are
described there). Design: docs/architecture.md, "Capabilities" 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..attention.masks import EMPTY, FULL, PARTIAL, AttentionMask, RuleMask
from ..layouts.balanced_sp import BalancedSPLayout
from ..ops.masks import TokenIds
from ..parallel import comm
from .edm import reduce_token_loss
from .flow_matching import expand_block_timesteps, fm_interpolate, fm_target, sample_timesteps

__all__ = [
    "TeacherForcingMask",
    "WindowedTeacherForcingMask",
    "TeacherForcingOutput",
    "TeacherForcingObjective",
    "local_frame_tokens",
]


class TeacherForcingMask(RuleMask):
    """The layout's teacher-forcing mask on attention-order positions: the ``teacher_forcing`` rule
    of ``megatron_video.ops`` on each position's (side, block) from the layout's identity tables,
    so the attention engine gets its tile status from the C++ kernels."""

    default_scheme = "contiguous"
    rule = "teacher_forcing"

    def __init__(self, layout: BalancedSPLayout):
        self.layout = layout
        self.tile_hint = layout.unit_tokens  # one (side, AR block) unit: the mask is constant on it
        side, _, block = layout.identity_tables()
        self._tables = {side.device: (side, block)}  # per device (masks are frozen values)

    def identities(self, ids: Tensor, role: str) -> TokenIds:
        if ids.device not in self._tables:
            side, block = next(iter(self._tables.values()))
            self._tables[ids.device] = (side.to(ids.device), block.to(ids.device))
        side, block = self._tables[ids.device]
        return TokenIds(side=side[ids], block=block[ids])

    def __repr__(self) -> str:
        return f"TeacherForcingMask({self.layout!r})"


class WindowedTeacherForcingMask(AttentionMask):
    """The teacher-forcing mask with a sink and a window (``generation.streaming.WindowRule``'s,
    in latent frames, multiples of ``frames_per_block``; ``window`` None: all): a query of block
    ``k`` (either side) attends the clean blocks ``m < k`` with ``m < sink / nb`` or
    ``m >= k - window / nb``, a clean query its own clean block too, a noisy query its own noisy
    block. It is the conditioning of the streaming generator's KV cache (a clean block's cached
    keys / values were computed attending to the frames kept for it), so a teacher-forced forward
    under it equals the stream's velocities. Dense per tile (no C++ rule)."""

    default_scheme = "contiguous"

    def __init__(self, layout: BalancedSPLayout, sink: int = 0, window: Optional[int] = None):
        nb = layout.frames_per_block
        for name, v in (("sink", sink), ("window", window)):
            if v is not None and (not isinstance(v, int) or v < 0 or v % nb):
                raise ValueError(
                    f"{name} ({v!r}) must be a non-negative multiple of frames_per_block ({nb})"
                )
        self.layout, self.tile_hint = layout, layout.unit_tokens
        self.sink_blocks = sink // nb
        self.window_blocks = layout.num_blocks if window is None else window // nb
        side, _, block = layout.identity_tables()
        self._side, self._block = side, block

    def pair(self, q, k):
        side, block = self._side.to(q.device), self._block.to(q.device)
        qs, qb, ks, kb = side[q], block[q], side[k], block[k]
        kept = (kb < qb) & ((kb < self.sink_blocks) | (kb >= qb - self.window_blocks))
        own = kb == qb
        return ((ks == 0) & (kept | (own & (qs == 0)))) | ((ks == 1) & (qs == 1) & own)

    def dense(self, q_ids, k_ids):
        return self.pair(q_ids.long()[:, None], k_ids.long()[None, :])

    def tile_status(self, q_ids, k_ids, q_tile, k_tile):
        d = self.dense(q_ids, k_ids)
        qe = range(0, q_ids.numel(), q_tile)
        ke = range(0, k_ids.numel(), k_tile)
        out = torch.empty(len(qe), len(ke), dtype=torch.uint8)
        for i, a in enumerate(qe):
            for j, c in enumerate(ke):
                t = d[a : a + q_tile, c : c + k_tile]
                out[i, j] = EMPTY if not bool(t.any()) else FULL if bool(t.all()) else PARTIAL
        return out

    def __repr__(self) -> str:
        return (
            f"WindowedTeacherForcingMask({self.layout!r}, sink_blocks={self.sink_blocks}, "
            f"window_blocks={self.window_blocks})"
        )


def local_frame_tokens(layout: BalancedSPLayout, rank: int, tokens: Tensor) -> Tensor:
    """The rank's frames (local order) out of a full ``[B, F*S, ...]`` token tensor."""
    F, S = layout.num_latent_frames, layout.tokens_per_frame
    if tokens.dim() < 2 or tokens.shape[1] != F * S:
        raise ValueError(f"tokens shape ({tuple(tokens.shape)}) must be [B, F*S = {F * S}, ...]")
    idx = (layout.rank_frames(rank)[:, None] * S + torch.arange(S)).reshape(-1)
    return tokens.index_select(1, idx.to(tokens.device))


@dataclass
class TeacherForcingOutput:
    loss: Tensor  # this rank's share (differentiable); SUM over the SP group = global loss
    loss_value: Tensor  # detached global loss (all-reduced sum of the shares)
    num_loss_tokens: int  # global count used as the normaliser
    prediction: Tensor  # model output on the local sequence [B, L, D]
    target: Tensor  # velocity target on the local noisy half [B, L/2, D]
    block_timesteps: Tensor  # [B, F/nb] used


class TeacherForcingObjective:
    """Teacher-forced flow-matching loss on a Balanced SP layout.

    Args:
        layout: the ``BalancedSPLayout`` (its ``sp_size`` must equal the SP group size).
        groups: ``VideoParallelGroups`` from ``init_video_parallel`` (SP group = CP group, rank =
            ``cp_rank``); ``None`` for a single process with ``sp_size == 1``.

    Each SP rank builds its local sequence ``[clean_r ; noisy_r]`` over the latent frames its
    ``BalancedSPLayout`` assigns it: the clean half carries timestep 0, the noisy half is the
    flow-matching interpolation ``(1-t) x0 + t eps`` with one ``t`` per AR block (global blocks, so
    every rank and the single-GPU run use the same draw). The model sees the local tokens, their
    temporal RoPE positions, their single-GPU ids and the teacher-forcing mask (an ``AttentionMask``
    on attention-order positions, built from token identities), and runs its attention
    context-parallel (``dist_attention`` with ``scheme="contiguous"``: the rank-major order is the
    attention order).

    The loss is ``sum over this rank's loss tokens of mean_d (v - (eps - x0))^2`` divided by the
    GLOBAL number of loss tokens (all-reduced over the SP group), so the per-rank losses SUM to the
    single-GPU loss and the parameter gradients must be SUM-reduced over the SP group (not
    averaged). A rank-local mean would be ``P`` times too large per rank and its masked variant
    ``1/P`` too small.

    Model contract (model-agnostic; a Megatron AR DiT adapts to it):
    ``model(x [B, L, D], t [B, L], *, frame_positions [L], token_ids [L], mask) -> [B, L, D]``.
    Tokens are frame-major (``S`` tokens per latent frame); ``L = 2 * F/P * S``.
    """

    def __init__(self, layout: BalancedSPLayout, groups=None):
        if groups is None:
            if layout.sp_size != 1:
                raise ValueError(
                    f"groups (None) requires layout.sp_size == 1, got {layout.sp_size}"
                )
            self.group, self.rank = None, 0
        else:
            if groups.cp_size != layout.sp_size:
                raise ValueError(
                    f"layout.sp_size ({layout.sp_size}) must equal the CP group size "
                    f"({groups.cp_size})"
                )
            if layout.ring_size not in (1, groups.ring_size):
                raise ValueError(
                    f"layout.ring_size ({layout.ring_size}) must be 1 or the ring size "
                    f"of the groups ({groups.ring_size})"
                )
            if layout.ring_balance and groups.placement != "ulysses_inner":
                raise ValueError(
                    f"layout.ring_balance (True) assumes placement 'ulysses_inner' (ring "
                    f"slice = CP ranks rho*U..rho*U+U-1), got {groups.placement!r}"
                )
            self.group, self.rank = groups.cp_group, groups.cp_rank
        self.layout = layout
        self.mask = TeacherForcingMask(layout)
        self.frame_positions = layout.rope_frame_positions(self.rank)
        self.token_ids = layout.local_global_ids(self.rank)
        half = layout.local_len // 2
        # global block of each noisy local token (timesteps are drawn per global block)
        self.noisy_blocks = self.frame_positions[half:] // layout.frames_per_block

    def sample_block_timesteps(
        self,
        batch: int,
        generator: Optional[torch.Generator] = None,
        dtype: torch.dtype = torch.float32,
        **kwargs,
    ) -> Tensor:
        """``[B, F/nb]`` timesteps; SP rank 0's draw is broadcast so every rank uses the same."""
        t = sample_timesteps(
            (batch, self.layout.num_blocks), generator=generator, dtype=dtype, **kwargs
        )
        if self.group is not None:
            comm.broadcast(t, self.group, src=0, tag="tf.timesteps")
        return t

    def build_inputs(self, clean: Tensor, noise: Tensor, block_timesteps: Tensor):
        """``(x [B, L, D], t [B, L], target [B, L/2, D])`` of the local ``[clean_r ; noisy_r]``."""
        t_noisy = expand_block_timesteps(block_timesteps, self.noisy_blocks.to(clean.device))
        x_noisy = fm_interpolate(clean, noise, t_noisy)
        x = torch.cat([clean, x_noisy], dim=1)
        t = torch.cat([torch.zeros_like(t_noisy), t_noisy], dim=1).to(clean.dtype)
        return x, t, fm_target(clean, noise)

    def __call__(
        self,
        model: Callable,
        clean: Tensor,
        *,
        noise: Optional[Tensor] = None,
        block_timesteps: Optional[Tensor] = None,
        generator: Optional[torch.Generator] = None,
    ) -> TeacherForcingOutput:
        """Loss for this rank's clean latent tokens ``clean [B, F/P*S, D]`` (local frame order).

        ``noise`` (like ``clean``) and ``block_timesteps`` (``[B, F/nb]``, global blocks) are
        injectable; otherwise drawn from ``generator`` (noise per rank: seed it per rank).
        """
        L = self.layout
        half = L.local_len // 2
        if clean.dim() < 3 or clean.shape[1] != half:
            raise ValueError(f"clean shape ({tuple(clean.shape)}) must be [B, F/P*S = {half}, D]")
        B = clean.shape[0]
        if noise is None:
            noise = torch.randn(
                clean.shape, generator=generator, dtype=clean.dtype, device=clean.device
            )
        elif noise.shape != clean.shape:
            raise ValueError(
                f"noise shape ({tuple(noise.shape)}) must equal clean shape ({tuple(clean.shape)})"
            )
        if block_timesteps is None:
            block_timesteps = self.sample_block_timesteps(B, generator, dtype=clean.dtype)
        elif tuple(block_timesteps.shape) != (B, L.num_blocks):
            raise ValueError(
                f"block_timesteps shape ({tuple(block_timesteps.shape)}) must be "
                f"[B, F/nb] = [{B}, {L.num_blocks}]"
            )
        x, t, target = self.build_inputs(clean, noise, block_timesteps)
        pred = model(
            x,
            t,
            frame_positions=self.frame_positions.to(x.device),
            token_ids=self.token_ids.to(x.device),
            mask=self.mask,
        )
        if pred.shape != x.shape:
            raise ValueError(
                f"model output shape ({tuple(pred.shape)}) must equal its input shape "
                f"({tuple(x.shape)})"
            )
        count = torch.tensor([B * half], dtype=torch.int64)
        if self.group is not None:
            comm.all_reduce(count, self.group, tag="tf.loss_tokens")
        n_global = int(count)
        acc = torch.promote_types(clean.dtype, torch.float32)
        per_element = (pred[:, half:].to(acc) - target.to(acc)) ** 2
        loss = reduce_token_loss(per_element, None, n_global)
        value = loss.detach().clone()
        if self.group is not None:
            comm.all_reduce(value, self.group, tag="tf.loss_value")
        return TeacherForcingOutput(
            loss=loss,
            loss_value=value,
            num_loss_tokens=n_global,
            prediction=pred,
            target=target,
            block_timesteps=block_timesteps,
        )
