"""SP-folded VAE encoding: per-rank raw-frame windows with a left halo (pure index maps).

A causal video VAE with temporal stride ``4`` maps raw frame 0 to latent 0 and raw frames
``4k-3..4k`` to latent ``k`` (``causal_first_frame=True``; ``T`` raw frames give ``1 + (T-1)/4``
latents). Rank ``r`` keeps latents ``[ls, le)``; it encodes a window that starts ``h`` latents earlier
so that the causal receptive field of latent ``ls`` lies inside the window, then drops the leading
latents:

* ``halo_start = max(0, ls - h)``;
* ``halo_start == 0``: window ``[0, 1 + 4(le-1))`` (the video's own start: exact, no pseudo latent);
* otherwise window ``[4(halo_start-1), 1 + 4(le-1))``: its first frame is the last frame of latent
  ``halo_start-1`` and becomes a throw-away first-frame latent (``pseudo = 1``);
* ``drop = pseudo + (ls - halo_start)`` leading latents of the window's encoding are discarded.

With ``causal_first_frame=False`` (latent ``k`` <- frames ``4k..4k+3``): window
``[4*halo_start, 4*le)`` and ``drop = ls - halo_start``.

The halo an encoder needs comes from its causal temporal stack (``temporal_receptive_field``): a
module that performs causal temporal convolution exposes ``causal_time_op = (kernel, stride, pad)``
(``pad == kernel - 1``: output ``j`` reads inputs ``j*stride - pad .. j*stride``). Composing them,
final output ``j`` reads raw frames ``[j*Σ - L, j*Σ]`` with ``Σ = Π stride_i`` and
``L = Σ_i (kernel_i - 1) * Π_{j<i} stride_j``. In a window the kept latent sits at raw window index
``Σ*drop`` (first-frame case), so it is exact iff ``Σ*drop >= L``, i.e. ``h >= ceil(L/Σ) - 1``
(``h >= ceil((L - Σ + 1)/Σ)`` without the first-frame rule, whose latent ends at ``Σk + Σ-1``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "HaloWindow", "halo_window", "halo_windows", "resolve_halo", "num_raw_frames", "encoder_temporal_ops",
    "temporal_lookback", "halo_for_lookback", "temporal_receptive_field",
]


def _nonneg_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} ({value!r}) must be a non-negative integer")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def num_raw_frames(num_latent_frames: int, temporal_stride: int = 4, causal_first_frame: bool = True) -> int:
    """Raw frames that encode to exactly ``num_latent_frames`` latents."""
    _positive_int("num_latent_frames", num_latent_frames)
    _positive_int("temporal_stride", temporal_stride)
    if causal_first_frame:
        return 1 + temporal_stride * (num_latent_frames - 1)
    return temporal_stride * num_latent_frames


@dataclass(frozen=True)
class HaloWindow:
    """One rank's encoding window. Latents ``[latent_start, latent_end)`` are kept; the window's
    encoding has ``drop + num_kept`` latents of which the first ``drop`` are discarded."""

    rank: int
    latent_start: int       # ls
    latent_end: int         # le
    halo_latents: int       # h requested
    halo_start: int         # max(0, ls - h)
    raw_start: int
    raw_end: int
    pseudo: int             # 1 if the window's first frame is a throw-away first-frame latent
    drop: int               # leading latents to drop
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


def halo_window(latent_start: int, latent_end: int, halo_latents: int, temporal_stride: int = 4,
                causal_first_frame: bool = True, rank: int = 0) -> HaloWindow:
    """The window that encodes latents ``[latent_start, latent_end)`` with ``halo_latents`` of halo."""
    ls, le, h, st = latent_start, latent_end, halo_latents, temporal_stride
    _nonneg_int("latent_start", ls)
    _nonneg_int("halo_latents", h)
    _positive_int("temporal_stride", st)
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
    return HaloWindow(rank=rank, latent_start=ls, latent_end=le, halo_latents=h, halo_start=hs,
                      raw_start=raw_start, raw_end=raw_end, pseudo=pseudo, drop=pseudo + ls - hs,
                      temporal_stride=st, causal_first_frame=causal_first_frame)


def halo_windows(num_latent_frames: int, sp_size: int, halo_latents: Optional[int] = None,
                 temporal_stride: int = 4, causal_first_frame: bool = True,
                 encoder: Optional[nn.Module] = None) -> List[HaloWindow]:
    """Per-rank windows for the contiguous partition ``[r*F/P, (r+1)*F/P)``.

    ``halo_latents=None`` takes the halo from ``encoder`` (``temporal_receptive_field``); with both
    given, a halo below the encoder's receptive field is rejected.
    """
    F, P = num_latent_frames, sp_size
    _positive_int("num_latent_frames", F)
    _positive_int("sp_size", P)
    h = resolve_halo(halo_latents, encoder, temporal_stride, causal_first_frame)
    if F % P:
        raise ValueError(f"num_latent_frames ({F}) must be divisible by sp_size ({P})")
    n = F // P
    return [halo_window(r * n, (r + 1) * n, h, temporal_stride, causal_first_frame, rank=r)
            for r in range(P)]


def resolve_halo(halo_latents: Optional[int], encoder: Optional[nn.Module], temporal_stride: int = 4,
                 causal_first_frame: bool = True) -> int:
    """The halo to use: ``halo_latents`` checked against ``encoder``'s receptive field, or derived."""
    if halo_latents is None and encoder is None:
        raise ValueError("halo_latents (None) needs an encoder to derive the halo from")
    if halo_latents is not None:
        _nonneg_int("halo_latents", halo_latents)
    if encoder is None:
        return halo_latents
    need = temporal_receptive_field(encoder, temporal_stride, causal_first_frame)
    if halo_latents is None:
        return need
    if halo_latents < need:
        raise ValueError(f"halo_latents ({halo_latents}) must be >= the encoder's temporal receptive "
                         f"field ({need} latents), otherwise kept latents see window padding")
    return halo_latents


# ----------------------------------------------------------------------------------------------
# Receptive field of a causal encoder
# ----------------------------------------------------------------------------------------------
def encoder_temporal_ops(encoder: nn.Module) -> List[Tuple[int, int, int]]:
    """``(kernel, stride, pad)`` of every causal temporal op, in registration order.

    The encoder must register its causal ops in execution order (a sequential stack; residual
    branches whose skip path is the identity are fine: the conv path bounds the look-back). A
    temporal conv that is not a declared causal op (kernel or stride > 1 along time) raises, since its
    receptive field cannot be reasoned about.
    """
    ops, causal_prefixes = [], []
    for name, mod in encoder.named_modules():
        if any(name.startswith(p) for p in causal_prefixes):
            continue  # the inner conv of a declared causal op
        op = getattr(mod, "causal_time_op", None)
        if op is not None:
            k, s, p = (int(v) for v in op)
            if k < 1 or s < 1 or p != k - 1:
                raise ValueError(f"{name or type(mod).__name__}: causal_time_op ({op}) must have "
                                 f"kernel >= 1, stride >= 1 and pad == kernel - 1 (causal)")
            ops.append((k, s, p))
            causal_prefixes.append(name + ".")
        elif isinstance(mod, nn.Conv3d) and (mod.kernel_size[0] > 1 or mod.stride[0] > 1):
            raise ValueError(f"{name}: nn.Conv3d with temporal kernel {mod.kernel_size[0]} / stride "
                             f"{mod.stride[0]} is not a declared causal temporal op (causal_time_op)")
    return ops


def temporal_lookback(ops: Sequence[Tuple[int, int, int]]) -> Tuple[int, int]:
    """``(L, Σ)``: final output ``j`` reads raw frames ``[j*Σ - L, j*Σ]``."""
    L, stride = 0, 1
    for k, s, _ in ops:
        L += (k - 1) * stride
        stride *= s
    return L, stride


def halo_for_lookback(lookback: int, temporal_stride: int, causal_first_frame: bool = True) -> int:
    """Smallest halo (latents) for which the kept latents' raw receptive field lies in the window."""
    L, st = lookback, temporal_stride
    if causal_first_frame:
        return max(0, -(-L // st) - 1)
    return max(0, -(-(L - st + 1) // st))


def temporal_receptive_field(encoder: nn.Module, temporal_stride: Optional[int] = None,
                             causal_first_frame: bool = True) -> int:
    """Halo latents ``encoder`` needs for exact windowed encoding, derived from its causal stack."""
    ops = encoder_temporal_ops(encoder)
    if not ops:
        raise ValueError(f"encoder ({type(encoder).__name__}) declares no causal temporal ops "
                         f"(modules with causal_time_op); cannot derive its receptive field")
    L, st = temporal_lookback(ops)
    if temporal_stride is not None and st != temporal_stride:
        raise ValueError(f"temporal_stride ({temporal_stride}) differs from the encoder's total "
                         f"temporal stride ({st})")
    return halo_for_lookback(L, st, causal_first_frame)
