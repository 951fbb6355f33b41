"""Flow matching (rectified flow) for the autoregressive model: ``x_t = (1 - t) x0 + t eps``
(``t = 0`` data, ``t = 1`` noise), the network predicts the velocity ``eps - x0``. Noise and
timesteps are injectable so a sequence-parallel run reproduces the single-GPU draws; the loss takes
an explicit (global) normaliser.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from .edm import expand_like, reduce_token_loss

__all__ = [
    "shift_timesteps",
    "sample_timesteps",
    "expand_block_timesteps",
    "fm_interpolate",
    "fm_target",
    "fm_loss",
]

_DISTRIBUTIONS = ("logit_normal", "uniform")


def shift_timesteps(t: Tensor, shift: float) -> Tensor:
    """``shift * t / (1 + (shift - 1) t)``: shift > 1 moves mass towards noise (t = 1), fixing 0 and 1."""
    if not shift > 0:
        raise ValueError(f"shift ({shift}) must be > 0")
    return shift * t / (1.0 + (shift - 1.0) * t)


def sample_timesteps(
    shape,
    *,
    distribution: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
    shift: float = 1.0,
    generator: Optional[torch.Generator] = None,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Training timesteps in (0, 1): logit-normal ``sigmoid(N(mean, std^2))`` or uniform, then shifted."""
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"distribution ({distribution!r}) must be one of {_DISTRIBUTIONS}")
    if not std > 0:
        raise ValueError(f"std ({std}) must be > 0")
    if distribution == "logit_normal":
        t = torch.sigmoid(
            mean + std * torch.randn(shape, generator=generator, device=device, dtype=dtype)
        )
    else:
        t = torch.rand(shape, generator=generator, device=device, dtype=dtype)
    return shift_timesteps(t, shift)


def expand_block_timesteps(block_t: Tensor, block_index: Tensor) -> Tensor:
    """Per-token timesteps ``[b, s]`` from per-block ``block_t [b, n_blocks]`` and ``block_index``.

    ``block_index`` (``[s]`` shared by the batch, or ``[b, s]``) gives each token's block; on an SP shard
    pass the local tokens' global block ids.

    Timesteps ``t`` have a prefix shape of ``x`` (``[b]`` per sample, ``[b, s]`` per token);
    per-block timesteps (one per group of tokens, e.g. per AR frame block) are broadcast to tokens
    here.
    """
    if block_t.dim() != 2:
        raise ValueError(f"block_t shape {tuple(block_t.shape)} must be [b, n_blocks]")
    if block_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_index dtype ({block_index.dtype}) must be int32 or int64")
    if block_index.dim() == 1:
        block_index = block_index.unsqueeze(0).expand(block_t.shape[0], -1)
    if block_index.dim() != 2 or block_index.shape[0] != block_t.shape[0]:
        raise ValueError(
            f"block_index shape {tuple(block_index.shape)} must be [s] or [b={block_t.shape[0]}, s]"
        )
    if block_index.numel() and (
        int(block_index.min()) < 0 or int(block_index.max()) >= block_t.shape[1]
    ):
        raise ValueError(
            f"block_index values [{int(block_index.min())}, {int(block_index.max())}] must lie "
            f"in [0, n_blocks={block_t.shape[1]})"
        )
    return torch.gather(block_t, 1, block_index.long())


def fm_interpolate(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """``x_t = (1 - t) x0 + t * noise`` with ``t`` broadcast from a prefix shape of ``x0``."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} must equal x0 shape {tuple(x0.shape)}")
    t = expand_like(t, x0, "t").to(x0.dtype)
    return (1.0 - t) * x0 + t * noise


def fm_target(x0: Tensor, noise: Tensor) -> Tensor:
    """Velocity target ``dx_t/dt = noise - x0``."""
    return noise - x0


def fm_loss(
    velocity_fn: Callable[[Tensor, Tensor, Any], Tensor],
    x0: Tensor,
    *,
    num_loss_tokens: Union[int, float, Tensor],
    loss_mask: Optional[Tensor] = None,
    t: Optional[Tensor] = None,
    noise: Optional[Tensor] = None,
    cond: Any = None,
    distribution: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
    shift: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """``sum_tokens mean_d (v(x_t, t, cond) - (noise - x0))^2 / num_loss_tokens``.

    ``t`` (prefix shape; default one draw per sample) and ``noise`` are injectable, otherwise drawn from
    ``generator``. ``num_loss_tokens`` is required: under SP the GLOBAL count of loss tokens.
    """
    if t is None:
        t = sample_timesteps(
            (x0.shape[0],),
            distribution=distribution,
            mean=mean,
            std=std,
            shift=shift,
            generator=generator,
            device=x0.device,
        )
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    x_t = fm_interpolate(x0, noise, t)
    v = velocity_fn(x_t, t, cond)
    acc = torch.promote_types(x0.dtype, torch.float32)
    per_element = (v.to(acc) - fm_target(x0, noise).to(acc)) ** 2
    return reduce_token_loss(per_element, loss_mask, num_loss_tokens)
