"""Classifier-free guidance: condition dropout for training, guided denoising for sampling.

A condition is a tensor or a tuple of tensors with a leading batch dim (e.g. ``(text_emb [b, L, d],
text_mask [b, L])``). A null condition has the same structure with batch dim 1 (or none, or ``b``).
Guidance runs the conditional and unconditional passes as ONE model call on the batch concatenated
along dim 0, which is what the CFG inference layout (batch 2) expects and halves the launches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from .edm import expand_like

__all__ = ["drop_condition", "guided_denoise", "classifier_free_guidance"]

Cond = Union[Tensor, tuple]


def _leaves(cond: Cond, name: str) -> tuple[Tensor, ...]:
    leaves = cond if isinstance(cond, (tuple, list)) else (cond,)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        raise TypeError(
            f"{name} must be a Tensor or a non-empty tuple of Tensors, got {type(cond).__name__}"
        )
    return tuple(leaves)


def _rebuild(like: Cond, leaves: list) -> Cond:
    return type(like)(leaves) if isinstance(like, (tuple, list)) else leaves[0]


def _null_like(null: Tensor, c: Tensor, b: int, name: str) -> Tensor:
    """Broadcast one null leaf to ``[b, *c.shape[1:]]``."""
    if null.dim() == c.dim() - 1:
        null = null.unsqueeze(0)
    if null.dim() != c.dim() or null.shape[0] not in (1, b) or null.shape[1:] != c.shape[1:]:
        raise ValueError(
            f"{name} leaf shape {tuple(null.shape)} must be [1 or {b}, *{tuple(c.shape[1:])}] "
            f"to match the condition {tuple(c.shape)}"
        )
    return null.to(device=c.device, dtype=c.dtype).expand(b, *c.shape[1:])


def _pair(cond: Cond, null_cond: Cond) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], int]:
    conds, nulls = _leaves(cond, "cond"), _leaves(null_cond, "null_cond")
    if len(conds) != len(nulls):
        raise ValueError(f"null_cond has {len(nulls)} tensors; must match cond's {len(conds)}")
    b = conds[0].shape[0]
    if any(c.dim() == 0 or c.shape[0] != b for c in conds):
        raise ValueError(
            f"every cond tensor must have leading batch dim {b}; got "
            f"{[tuple(c.shape) for c in conds]}"
        )
    return conds, tuple(_null_like(n, c, b, "null_cond") for n, c in zip(nulls, conds)), b


def drop_condition(
    cond: Cond,
    null_cond: Cond,
    p: float,
    *,
    generator: Optional[torch.Generator] = None,
    drop: Optional[Tensor] = None,
) -> tuple[Cond, Tensor]:
    """Replace each sample's condition by the null one with probability ``p`` (training-time CFG).

    Returns ``(new_cond, drop)`` with ``drop`` the ``[b]`` bool mask of replaced samples. ``drop`` may
    be injected (e.g. the same decision on every CP/TP rank); otherwise drawn from ``generator``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p ({p}) must be in [0, 1]")
    conds, nulls, b = _pair(cond, null_cond)
    if drop is None:
        drop = torch.rand(b, generator=generator, device=conds[0].device) < p
    elif drop.shape != (b,) or drop.dtype != torch.bool:
        raise ValueError(
            f"drop (shape {tuple(drop.shape)}, {drop.dtype}) must be a bool tensor of shape [{b}]"
        )
    out = [
        torch.where(expand_like(drop.to(c.device), c, "drop"), n, c) for c, n in zip(conds, nulls)
    ]
    return _rebuild(cond, out), drop


def guided_denoise(
    denoise: Callable[[Tensor, Tensor, Any], Tensor],
    x: Tensor,
    sigma: Tensor,
    cond: Cond,
    null_cond: Cond,
    guidance_scale: float,
) -> Tensor:
    """``uncond + w (cond - uncond)`` from ONE ``denoise`` call on ``[x; x]`` with ``[cond; null]``.

    Written as ``cond + (w - 1)(cond - uncond)`` so ``w = 1`` returns the conditional output exactly.
    """
    if not math.isfinite(guidance_scale):
        raise ValueError(f"guidance_scale ({guidance_scale}) must be finite")
    conds, nulls, b = _pair(cond, null_cond)
    if x.shape[0] != b:
        raise ValueError(f"x batch ({x.shape[0]}) must equal the condition batch ({b})")
    sigma = torch.as_tensor(sigma, device=x.device)
    sigma2 = sigma if sigma.dim() == 0 else torch.cat([sigma, sigma])
    both = [torch.cat([c, n]) for c, n in zip(conds, nulls)]
    out = denoise(torch.cat([x, x]), sigma2, _rebuild(cond, both))
    out_c, out_u = out[:b], out[b:]
    return out_c + (guidance_scale - 1.0) * (out_c - out_u)


def classifier_free_guidance(
    denoise: Callable[[Tensor, Tensor, Any], Tensor], null_cond: Cond, guidance_scale: float
) -> Callable[[Tensor, Tensor, Cond], Tensor]:
    """Wrap ``denoise`` into a guided ``denoise(x, sigma, cond)`` usable by the samplers."""
    if not math.isfinite(guidance_scale):
        raise ValueError(f"guidance_scale ({guidance_scale}) must be finite")

    def guided(x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return guided_denoise(denoise, x, sigma, cond, null_cond, guidance_scale)

    return guided
