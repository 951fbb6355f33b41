"""The parts of GRPO every model shares: group-normalised advantages (``group_advantages``, the
VLM's GRPO and Flow-GRPO), the per-token clipped ratio loss with the k3 KL estimator to the
reference (``grpo_token_terms``, the VLM's; Flow-GRPO's per-step loss with the closed-form
Gaussian KL is ``flow_grpo.flow_grpo_step_loss``), the log-probs' temperature and the token
normalisers of the loss. Torch only; the options are ``rl.config.RLConfig``.
Maps: docs/mmsp.md ("GRPO"), docs/wan.md ("Reinforcement learning (Flow-GRPO)").
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .config import RLConfig

__all__ = ["group_advantages", "grpo_token_terms", "logprob_temperature", "token_normalisers"]


def group_advantages(rewards: Tensor, eps: float = 1e-6, normalise: bool = True) -> Tensor:
    """``(r - mean_G) / (std_G + eps)`` of one group's rewards ``[G]``, ``std`` the unbiased
    sample standard deviation; ``normalise=False``: ``r - mean_G``. ``ValueError`` for fewer than
    2 rewards (a group of one has no standard deviation)."""
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards ({tuple(rewards.shape)}) must be [G]")
    if rewards.numel() < 2:
        raise ValueError(
            f"group_advantages: the group size ({rewards.numel()}) must be >= 2 (rl.group_size: "
            f"the standard deviation of one reward is undefined)"
        )
    r = rewards.double()
    centred = r - r.mean()
    return centred / (r.std() + eps) if normalise else centred


def logprob_temperature(cfg: RLConfig) -> float:
    """The temperature of every log-prob of the objective: the rollout's (Long-RL divides the
    logits by it too), 1 for greedy rollouts (temperature 0)."""
    return float(cfg.temperature) if cfg.temperature > 0 else 1.0


def grpo_token_terms(lp, old_lp, ref_lp, adv, cfg: RLConfig):
    """Per-token loss ``pg + kl_coef * k3`` and ``(loss, k3, clipped)`` (clipped: the tokens whose
    gradient the clip or the dual clip removed). With ``d = clamp(lp - old, +-20)``, ratio
    ``exp(d)``, the clipped ratio ``exp(clamp(d, log(1 - clip), log(1 + clip_high)))``:
    ``pg = max(-A ratio, -A clipped)``; with ``dual_clip`` and ``A < 0`` also ``min(pg,
    -A dual_clip)``; ``k3 = exp(e) - e - 1`` with ``e = clamp(ref - lp, +-20)``, clamped to
    ``+-kl_clamp`` when set. The rules of Long-RL's ``compute_policy_loss`` / ``compute_kl
    ("low_var_kl")`` (verl/trainer/core_algos.py); with the defaults it is the symmetric PPO clip
    and the plain k3 (the +-20 clamps only keep ``exp`` finite)."""
    high = cfg.clip if cfg.clip_high is None else cfg.clip_high
    d = torch.clamp(lp - old_lp, -20.0, 20.0)
    ratio = torch.exp(d)
    clipped_ratio = torch.exp(torch.clamp(d, math.log(1 - cfg.clip), math.log1p(high)))
    pg1, pg2 = -adv * ratio, -adv * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    clipped = pg1 < pg2
    if cfg.dual_clip is not None and adv < 0:
        pg3 = -adv * cfg.dual_clip
        clipped = clipped | (pg > pg3)
        pg = torch.minimum(pg, pg3 * torch.ones_like(pg))
    e = torch.clamp(ref_lp - lp, -20.0, 20.0)
    k3 = torch.exp(e) - e - 1
    if cfg.kl_clamp is not None:
        k3 = torch.clamp(k3, -cfg.kl_clamp, cfg.kl_clamp)
    return pg + cfg.kl_coef * k3, k3, clipped


def token_normalisers(cfg: RLConfig, micro_tokens: Sequence[int], global_tokens: int, dp: int):
    """The divisor of each micro-batch's token sum (this DP rank's micro-batches of one
    mini-batch, ``micro_tokens`` response tokens each): ``global_token_mean`` (ours) divides by
    ``global_tokens``, the response tokens of the mini-batch over all DP ranks;
    ``micro_token_mean`` (Long-RL's ``loss_avg_mode: token``) takes each micro-batch's token mean,
    averaged over the micro-batches and the DP ranks (``mean / n_micro``, DDP's DP average)."""
    if cfg.loss_agg == "global_token_mean":
        return [float(global_tokens)] * len(micro_tokens)
    return [float(t) * len(micro_tokens) * dp for t in micro_tokens]
