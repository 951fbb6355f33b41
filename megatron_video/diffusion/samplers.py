"""Samplers: EDM Heun (2nd order) and Euler, flow-matching Euler, generic over
``denoise(x, sigma_or_t, cond)`` (``sigma_or_t`` a ``[b]`` tensor). Between model calls everything
is elementwise, so under context parallelism each rank samples its shard and the gathered result
equals the single-GPU one. Randomness comes only from ``generator`` / ``noise_fn`` (none with
``churn = 0``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .flow_matching import shift_timesteps

__all__ = [
    "karras_sigmas",
    "flow_timesteps",
    "edm_sampler",
    "edm_heun_sampler",
    "edm_euler_sampler",
    "flow_euler_sampler",
]

Denoise = Callable[[Tensor, Tensor, Any], Tensor]


def karras_sigmas(
    num_steps: int,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    *,
    device=None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Karras schedule from ``sigma_max`` to ``sigma_min`` (``num_steps`` values), then a final 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps ({num_steps}) must be >= 1")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(
            f"sigma_min ({sigma_min}), sigma_max ({sigma_max}) must satisfy "
            "0 < sigma_min < sigma_max"
        )
    if not rho > 0:
        raise ValueError(f"rho ({rho}) must be > 0")
    ramp = torch.arange(num_steps, dtype=torch.float64) / max(num_steps - 1, 1)
    inv = 1.0 / rho
    sig = (sigma_max**inv + ramp * (sigma_min**inv - sigma_max**inv)) ** rho
    return torch.cat([sig, sig.new_zeros(1)]).to(device=device, dtype=dtype)


def flow_timesteps(
    num_steps: int, shift: float = 1.0, *, device=None, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``num_steps + 1`` flow-matching times from 1 (noise) to 0 (data), uniform then shifted."""
    if num_steps < 1:
        raise ValueError(f"num_steps ({num_steps}) must be >= 1")
    return shift_timesteps(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift).to(
        device=device, dtype=dtype
    )


def _time_dtype(x: Tensor) -> torch.dtype:
    """sigma / t go to the model in >= fp32 even for bf16 latents (ln(sigma) needs the precision)."""
    return torch.promote_types(x.dtype, torch.float32)


def _check_schedule(values: Tensor, name: str) -> list[float]:
    if values.dim() != 1 or values.numel() < 2:
        raise ValueError(f"{name} shape {tuple(values.shape)} must be 1-D with >= 2 entries")
    vals = [float(v) for v in values]
    if any(b >= a for a, b in zip(vals, vals[1:])) or vals[-1] < 0:
        raise ValueError(
            f"{name} must be strictly decreasing and end >= 0 (got {vals[:3]}...{vals[-2:]})"
        )
    return vals


def edm_sampler(
    denoise: Denoise,
    noise: Tensor,
    cond: Any = None,
    *,
    second_order: bool = True,
    num_steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    sigmas: Optional[Tensor] = None,
    churn: float = 0.0,
    churn_min: float = 0.0,
    churn_max: float = float("inf"),
    s_noise: float = 1.0,
    generator: Optional[torch.Generator] = None,
    noise_fn: Optional[Callable[[Tensor], Tensor]] = None,
    progress: bool = False,
) -> Tensor:
    """EDM Algorithm 2 on the Karras schedule: Heun steps (``second_order``; Euler on the last
    step to sigma = 0) or Euler steps (one model call per step).

    ``noise`` is unit-variance; the sampler starts at ``noise * sigmas[0]``. ``sigmas`` overrides
    the Karras schedule. ``churn > 0`` adds the stochastic churn of the paper, drawn from
    ``noise_fn(x)`` if given (e.g. a CP rank slicing its shard out of a global draw) else from
    ``generator``.
    """
    if sigmas is None:
        sigmas = karras_sigmas(num_steps, sigma_min, sigma_max, rho)
    if churn < 0:
        raise ValueError(f"churn ({churn}) must be >= 0")
    sig = _check_schedule(sigmas, "sigmas")
    num_steps = len(sig) - 1
    b = noise.shape[0]

    def call(x: Tensor, s: float) -> Tensor:
        return denoise(x, torch.full((b,), s, dtype=_time_dtype(x), device=x.device), cond)

    def randn_like(x: Tensor) -> Tensor:
        if noise_fn is not None:
            return noise_fn(x)
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)

    x = noise * sig[0]
    for i in tqdm(range(num_steps), disable=not progress, desc="sampling", leave=False):
        t_cur, t_next = sig[i], sig[i + 1]
        gamma = (
            min(churn / num_steps, math.sqrt(2.0) - 1.0) if churn_min <= t_cur <= churn_max else 0.0
        )
        t_hat = t_cur * (1.0 + gamma)
        x_hat = x + math.sqrt(t_hat**2 - t_cur**2) * s_noise * randn_like(x) if gamma > 0 else x
        d_cur = (x_hat - call(x_hat, t_hat)) / t_hat
        x_next = x_hat + (t_next - t_hat) * d_cur
        if second_order and t_next > 0:
            # Heun's corrector: the slope at the Euler PREDICTION (x_next, t_next), not at (x_cur, t_next).
            d_next = (x_next - call(x_next, t_next)) / t_next
            x_next = x_hat + (t_next - t_hat) * 0.5 * (d_cur + d_next)
        x = x_next
    return x


def edm_heun_sampler(denoise: Denoise, noise: Tensor, cond: Any = None, **options) -> Tensor:
    """EDM Algorithm 2: Heun steps on the Karras schedule (Euler on the last step to sigma = 0);
    ``edm_sampler`` with ``second_order=True``, the same keyword ``options``."""
    return edm_sampler(denoise, noise, cond, second_order=True, **options)


def edm_euler_sampler(denoise: Denoise, noise: Tensor, cond: Any = None, **options) -> Tensor:
    """First-order (Euler) counterpart of ``edm_heun_sampler``: one model call per step;
    ``edm_sampler`` with ``second_order=False``, the same keyword ``options``."""
    return edm_sampler(denoise, noise, cond, second_order=False, **options)


def flow_euler_sampler(
    velocity: Denoise,
    noise: Tensor,
    cond: Any = None,
    *,
    num_steps: int = 50,
    shift: float = 1.0,
    timesteps: Optional[Tensor] = None,
    progress: bool = False,
) -> Tensor:
    """Integrate ``dx/dt = v(x, t, cond)`` from ``t = 1`` (``x = noise``) to ``t = 0`` with Euler steps.

    ``timesteps`` (decreasing, e.g. ``flow_timesteps``) overrides the uniform-then-shifted grid.
    """
    if timesteps is None:
        timesteps = flow_timesteps(num_steps, shift)
    ts = _check_schedule(timesteps, "timesteps")
    b = noise.shape[0]
    x = noise
    for i in tqdm(range(len(ts) - 1), disable=not progress, desc="sampling", leave=False):
        t_cur, t_next = ts[i], ts[i + 1]
        v = velocity(x, torch.full((b,), t_cur, dtype=_time_dtype(x), device=x.device), cond)
        x = x + (t_next - t_cur) * v
    return x
