"""The halo an encoder needs for exact SP-folded encoding (``layouts.vae_halo``'s windows): from its
declared causal temporal ops (``causal_time_op``, e.g. ``models.vae``), or, for any other causal
encoder, probed from its behaviour (``probe_halo``, cached per configuration by ``encoder_halo``).
Design: docs/architecture.md, "Capabilities" 2 (VAE halo).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..checks import check_nonneg_int, check_positive_int
from ..layouts.vae_halo import halo_for_lookback, halo_window, num_raw_frames, temporal_lookback
from .vae_geometry import module_geometry

__all__ = [
    "Encoder",
    "resolve_halo",
    "encoder_temporal_ops",
    "temporal_receptive_field",
    "HaloProbe",
    "probe_halo",
    "encoder_halo",
    "halo_error",
]

Encoder = Union[nn.Module, Callable[[torch.Tensor], torch.Tensor]]


def resolve_halo(
    halo_latents: Optional[int],
    encoder: Optional[Encoder],
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
) -> int:
    """The halo to use: ``halo_latents`` checked against ``encoder``'s receptive field, or derived
    (declared causal ops, else a cached probe: ``encoder_halo``)."""
    if halo_latents is None and encoder is None:
        raise ValueError("halo_latents (None) needs an encoder to derive the halo from")
    if halo_latents is not None:
        check_nonneg_int("halo_latents", halo_latents)
    if encoder is None:
        return halo_latents
    need = encoder_halo(encoder, temporal_stride, causal_first_frame)
    if halo_latents is None:
        return need
    if halo_latents < need:
        raise ValueError(
            f"halo_latents ({halo_latents}) must be >= the encoder's temporal receptive "
            f"field ({need} latents), otherwise kept latents see window padding"
        )
    return halo_latents


# ----------------------------------------------------------------------------------------------
# Declared causal ops: the receptive field from the op stack
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
                raise ValueError(
                    f"{name or type(mod).__name__}: causal_time_op ({op}) must have "
                    f"kernel >= 1, stride >= 1 and pad == kernel - 1 (causal)"
                )
            ops.append((k, s, p))
            causal_prefixes.append(name + ".")
        elif isinstance(mod, nn.Conv3d) and (mod.kernel_size[0] > 1 or mod.stride[0] > 1):
            raise ValueError(
                f"{name}: nn.Conv3d with temporal kernel {mod.kernel_size[0]} / stride "
                f"{mod.stride[0]} is not a declared causal temporal op (causal_time_op)"
            )
    return ops


def temporal_receptive_field(
    encoder: nn.Module, temporal_stride: Optional[int] = None, causal_first_frame: bool = True
) -> int:
    """Halo latents ``encoder`` needs for exact windowed encoding, derived from its causal stack."""
    ops = encoder_temporal_ops(encoder)
    if not ops:
        raise ValueError(
            f"encoder ({type(encoder).__name__}) declares no causal temporal ops "
            f"(modules with causal_time_op); cannot derive its receptive field"
        )
    L, st = temporal_lookback(ops)
    if temporal_stride is not None and st != temporal_stride:
        raise ValueError(
            f"temporal_stride ({temporal_stride}) differs from the encoder's total "
            f"temporal stride ({st})"
        )
    return halo_for_lookback(L, st, causal_first_frame)


# ----------------------------------------------------------------------------------------------
# Any causal encoder: the halo from its behaviour
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HaloProbe:
    """What ``probe_halo`` found: ``halo`` latents (exact, verified), the raw look-back ``lookback``
    of a latent from the gradient, the clip length it took (``probe_latents``), and
    ``verified_from`` (the halo the look-back alone gives; ``halo`` is larger only when the
    windowed check needed more)."""

    halo: int
    lookback: int
    temporal_stride: int
    probe_latents: int
    verified_from: int


def _modules_of(encoder: Encoder, _seen=None) -> List[nn.Module]:
    """The modules an encoder runs: itself, or those a callable closes over / is bound to,
    looking through wrappers (``functools.wraps``' ``__wrapped__``, e.g. ``torch.no_grad()(f)``,
    and functions in its closure)."""
    if isinstance(encoder, nn.Module):
        return [encoder]
    seen = set() if _seen is None else _seen
    if id(encoder) in seen:
        return []
    seen.add(id(encoder))
    found, inner = [], [getattr(encoder, "__wrapped__", None)]
    bound = getattr(encoder, "__self__", None)
    if isinstance(bound, nn.Module):
        found.append(bound)
    for cell in getattr(encoder, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:
            continue
    code = getattr(encoder, "__code__", None)
    glb = getattr(encoder, "__globals__", {}) or {}
    direct = [glb.get(name) for name in code.co_names] if code is not None else []
    direct += list(getattr(encoder, "__defaults__", None) or ())
    found += [v for v in direct if isinstance(v, nn.Module)]
    for v in inner:
        if isinstance(v, nn.Module):
            found.append(v)
        elif inspect.isfunction(v):
            found += _modules_of(v, seen)
    return list({id(m): m for m in found}.values())


def _module_key(m: nn.Module) -> str:
    cfg = getattr(m, "config", None)
    parts = [type(m).__module__, type(m).__qualname__, repr(m)]
    if isinstance(cfg, dict) or hasattr(cfg, "items"):
        try:
            parts.append(repr(sorted((str(k), repr(v)) for k, v in cfg.items())))
        except Exception:  # an exotic config object: the module tree and shapes identify it
            pass
    parts += [f"{n}:{tuple(t.shape)}" for n, t in m.state_dict().items()]
    return "|".join(parts)


def _config_key(encoder: Encoder, *args) -> str:
    """One key per encoder configuration (architecture, not weights: the look-back is structural)."""
    parts = [_module_key(m) for m in _modules_of(encoder)]
    if not isinstance(encoder, nn.Module):
        code = getattr(encoder, "__code__", None)
        parts.append(
            repr((code.co_code, code.co_consts, code.co_names))
            if code is not None
            else f"{type(encoder).__qualname__}@{id(encoder)}"
        )
    parts.append(repr(args))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


@contextlib.contextmanager
def _as_float64(modules: Sequence[nn.Module]):
    """Run ``modules`` in float64 and eval mode; every tensor and flag restored afterwards (float32
    / bfloat16 -> float64 -> back is exact)."""
    saved, modes = [], []
    try:
        for m in modules:
            modes += [(sub, sub.training) for sub in m.modules()]
            m.eval()
            for t in list(m.parameters()) + list(m.buffers()):
                if t.is_floating_point() and t.dtype != torch.float64:
                    saved.append((t, t.data))
                    t.data = t.data.to(torch.float64)
        yield
    finally:
        for t, data in saved:
            t.data = data
        for sub, mode in modes:
            sub.train(mode)


def _geometry(encoder: Encoder):
    """The ``models.vae_geometry.VAEGeometry`` of the first module with a VAE config, or None."""
    for m in _modules_of(encoder):
        for sub in m.modules():
            g = module_geometry(sub)
            if g is not None:
                return g
    return None


def _in_channels(encoder: Encoder) -> int:
    """The video's channels: a VAE config's (``in_channels`` / its patch^2: Wan 2.2 patchifies
    inside the VAE), else the first ``in_channels`` or 3-D conv found, else 3."""
    g = _geometry(encoder)
    if g is not None:
        return g.video_channels
    for m in _modules_of(encoder):
        cfg = getattr(m, "config", None)
        c = cfg.get("in_channels") if hasattr(cfg, "get") else None
        if c is None and "in_channels" in vars(m):
            c = vars(m)["in_channels"]
        if isinstance(c, int) and not isinstance(c, bool):
            return c
        for sub in m.modules():
            if isinstance(sub, nn.Conv3d):
                return sub.in_channels
    return 3


def _run(encoder: Encoder, x: torch.Tensor, name: str) -> torch.Tensor:
    out = encoder(x)
    if not isinstance(out, torch.Tensor) or out.dim() != 5:
        raise ValueError(
            f"{name} must return a 5-D tensor [B, C, F, h, w] for a [B, C, T, H, W] video; "
            f"got {getattr(out, 'shape', type(out).__name__)}"
        )
    return out


def _gradient_reach(encoder: Encoder, x, N: int, st: int, cff: bool, g):
    """``(first, last)``: the first raw frame the last latent of ``encoder(x)`` reads and the last
    raw frame the previous latent reads (``None`` where it reads none), from the gradients of one
    random weighting drawn from ``g``. An encoder that gives no gradient (e.g. wrapped in
    ``torch.no_grad()``, the usual inference idiom) is probed by perturbing raw frames instead
    (:func:`_perturbation_reach`)."""
    T = x.shape[2]
    with torch.enable_grad():
        x.requires_grad_(True)
        out = _run(encoder, x, "encoder")
        if out.shape[2] != N:
            raise ValueError(
                f"encoder produced {out.shape[2]} latents for {T} raw frames; with "
                f"temporal_stride={st}, causal_first_frame={cff} it must produce {N}"
            )
        if not out.requires_grad:
            x.requires_grad_(False)
            return _perturbation_reach(encoder, x, out.detach(), g)
        w = torch.randn(out[:, :, -1:].shape, generator=g, dtype=out.dtype)
        (g_last,) = torch.autograd.grad((out[:, :, -1:] * w).sum(), x, retain_graph=True)
        (g_prev,) = torch.autograd.grad((out[:, :, -2:-1] * w).sum(), x)
    reach_last = g_last.abs().flatten(3).sum(dim=(0, 1, 3)).nonzero().flatten()
    reach_prev = g_prev.abs().flatten(3).sum(dim=(0, 1, 3)).nonzero().flatten()
    first = int(reach_last[0]) if reach_last.numel() else None
    return first, (int(reach_prev[-1]) if reach_prev.numel() else None)


def _perturbation_reach(encoder: Encoder, x, out, g):
    """``_gradient_reach`` without autograd, by bisection: adding noise to the raw frames
    ``[0, t]`` changes the last latent exactly when ``t`` reaches the first frame it reads, and
    adding noise to ``[t, T)`` changes the previous latent exactly when ``t`` is at most the last
    frame it reads (float64: frames a latent does not read leave it bit-identical). About
    ``2 log2(T)`` encoder calls."""
    T = x.shape[2]

    def changes(lo, hi, latent):
        xt = x.clone()
        xt[:, :, lo:hi] += torch.randn(xt[:, :, lo:hi].shape, generator=g, dtype=x.dtype)
        with torch.no_grad():
            d = _run(encoder, xt, "encoder")[:, :, latent] - out[:, :, latent]
        return bool(d.abs().max() > 0)

    def bisect(pred):  # the smallest t in [0, T) with pred(t), monotone; T when none
        lo, hi = 0, T
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
        return lo

    first = bisect(lambda t: changes(0, t + 1, -1))
    beyond = bisect(lambda t: not changes(t, T, -2))  # one past the last frame latent N-2 reads
    return (first if first < T else None), (beyond - 1 if beyond > 0 else None)


def _exact_halo(encoder: Encoder, x, N: int, L: int, h: int, st: int, cff: bool, atol: float):
    """The smallest halo from ``h`` up whose window of the last latent of the ``N``-latent clip
    ``x`` encodes to the full clip's last latent (within ``atol`` relative)."""
    with torch.no_grad():
        full = _run(encoder, x, "encoder")[:, :, -1:]
        scale = max(1.0, float(full.abs().max()))
        while True:
            win = halo_window(N - 1, N, h, st, cff)
            got = _run(encoder, win.slice_raw(x), "encoder")
            if (
                got.shape[2] == win.num_window_latents
                and float((got[:, :, -1:] - full).abs().max()) <= atol * scale
            ):
                return h
            if win.halo_start == 0:
                raise ValueError(
                    f"no halo below {N - 1} latents makes the encoder's windows exact "
                    f"(look-back {L} raw frames); is it causal?"
                )
            h += 1


def probe_halo(
    encoder: Encoder,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
    *,
    in_channels: Optional[int] = None,
    spatial: Optional[Tuple[int, int]] = None,
    num_latents: int = 8,
    max_latents: int = 64,
    seed: int = 0,
    atol: float = 1e-10,
) -> HaloProbe:
    """Derive the smallest exact halo of a causal ``encoder`` (module or callable, e.g. diffusers'
    ``AutoencoderKLWan`` or ``lambda x: vae.encode(x).latent_dist.mean``) from its behaviour.

    In float64, at a small spatial size, the gradient of the LAST latent of a short random clip with
    respect to the raw frames is non-zero exactly on the frames it reads, which gives ``L``; frames
    after an earlier latent must get no gradient (causality). The halo from ``L`` is then checked by
    encoding the window of the last latent and comparing with the full clip's encoding (raised until
    exact, in case the encoder treats a window's first frame differently from a frame with history).
    Raises ``ValueError`` when the encoder is not causal, produces the wrong number of latents for
    ``temporal_stride``, or looks back further than ``max_latents`` latents."""
    check_positive_int("temporal_stride", temporal_stride)
    check_positive_int("num_latents", num_latents)
    if num_latents < 3:
        raise ValueError(
            f"num_latents ({num_latents}) must be >= 3 (a causality check and a windowed check)"
        )
    st, cff = temporal_stride, causal_first_frame
    c = _in_channels(encoder) if in_channels is None else in_channels
    spatial = _probe_spatial(encoder) if spatial is None else spatial
    g = torch.Generator().manual_seed(seed)
    N = num_latents
    with _as_float64(_modules_of(encoder)):
        while True:
            T = num_raw_frames(N, st, cff)
            x = torch.randn(1, c, T, *spatial, generator=g, dtype=torch.float64)
            first, prev_last = _gradient_reach(encoder, x, N, st, cff, g)
            prev_end = st * (N - 2) if cff else st * (N - 1) - 1  # last raw frame of latent N-2
            if prev_last is not None and prev_last > prev_end:
                raise ValueError(
                    f"encoder is not causal in time: latent {N - 2} depends on raw frame "
                    f"{prev_last} (> {prev_end}); a halo cannot make windows exact"
                )
            if first is None:
                raise ValueError(
                    "encoder's last latent does not depend on its input (no gradient); "
                    "cannot probe its temporal look-back"
                )
            if first > 0 or N >= max_latents:
                break
            N *= 2
        if first == 0:
            raise ValueError(
                f"encoder's look-back reaches the start of a {N}-latent probe clip "
                f"(max_latents={max_latents}); it is not a finite causal window"
            )
        L = st * (N - 1) - first
        h0 = halo_for_lookback(L, st, cff)
        x = torch.randn(
            1, c, num_raw_frames(N, st, cff), *spatial, generator=g, dtype=torch.float64
        )
        h = _exact_halo(encoder, x, N, L, h0, st, cff, atol)
    return HaloProbe(halo=h, lookback=L, temporal_stride=st, probe_latents=N, verified_from=h0)


def _probe_spatial(encoder: Encoder) -> Tuple[int, int]:
    """The probe's frame size: one latent pixel of a VAE with a known spatial stride, else 16."""
    g = _geometry(encoder)
    s = g.spatial_stride if g is not None else 16
    return (s, s)


def halo_error(
    encoder: Encoder,
    halo_latents: int,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
    *,
    num_latents: int,
    seed: int = 0,
) -> float:
    """What a too-short halo costs: max |latent ``N - 1`` encoded from its ``halo_latents``
    window - the same latent of the full ``num_latents``-latent clip| on a random float64 clip
    (one latent pixel wide, ``[-1, 1]``)."""
    check_nonneg_int("halo_latents", halo_latents)
    N, st, cff = num_latents, temporal_stride, causal_first_frame
    g = torch.Generator().manual_seed(seed)
    with _as_float64(_modules_of(encoder)), torch.no_grad():
        T = num_raw_frames(N, st, cff)
        x = torch.rand(1, _in_channels(encoder), T, *_probe_spatial(encoder), generator=g)
        x = (2 * x - 1).to(torch.float64)
        full = _run(encoder, x, "encoder")[:, :, -1:]
        win = halo_window(N - 1, N, halo_latents, st, cff)
        got = _run(encoder, win.slice_raw(x), "encoder")[:, :, -1:]
    return float((got - full).abs().max())


_HALO_CACHE: Dict[str, HaloProbe] = {}


def encoder_halo(
    encoder: Encoder, temporal_stride: int = 4, causal_first_frame: bool = True, **probe_kwargs
) -> int:
    """Halo latents ``encoder`` needs: from its declared causal ops (fast path), else from
    ``probe_halo``, probed once per encoder configuration (cached in-process; ``probe_kwargs`` are
    used by the first probe of a configuration)."""
    if isinstance(encoder, nn.Module):
        try:
            ops = encoder_temporal_ops(encoder)
        except ValueError:
            ops = None  # an undeclared temporal conv: its behaviour decides
        if ops:
            return temporal_receptive_field(encoder, temporal_stride, causal_first_frame)
    elif not callable(encoder):
        raise ValueError(
            f"encoder ({type(encoder).__name__}) must be an nn.Module or a callable "
            f"video -> latents"
        )
    # the look-back is structural: the probe's clip and spatial size do not enter the key
    key = _config_key(encoder, temporal_stride, causal_first_frame)
    if key not in _HALO_CACHE:
        _HALO_CACHE[key] = probe_halo(encoder, temporal_stride, causal_first_frame, **probe_kwargs)
    return _HALO_CACHE[key].halo
