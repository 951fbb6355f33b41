"""First-frame conditioning in Wan 2.2 TI2V's convention (diffusers' ``WanImageToVideoPipeline``
with ``expand_timesteps=True``): the first latent frame of an I2V sample is the clean encoded
image, its tokens get timestep 0 and carry no loss; the other tokens are the flow-matching
interpolation with the sample's timestep(s).

``condition`` marks the conditioning tokens ``[b, s]`` of this rank (``i2v [b]`` the samples
drawn as I2V, ``first [s]`` this rank's tokens of latent frame 0); ``condition_inputs`` puts the
clean tokens and timestep 0 there; ``condition_loss_tokens`` counts the loss tokens of a
micro-batch (identical on every rank: the draws are global).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["condition", "condition_inputs", "condition_loss_tokens", "check_first_frame_patch"]


def check_first_frame_patch(patch, field: str = "model.patch_size") -> None:
    """The first latent frame must be whole tokens: temporal patch ``pt`` 1 (TI2V-5B's (1, 2, 2))."""
    if int(patch[0]) != 1:
        raise ValueError(
            f"{field} ({list(patch)!r}) must have temporal patch 1 for first-frame (I2V) "
            f"conditioning: a token of pt = {patch[0]} frames would mix the clean image with noise"
        )


def condition(i2v: Optional[Tensor], first: Tensor) -> Optional[Tensor]:
    """``[b, s]`` bool: token ``j`` of sample ``i`` is the conditioning image (``i2v[i]`` and
    ``first[j]``); None without I2V samples."""
    if i2v is None:
        return None
    return i2v.to(torch.bool)[:, None] & first.to(device=i2v.device, dtype=torch.bool)[None, :]


def condition_inputs(
    cond: Optional[Tensor], x: Optional[Tensor], clean: Optional[Tensor], t: Tensor
) -> Tuple[Optional[Tensor], Tensor]:
    """``(x, t)`` with the clean tokens and timestep 0 at ``cond`` (``x``/``clean [b, s, D]``,
    None off the first pipeline stage; ``t [b, s]`` per token)."""
    if cond is None:
        return x, t
    cond = cond.to(t.device)
    t = torch.where(cond, torch.zeros_like(t), t)
    if x is not None:
        x = torch.where(cond[..., None].to(x.device), clean.to(x.dtype), x)
    return x, t


def condition_loss_tokens(i2v: Optional[Tensor], tokens_per_sample: int, first_tokens: int) -> int:
    """Loss tokens of the micro-batch: every token of each sample but the first frame's
    (``first_tokens``) of its I2V samples."""
    if i2v is None:
        raise ValueError("i2v (None) must be the [b] bool I2V draw of the micro-batch")
    b, n_i2v = int(i2v.numel()), int(i2v.to(torch.bool).sum())
    return b * tokens_per_sample - n_i2v * first_tokens
