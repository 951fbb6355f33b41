"""Loss of packed micro-batches (``layouts.packed_video.PackedVideo``): the fixed-shape definition,
``sum of per-token losses / number of loss-bearing tokens`` of the GLOBAL batch, whatever the clips'
shapes, how they are packed and where the CP placement puts their tokens. Design:
docs/architecture.md, "Packed micro-batches in the models".

Every rank's loss is its share ``sum over its loss tokens / N_global``; the shares add up (CP: the
gradient all-reduce; DP and micro-batches: Megatron's gradient sum, with its per-micro-batch /
DP averaging switched off or undone) to the loss of the whole global batch. A per-clip or
per-micro-batch mean would weight short clips (images) as much as long videos.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..layouts.packed_video import PackedVideo
from ..parallel import comm
from .edm import reduce_token_loss
from .flow_matching import expand_block_timesteps, fm_interpolate, fm_target

__all__ = [
    "global_loss_tokens",
    "packed_token_loss",
    "packed_loss_mask",
    "packed_teacher_forcing_inputs",
]


def global_loss_tokens(packs: Sequence[PackedVideo], group=None) -> int:
    """Loss-bearing tokens of the global batch: this rank's micro-batches ``packs`` summed, then
    all-reduced over ``group`` (the data-parallel group; CP ranks share their micro-batches and
    must not be summed). Pure without ``group``."""
    packs = list(packs)
    if not packs or not all(isinstance(p, PackedVideo) for p in packs):
        raise ValueError(f"packs ({packs!r}) must be a non-empty sequence of PackedVideo")
    count = torch.tensor([sum(p.num_loss_tokens for p in packs)], dtype=torch.int64)
    if group is not None:
        comm.all_reduce(count, group, tag="packed.loss_tokens")
    return int(count)


def packed_loss_mask(packed: PackedVideo, ids: Tensor) -> Tensor:
    """Bool ``[1, s_local]``: the loss-bearing tokens among this rank's global ``ids``."""
    return packed.loss_mask(ids)[None]


def packed_token_loss(
    prediction: Tensor,
    target: Tensor,
    loss_mask: Tensor,
    num_loss_tokens: Union[int, float, Tensor],
    weight: Optional[Tensor] = None,
) -> Tensor:
    """``sum over loss tokens of weight · mean_d (prediction - target)^2 / num_loss_tokens``.

    ``prediction`` / ``target`` ``[1, s_local, C]`` (this rank's tokens of a packed sequence),
    ``loss_mask [1, s_local]`` (``packed_loss_mask``), ``weight`` (optional, ``[1, s_local]``:
    e.g. a per-clip EDM weight gathered per token), ``num_loss_tokens`` the GLOBAL count
    (``global_loss_tokens``). Accumulates in at least float32."""
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction shape {tuple(prediction.shape)} must equal target shape "
            f"{tuple(target.shape)}"
        )
    acc = torch.promote_types(prediction.dtype, torch.float32)
    per_element = (prediction.to(acc) - target.to(acc)) ** 2
    if weight is not None:
        if tuple(weight.shape) != tuple(loss_mask.shape):
            raise ValueError(
                f"weight shape {tuple(weight.shape)} must equal loss_mask shape "
                f"{tuple(loss_mask.shape)}"
            )
        per_element = per_element * weight.to(acc)[..., None]
    return reduce_token_loss(per_element, loss_mask, num_loss_tokens)


def packed_teacher_forcing_inputs(
    packed: PackedVideo,
    clean: Sequence[Tensor],
    noise: Sequence[Tensor],
    block_timesteps: Sequence[Tensor],
):
    """The full packed teacher-forcing sequence from per-clip latents: ``(x [1, S, C], t [1, S],
    target [1, S, C])`` with each clip ``[clean ; (1-t) clean + t noise]`` (``clean[c]`` /
    ``noise[c]`` ``[frames·h·w, C]`` frame-major, ``block_timesteps[c]`` ``[frames /
    frames_per_block]``), timestep 0 on the clean half, the velocity target ``noise - clean`` on
    the noisy half (zeros elsewhere), zero padding. Cut a CP rank's share with
    ``placement.shard(x, cp_rank)``."""
    if packed.kinds != ("teacher_forcing",):
        raise ValueError(f"packed.kinds ({packed.kinds}) must be ('teacher_forcing',)")
    xs, ts, targets = [], [], []
    for c, clip in enumerate(packed.clips):
        n, nb = clip.frame_tokens, clip.frames // clip.frames_per_block
        x0, eps, bt = clean[c], noise[c], block_timesteps[c]
        if tuple(x0.shape[:1]) != (n,) or eps.shape != x0.shape or tuple(bt.shape) != (nb,):
            raise ValueError(
                f"clip {c}: clean {tuple(x0.shape)} / noise {tuple(eps.shape)} must be "
                f"[{n}, C] and block_timesteps {tuple(bt.shape)} [{nb}]"
            )
        block = torch.arange(n, device=x0.device) // clip.positions // clip.frames_per_block
        t_tok = expand_block_timesteps(bt[None], block)[0]
        xs.append(torch.cat([x0, fm_interpolate(x0, eps, t_tok)]))
        ts.append(torch.cat([torch.zeros_like(t_tok), t_tok]).to(x0.dtype))
        targets.append(torch.cat([torch.zeros_like(x0), fm_target(x0, eps)]))
    return packed.pack(xs)[None], packed.pack(ts)[None], packed.pack(targets)[None]
