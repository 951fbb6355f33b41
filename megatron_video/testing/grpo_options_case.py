"""Fixed GRPO rollouts and Long-RL's loss formula of tests/test_grpo_loss_options.py, shared with
tests/test_grpo_qwen_vl.py."""

from __future__ import annotations

import math

import torch

G, L, T = 4, 3, 0.7


LENGTHS = [[3, 1, 2, 3], [2, 1, 1, 3]]  # micro-batch 0: 9 tokens, micro-batch 1: 7


REWARDS = [[1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 1.0, 0.3]]


OPTIONS = {
    "ours": dict(),
    "ours_micro": dict(loss_agg="micro_token_mean"),
    "long_rl": dict(clip_high=0.3, dual_clip=3.0, kl_clamp=10.0, loss_agg="micro_token_mean"),
    "long_rl_global": dict(clip_high=0.3, dual_clip=1.5, kl_clamp=2.0),
}


def _rollouts():
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(1, 64, (G, L), generator=g) for _ in LENGTHS]
    for t, n in zip(tokens, LENGTHS):
        for i, k in enumerate(n):
            t[i, k:] = 0
    offsets = [1.2 * (2 * torch.rand(G, L, generator=g, dtype=torch.float64) - 1) for _ in LENGTHS]
    return tokens, offsets


def oracle_loss(lp, old, ref, rewards, opt, *, clip=True, dual=True, clamp=True):
    """Long-RL's loss, float64, per micro-batch ``[G, L]`` lists (0 past each response's end)."""
    low = 0.2
    high = opt.get("clip_high", low)
    terms, masks = [], []
    for lp_m, old_m, ref_m, r, n in zip(lp, old, ref, rewards, LENGTHS):
        r = torch.tensor(r, dtype=torch.float64)
        adv = ((r - r.mean()) / (r.std() + 1e-6))[:, None]  # compute_grpo_outcome_advantage
        d = torch.clamp(lp_m - old_m, -20.0, 20.0)
        ratio = torch.exp(d)
        clipped = (
            torch.exp(torch.clamp(d, math.log(1 - low), math.log(1 + high))) if clip else ratio
        )
        pg_loss, pg_loss2 = -adv * ratio, -adv * clipped
        higher = torch.max(pg_loss, pg_loss2)
        final = higher
        if opt.get("dual_clip") and dual:
            lower = torch.min(higher, -adv * opt["dual_clip"])
            final = torch.where(adv < 0, lower, higher)
        kl = torch.clamp(ref_m - lp_m, -20.0, 20.0)
        kld = kl.exp() - kl - 1
        if opt.get("kl_clamp") and clamp:
            kld = torch.clamp(kld, -opt["kl_clamp"], opt["kl_clamp"])
        terms.append(final + 0.04 * kld)
        masks.append((torch.arange(L)[None] < torch.tensor(n)[:, None]).double())
    if opt.get("loss_agg") == "micro_token_mean":  # each micro-batch's token mean / grad. accum.
        return sum((t * m).sum() / m.sum() for t, m in zip(terms, masks)) / len(terms)
    return sum((t * m).sum() for t, m in zip(terms, masks)) / sum(m.sum() for m in masks)
