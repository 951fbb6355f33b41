"""Flow-GRPO for flow-matching video models under context parallelism: the SDE sampler step with
its Gaussian transition, the log-probability of a sampled transition, rollouts on a CP shard, the
trained-step selection and the clipped GRPO loss with the closed-form KL to the frozen reference.

The step is Flow-GRPO's ``sde_step_with_logprob`` (``sde_type='sde'``;
github.com/yifan123/flow_grpo, ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``), in our
time convention (``t = 1`` noise, ``t = 0`` data, the model's velocity ``noise - x0``, which is
Flow-GRPO's ``sigma`` and ``model_output``): with ``dt = t_next - t < 0`` and noise level ``a``,

    std_dev_t = a * sqrt(t / (1 - t'))          t' = t, except t' = ts[1] where t == 1
    mean      = x * (1 + std_dev_t^2 / (2 t) * dt) + v * (1 + std_dev_t^2 (1 - t) / (2 t)) * dt
    x_next    = mean + std_dev_t * sqrt(-dt) * eps,        eps ~ N(0, I)

and the log-probability of ``x_next`` is the Gaussian log-density with that mean and standard
deviation ``std_dev_t * sqrt(-dt)``, averaged over every element of the sample (Flow-GRPO's
``mean`` over all but the batch dimension). Under CP a rank holds a slice of the tokens: between
model calls everything is elementwise, the average is a sum over the CP group (``group_mean``:
all-reduce forward, identity backward, so with the same loss on every rank the ranks' parameter
gradients sum to the single-process gradient, as Megatron's gradient reduction does).

Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor

from ..parallel import comm
from .grpo import group_advantages

__all__ = [
    "sde_std",
    "sde_transition",
    "gaussian_logprob",
    "group_mean",
    "FlowRollout",
    "flow_sde_rollout",
    "select_steps",
    "GRPOTerms",
    "flow_grpo_step_loss",
    "grpo_backward",
    "TRAIN_STEPS",
]

TRAIN_STEPS = ("all", "random", "window")
Velocity = Callable[[Tensor, Tensor, Any], Tensor]


def _acc(x: Tensor) -> torch.dtype:
    """Flow-GRPO computes the step in fp32 (bf16 overflows in the mean); float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def sde_std(t: float, t_after_one: float, noise_level: float) -> float:
    """Flow-GRPO's ``std_dev_t = noise_level * sqrt(t / (1 - t))`` (the diffusion coefficient of
    the SDE); at ``t = 1`` the denominator uses ``t_after_one`` (the schedule's second time, their
    ``sigma_max = sigmas[1]``), which keeps it finite."""
    if not noise_level > 0:
        raise ValueError(f"rl.noise_level ({noise_level}) must be > 0")
    denom = 1.0 - (t_after_one if t == 1.0 else t)
    return noise_level * math.sqrt(t / denom)


def sde_transition(
    x: Tensor, v: Tensor, t: float, t_next: float, t_after_one: float, noise_level: float
):
    """``(mean, std)`` of the Gaussian transition ``x_t -> x_{t_next}`` given the velocity ``v``
    (``std`` a float: the per-element standard deviation ``std_dev_t * sqrt(-dt)``)."""
    if not t > t_next >= 0:
        raise ValueError(f"the step must go from t ({t}) down to t_next ({t_next}) >= 0")
    dt = t_next - t
    s = sde_std(t, t_after_one, noise_level)
    acc = _acc(x)
    x, v = x.to(acc), v.to(acc)
    mean = x * (1.0 + s * s / (2.0 * t) * dt) + v * (1.0 + s * s * (1.0 - t) / (2.0 * t)) * dt
    return mean, s * math.sqrt(-dt)


def gaussian_logprob(sample: Tensor, mean: Tensor, std: float) -> Tensor:
    """Elementwise ``log N(sample; mean, std^2)`` (``sample`` detached: the rollout's draw)."""
    d = sample.detach().to(mean.dtype) - mean
    return -(d * d) / (2.0 * std * std) - math.log(std) - 0.5 * math.log(2.0 * math.pi)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward: each rank's share of a replicated loss."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group, tag="rl.group_mean")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def group_mean(per_element: Tensor, numel: int, group) -> Tensor:
    """``[b, ...]`` local elements -> ``[b]``: the mean over every element of each sample, the
    elements spread over ``group`` (``numel`` per sample in all). Differentiable (see module)."""
    local = per_element.reshape(per_element.shape[0], -1).sum(dim=1)
    if group is not None and comm.group_size(group) > 1:
        local = _SumOverGroup.apply(local, group)
    return local / numel


@dataclasses.dataclass
class FlowRollout:
    """One SDE rollout on this rank's shard: ``states`` (``N + 1`` tensors ``[b, s, D]``, from the
    initial noise to the sample, detached), ``logprobs [b, N]`` of each transition under the
    rollout policy, ``timesteps`` (``N + 1`` floats, 1 -> 0) and ``numel`` (elements per sample
    over all ranks)."""

    states: List[Tensor]
    logprobs: Tensor
    timesteps: List[float]
    numel: int

    @property
    def num_steps(self) -> int:
        return len(self.timesteps) - 1


def flow_sde_rollout(
    velocity: Velocity,
    x: Tensor,
    cond: Any,
    *,
    timesteps: Sequence[float],
    noise_level: float,
    step_noise: Callable[[int], Tensor],
    numel: int,
    group=None,
) -> FlowRollout:
    """Sample the SDE from ``x`` (this rank's shard of the initial noise, ``[b, s, D]``) along
    ``timesteps`` (1 -> 0): ``step_noise(i)`` is this rank's shard of step ``i``'s standard normal
    draw (a global draw cut like ``x``, so every layout samples the same video). No gradients."""
    ts = [float(v) for v in timesteps]
    if len(ts) < 2 or ts[0] != 1.0 or any(b >= a for a, b in zip(ts, ts[1:])) or ts[-1] < 0:
        raise ValueError(f"timesteps ({ts}) must decrease from 1 to >= 0 (>= 2 entries)")
    states, lps = [x.detach()], []
    with torch.no_grad():
        for i in range(len(ts) - 1):
            tt = torch.full((x.shape[0],), ts[i], dtype=_acc(x), device=x.device)
            v = velocity(x, tt, cond)
            mean, std = sde_transition(x, v, ts[i], ts[i + 1], ts[1], noise_level)
            nxt = (mean + std * step_noise(i).to(mean)).to(x.dtype)
            lps.append(group_mean(gaussian_logprob(nxt, mean, std), numel, group))
            states.append(nxt)
            x = nxt
    return FlowRollout(states, torch.stack(lps, dim=1), ts, numel)


def select_steps(
    num_steps: int, mode: str, count: int, train_step: int = 0, seed: int = 0
) -> List[int]:
    """The denoising steps trained this optimiser step: ``all``; ``random`` (``count`` of them,
    drawn from ``(seed, train_step)``, DanceGRPO); ``window`` (``count`` consecutive steps, the
    window sliding by one each optimiser step and wrapping, MixGRPO). The same on every rank."""
    if mode not in TRAIN_STEPS:
        raise ValueError(f"rl.train_steps ({mode!r}) must be one of {TRAIN_STEPS}")
    if mode == "all":
        return list(range(num_steps))
    if not 1 <= count <= num_steps:
        raise ValueError(f"rl.train_step_count ({count}) must be in [1, num_steps = {num_steps}]")
    if mode == "random":
        return sorted(random.Random(f"{seed}:{train_step}").sample(range(num_steps), count))
    start = train_step % (num_steps - count + 1)
    return list(range(start, start + count))


@dataclasses.dataclass
class GRPOTerms:
    """Per-sample terms of one trained step: ``loss [b]`` (clipped policy term + ``kl_coef *
    kl``), ``ratio [b]``, ``kl [b]`` and ``clipped [b]`` (bool: the clip is active)."""

    loss: Tensor
    ratio: Tensor
    kl: Tensor
    clipped: Tensor


def flow_grpo_step_loss(
    velocity: Velocity,
    ref_velocity: Optional[Velocity],
    ro: FlowRollout,
    j: int,
    adv: Tensor,
    cond: Any,
    *,
    noise_level: float,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    group=None,
) -> GRPOTerms:
    """Step ``j`` of rollout ``ro`` re-run with gradients through ``velocity`` (the policy):
    ``ratio = exp(lp - lp_old)``, the PPO term ``max(-A ratio, -A clip(ratio, 1 - clip_low, 1 +
    clip_high))``, and Flow-GRPO's KL to the reference, closed form for two Gaussians of the
    same standard deviation: ``mean_elements((mean - mean_ref)^2) / (2 std^2)``."""
    x, nxt = ro.states[j], ro.states[j + 1]
    t, t_next = ro.timesteps[j], ro.timesteps[j + 1]
    tt = torch.full((x.shape[0],), t, dtype=_acc(x), device=x.device)
    mean, std = sde_transition(x, velocity(x, tt, cond), t, t_next, ro.timesteps[1], noise_level)
    lp = group_mean(gaussian_logprob(nxt, mean, std), ro.numel, group)
    ratio = torch.exp(lp - ro.logprobs[:, j].to(lp))
    adv = adv.to(lp)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    kl = torch.zeros_like(lp)
    if kl_coef > 0 and ref_velocity is not None:
        with torch.no_grad():
            v_ref = ref_velocity(x, tt, cond)
            ref_mean, _ = sde_transition(x, v_ref, t, t_next, ro.timesteps[1], noise_level)
        diff = mean - ref_mean
        kl = group_mean(diff * diff, ro.numel, group) / (2.0 * std * std)
    return GRPOTerms(pg + kl_coef * kl, ratio.detach(), kl.detach(), clipped)


def grpo_backward(
    velocity: Velocity,
    ref_velocity: Optional[Velocity],
    ro: FlowRollout,
    cond: Any,
    rewards: Tensor,
    steps: List[int],
    *,
    group=None,
    eps: float = 1e-6,
    scale: float = 1.0,
    normalise: bool = True,
    **clip_kl,
) -> dict:
    """Back-propagate one group's GRPO loss (the mean over rollouts and trained ``steps``) times
    ``scale``, one trained step at a time: each step's forward is re-run with gradients and freed
    after its backward (the memory of one model call, not of the rollout). ``clip_kl``:
    ``noise_level``, ``clip_low``, ``clip_high``, ``kl_coef`` of ``flow_grpo_step_loss``. Returns
    the loss and the means of kl, ratio and clipped (floats, the same on every CP rank)."""
    adv = group_advantages(rewards, eps, normalise)
    n = len(steps) * adv.numel()
    stats = dict(loss=0.0, kl=0.0, ratio=0.0, clip_frac=0.0)
    for j in steps:
        terms = flow_grpo_step_loss(
            velocity, ref_velocity, ro, j, adv, cond, group=group, **clip_kl
        )
        loss = terms.loss.sum() / n
        (loss * scale).backward()
        stats["loss"] += float(loss.detach())
        stats["kl"] += float(terms.kl.sum()) / n
        stats["ratio"] += float(terms.ratio.sum()) / n
        stats["clip_frac"] += float(terms.clipped.double().sum()) / n
    return stats
