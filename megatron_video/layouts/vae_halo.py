"""SP-folded VAE encoding: per-rank raw-frame windows with a left halo, as pure index maps, and the
halo a causal op stack's look-back needs. The halo of a given encoder (declared causal ops, or
probed from its behaviour) is ``models.vae_halo_probe``'s. Design: docs/architecture.md,
"Capabilities" 2 (VAE halo); the window rule is ``halo_window``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from ..checks import check_nonneg_int, check_positive_int

__all__ = [
    "HaloWindow",
    "halo_window",
    "halo_windows",
    "windows_for_bounds",
    "window_tensors",
    "num_raw_frames",
    "temporal_lookback",
    "halo_for_lookback",
]


def num_raw_frames(
    num_latent_frames: int, temporal_stride: int = 4, causal_first_frame: bool = True
) -> int:
    """Raw frames that encode to exactly ``num_latent_frames`` latents."""
    check_positive_int("num_latent_frames", num_latent_frames)
    check_positive_int("temporal_stride", temporal_stride)
    if causal_first_frame:
        return 1 + temporal_stride * (num_latent_frames - 1)
    return temporal_stride * num_latent_frames


@dataclass(frozen=True)
class HaloWindow:
    """One rank's encoding window. Latents ``[latent_start, latent_end)`` are kept; the window's
    encoding has ``drop + num_kept`` latents of which the first ``drop`` are discarded."""

    rank: int
    latent_start: int  # ls
    latent_end: int  # le
    halo_latents: int  # h requested
    halo_start: int  # max(0, ls - h)
    raw_start: int
    raw_end: int
    pseudo: int  # 1 if the window's first frame is a throw-away first-frame latent
    drop: int  # leading latents to drop
    temporal_stride: int = 4
    causal_first_frame: bool = True

    @property
    def num_kept(self) -> int:
        return self.latent_end - self.latent_start

    @property
    def kept(self) -> Tuple[int, int]:
        """The latents this rank keeps, ``(latent_start, latent_end)`` (half-open)."""
        return self.latent_start, self.latent_end

    @property
    def window(self) -> Tuple[int, int]:
        """The raw-frame window ``(raw_start, raw_end)`` (half-open) this rank encodes."""
        return self.raw_start, self.raw_end

    @property
    def num_raw(self) -> int:
        return self.raw_end - self.raw_start

    @property
    def num_window_latents(self) -> int:
        return self.drop + self.num_kept

    def slice_raw(self, video: torch.Tensor, time_dim: int = 2) -> torch.Tensor:
        """This window of a full raw video (``[B, C, T, H, W]`` by default)."""
        return video.narrow(time_dim, self.raw_start, self.num_raw)


def halo_window(
    latent_start: int,
    latent_end: int,
    halo_latents: int,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
    rank: int = 0,
) -> HaloWindow:
    """The window that encodes latents ``[latent_start, latent_end)`` with ``halo_latents`` of halo
    (the one home of the rule; any latent range, e.g. one of a packed clip, counted from its clip's
    start).

    A causal video VAE with temporal stride ``st`` maps raw frame 0 to latent 0 and raw frames
    ``st*k-st+1 .. st*k`` to latent ``k`` (``causal_first_frame=True``). The window starts ``h``
    latents early so that the causal receptive field of latent ``ls`` lies inside it:

    * ``halo_start = max(0, ls - h)``;
    * ``halo_start == 0``: window ``[0, 1 + st(le-1))`` (the video's own start: exact, no pseudo
      latent);
    * otherwise ``[st(halo_start-1), 1 + st(le-1))``: its first frame is the last frame of latent
      ``halo_start-1`` and becomes a throw-away first-frame latent (``pseudo = 1``);
    * ``drop = pseudo + (ls - halo_start)`` leading latents of the window's encoding are discarded.

    With ``causal_first_frame=False`` (latent ``k`` <- frames ``st*k .. st*k+st-1``): window
    ``[st*halo_start, st*le)`` and ``drop = ls - halo_start``.
    """
    ls, le, h, st = latent_start, latent_end, halo_latents, temporal_stride
    check_nonneg_int("latent_start", ls)
    check_nonneg_int("halo_latents", h)
    check_positive_int("temporal_stride", st)
    if not isinstance(le, int) or isinstance(le, bool) or le <= ls:
        raise ValueError(f"latent_end ({le!r}) must be an integer > latent_start ({ls})")
    hs = max(0, ls - h)
    if causal_first_frame:
        raw_end = 1 + st * (le - 1)
        if hs == 0:
            raw_start, pseudo = 0, 0
        else:
            raw_start, pseudo = st * (hs - 1), 1
    else:
        raw_start, raw_end, pseudo = st * hs, st * le, 0
    return HaloWindow(
        rank=rank,
        latent_start=ls,
        latent_end=le,
        halo_latents=h,
        halo_start=hs,
        raw_start=raw_start,
        raw_end=raw_end,
        pseudo=pseudo,
        drop=pseudo + ls - hs,
        temporal_stride=st,
        causal_first_frame=causal_first_frame,
    )


def windows_for_bounds(
    latent_bounds: Sequence[Sequence[int]],
    halo_latents: int,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
) -> List[HaloWindow]:
    """One window per rank ``p`` keeping latents ``latent_bounds[p] = (ls, le)``: any ranges (ragged
    splits, Balanced-SP segments, ranges of packed clips, each counted from its own clip's start).
    An encoder's halo: ``models.vae_halo_probe.resolve_halo``."""
    h = check_nonneg_int("halo_latents", halo_latents)
    out = []
    for p, bounds in enumerate(latent_bounds):
        ls, le = bounds
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (ls, le)) or not 0 <= ls < le:
            raise ValueError(
                f"latent_bounds[{p}] ({bounds!r}) must be integers [ls, le) with 0 <= ls < le"
            )
        out.append(halo_window(ls, le, h, temporal_stride, causal_first_frame, rank=p))
    return out


def window_tensors(windows: Sequence[HaloWindow]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(raw windows [P, 2], drop [P])`` (int64) of ``windows``: the arguments of
    ``ops.halo_scatter`` and ``ops.halo_gather``."""
    raw = torch.tensor([w.window for w in windows], dtype=torch.int64).view(-1, 2)
    return raw, torch.tensor([w.drop for w in windows], dtype=torch.int64)


def halo_windows(
    num_latent_frames: int,
    sp_size: int,
    halo_latents: int,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
) -> List[HaloWindow]:
    """Per-rank windows for the contiguous partition ``[r*F/P, (r+1)*F/P)`` (an encoder's halo:
    ``models.vae_halo_probe.resolve_halo``)."""
    F, P = num_latent_frames, sp_size
    check_positive_int("num_latent_frames", F)
    check_positive_int("sp_size", P)
    h = check_nonneg_int("halo_latents", halo_latents)
    if F % P:
        raise ValueError(f"num_latent_frames ({F}) must be divisible by sp_size ({P})")
    n = F // P
    return windows_for_bounds(
        [(r * n, (r + 1) * n) for r in range(P)], h, temporal_stride, causal_first_frame
    )


# ----------------------------------------------------------------------------------------------
# Receptive field of a causal op stack
# ----------------------------------------------------------------------------------------------
def temporal_lookback(ops: Sequence[Tuple[int, int, int]]) -> Tuple[int, int]:
    """``(L, Σ)``: final output ``j`` reads raw frames ``[j*Σ - L, j*Σ]``.

    Each causal op ``(kernel, stride, pad)`` (``pad == kernel - 1``: output ``j`` reads inputs
    ``j*stride - pad .. j*stride``) composes to ``Σ = Π stride_i`` and
    ``L = Σ_i (kernel_i - 1) * Π_{j<i} stride_j``."""
    L, stride = 0, 1
    for k, s, _ in ops:
        L += (k - 1) * stride
        stride *= s
    return L, stride


def halo_for_lookback(lookback: int, temporal_stride: int, causal_first_frame: bool = True) -> int:
    """Smallest halo (latents) for which the kept latents' raw receptive field lies in the window.

    In a window the kept latent sits at raw window index ``Σ*drop`` (first-frame case), so it is
    exact iff ``Σ*drop >= L``, i.e. ``h >= ceil(L/Σ) - 1`` (``h >= ceil((L - Σ + 1)/Σ)`` without
    the first-frame rule, whose latent ends at ``Σk + Σ-1``)."""
    L, st = lookback, temporal_stride
    if causal_first_frame:
        return max(0, -(-L // st) - 1)
    return max(0, -(-(L - st + 1) // st))
