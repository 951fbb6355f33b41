"""Flow-GRPO of Wan (``rl.flow_grpo``) on the model call of our CP sampler
(``generation.wan_sampling``): the same velocity (``wan_velocity``), the same contiguous token cut
per CP rank, so rollouts and the policy update run under any Ulysses x ring layout of the model.

Seeding: the initial noise and every step's noise of rollout ``k`` of the sample at stream
position ``position`` are drawn whole from a generator seeded by ``(seed, position, k, step)``
and cut to this rank's tokens: every layout (and a resumed run) samples the same videos, with no
RNG state to checkpoint. Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ..diffusion.cfg import guided_denoise
from ..diffusion.samplers import flow_timesteps
from ..generation import cp_sampling as cps
from ..generation.wan_sampling import wan_velocity
from ..models.embedders import patchify, unpatchify
from ..models.wan.interop import _check_inputs, _cp_group
from .flow_grpo import FlowRollout, flow_sde_rollout, grpo_backward
from .seeding import seeded_normal

__all__ = ["WanRollout", "wan_rollout", "wan_videos", "wan_grpo_backward"]


@dataclasses.dataclass
class WanRollout:
    """A group's rollout on this rank: the SDE ``ro`` (local tokens), the model's ``geometry``, the
    rank's global token ids ``local_ids`` and the condition ``cond`` (``(text,)``) with its
    ``null`` and ``guidance_scale`` (CFG in rollouts and in the re-run steps alike)."""

    ro: FlowRollout
    geometry: object
    local_ids: Tensor
    cond: tuple
    null: Optional[tuple]
    guidance_scale: float


def _velocity(model, geometry, null, guidance_scale: float):
    v = wan_velocity(model, geometry)
    if null is None or guidance_scale == 1.0:
        return v
    return lambda x, t, cond: guided_denoise(v, x, t, cond, null, guidance_scale)


def _draw(model, shape, seeds, step, local_ids, dtype) -> Tensor:
    """This rank's tokens of the group's global draw for ``step`` (``[G, s, D]``)."""
    seed, position, G = seeds
    full = torch.stack([seeded_normal(shape, seed, position, k, step) for k in range(G)])
    tokens = patchify(full.to(dtype), model.config.patch_size)
    return cps.partition_tokens(tokens, local_ids)


def wan_rollout(
    model,
    text: Tensor,
    latent_shape: Sequence[int],
    *,
    group_size: int,
    num_steps: int,
    noise_level: float,
    shift: float = 1.0,
    seed: int = 0,
    position=0,
    null_text: Optional[Tensor] = None,
    guidance_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> WanRollout:
    """``group_size`` SDE rollouts of one prompt (``text [1, L, text_dim]``, the same on every
    rank; collective) of latents ``latent_shape = (C, F, H, W)`` on ``model`` (PP = 1) under its
    CP layout, ``num_steps`` steps of the shifted flow schedule. ``position``: the sample's key
    in the seeds (an int or a string; the trainer's is ``"step:clip index"``)."""
    G = group_size
    device = text.device
    probe = torch.zeros((G,) + tuple(latent_shape), dtype=dtype, device=device)
    texts = text.expand(G, -1, -1).to(dtype)
    zero_t = torch.zeros(G, dtype=dtype, device=device)
    geometry = _check_inputs(model, probe, zero_t, texts, None)
    P, rank = model.cp()
    s = geometry.tokens // P
    local_ids = torch.arange(rank * s, (rank + 1) * s)
    null = None if null_text is None else (null_text.to(dtype),)
    velocity = _velocity(model, geometry, null, guidance_scale)
    seeds = (seed, position, G)
    x = _draw(model, latent_shape, seeds, -1, local_ids, dtype).to(device)
    numel = geometry.tokens * x.shape[-1]
    ro = flow_sde_rollout(
        velocity,
        x,
        (texts,),
        timesteps=[float(v) for v in flow_timesteps(num_steps, shift)],
        noise_level=noise_level,
        step_noise=lambda i: _draw(model, latent_shape, seeds, i, local_ids, dtype).to(device),
        numel=numel,
        group=_cp_group(model),
    )
    return WanRollout(ro, geometry, local_ids, (texts,), null, guidance_scale)


def wan_videos(model, wr: WanRollout) -> Tensor:
    """The rollout's final latents ``[G, C, F, H, W]``, gathered on every rank of the CP group."""
    g = wr.geometry
    full = cps.gather_tokens(wr.ro.states[-1], wr.local_ids, _cp_group(model), g.tokens)
    cfg = model.config
    return unpatchify(full, cfg.patch_size, (g.frames, g.height, g.width), cfg.in_channels)


def wan_grpo_backward(
    policy,
    reference,
    wr: WanRollout,
    rewards: Tensor,
    steps: List[int],
    *,
    noise_level: float,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    eps: float = 1e-6,
    scale: float = 1.0,
    normalise: bool = True,
) -> dict:
    """``flow_grpo.grpo_backward`` of the group's rollout ``wr`` with ``policy`` (and the frozen
    ``reference`` for the KL) as the velocity, CFG as in the rollout."""
    pol = _velocity(policy, wr.geometry, wr.null, wr.guidance_scale)
    ref = None
    if reference is not None:
        ref = _velocity(reference, wr.geometry, wr.null, wr.guidance_scale)
    return grpo_backward(
        pol,
        ref,
        wr.ro,
        wr.cond,
        rewards,
        steps,
        group=_cp_group(policy),
        eps=eps,
        scale=scale,
        normalise=normalise,
        noise_level=noise_level,
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=kl_coef,
    )
