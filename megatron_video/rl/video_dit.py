"""Flow-GRPO of the project's DiT (``video_dit`` with ``diffusion.objective: flow``) on the model
call of the CP sampler (``generation.generator``'s ``t2v_tokens``: ``model(x, t, caption_ids,
caption_mask, geometry, drop)`` on this rank's tokens). The noise is drawn in token space
(``[N, patch_dim]`` per rollout, keyed like ``rl.wan``) and cut to the rank's ``local_ids``; the
null condition of CFG is the model's own (``drop``). Map: docs/wan.md, "Reinforcement learning
(Flow-GRPO)".
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from torch import Tensor

from ..diffusion.cfg import guided_denoise
from ..diffusion.samplers import flow_timesteps
from ..generation import cp_sampling as cps
from .flow_grpo import FlowRollout, flow_sde_rollout, grpo_backward
from .seeding import seeded_normal

__all__ = ["DiTRollout", "dit_rollout", "dit_tokens", "dit_grpo_backward"]


@dataclasses.dataclass
class DiTRollout:
    """A group's rollout on this rank: the SDE ``ro`` (local tokens), ``geometry``, ``local_ids``,
    the CP ``group``, ``cond`` ``(ids, mask, drop)`` and CFG's ``guidance_scale``."""

    ro: FlowRollout
    geometry: object
    local_ids: Tensor
    group: object
    cond: tuple
    guidance_scale: float


def _velocity(model, geometry, cond, guidance_scale: float):
    def v(x, t, c):
        return model(x, t, c[0], c[1], geometry, drop=c[2])

    if guidance_scale == 1.0:
        return v
    null = (cond[0][:1], cond[1][:1], torch.ones(1, dtype=torch.bool, device=cond[0].device))
    return lambda x, t, c: guided_denoise(v, x, t, c, null, guidance_scale)


def dit_rollout(
    model,
    caption_ids: Tensor,
    caption_mask: Tensor,
    geometry,
    local_ids: Tensor,
    group,
    *,
    group_size: int,
    num_steps: int,
    noise_level: float,
    shift: float = 1.0,
    seed: int = 0,
    position=0,
    guidance_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> DiTRollout:
    """``group_size`` SDE rollouts of one caption (``caption_ids / caption_mask [1, L]``, the same
    on every rank; collective) over ``geometry``'s tokens, this rank holding ``local_ids``."""
    G, device = group_size, caption_ids.device
    dim = model.config.patch_dim
    N = geometry.tokens
    cond = (
        caption_ids.expand(G, -1),
        caption_mask.expand(G, -1),
        torch.zeros(G, dtype=torch.bool, device=device),
    )
    ids = local_ids.to(device)

    def draw(step: int) -> Tensor:
        full = torch.stack([seeded_normal((N, dim), seed, position, k, step) for k in range(G)])
        return cps.partition_tokens(full.to(device, dtype), ids)

    ro = flow_sde_rollout(
        _velocity(model, geometry, cond, guidance_scale),
        draw(-1),
        cond,
        timesteps=[float(v) for v in flow_timesteps(num_steps, shift)],
        noise_level=noise_level,
        step_noise=draw,
        numel=N * dim,
        group=group,
    )
    return DiTRollout(ro, geometry, local_ids, group, cond, guidance_scale)


def dit_tokens(dr: DiTRollout) -> Tensor:
    """The rollout's final tokens ``[G, N, patch_dim]``, gathered on every rank of the group."""
    return cps.gather_tokens(dr.ro.states[-1], dr.local_ids, dr.group, dr.geometry.tokens)


def dit_grpo_backward(
    policy, reference: Optional[object], dr: DiTRollout, rewards: Tensor, steps: List[int], **kw
) -> dict:
    """``flow_grpo.grpo_backward`` of ``dr`` with ``policy`` (and the frozen ``reference``) as the
    velocity; ``kw``: ``noise_level``, ``clip_low``, ``clip_high``, ``kl_coef``, ``eps``,
    ``scale``, ``normalise``."""
    pol = _velocity(policy, dr.geometry, dr.cond, dr.guidance_scale)
    ref = (
        None if reference is None else _velocity(reference, dr.geometry, dr.cond, dr.guidance_scale)
    )
    return grpo_backward(pol, ref, dr.ro, dr.cond, rewards, steps, group=dr.group, **kw)
