"""Flow-GRPO of the AR families (``wan_ar``; the model calls of ``generation.ar_models``, so
``ar_dit`` too): rollouts stream block by block through the KV-cache generator
(``generation.streaming.stream_autoregressive``, its ``transition`` the SDE step of
``rl.flow_grpo``), the loss re-runs each trained denoising step teacher-forced.

Rollout: block ``j``'s step ``i`` is the Gaussian transition of ``flow_grpo.sde_transition`` with
the velocity of the streaming model call (the noisy block against the cached clean keys / values
of the earlier blocks); its log-probability is the Gaussian log-density averaged over the block's
elements (``logprobs [G, J, N]``: one transition per block and step, as PPO's per-token ratio).
Noise: block ``j``'s initial noise and step ``i``'s draw of rollout ``k`` are whole draws keyed by
``(seed, position, k, "i.j")`` (``seeding.seeded_normal``), cut like the generator cuts the
block, so every CP layout samples the same video.

Loss: denoising step ``i`` of every block at once in ONE teacher-forced forward on the Balanced SP
layout (``ar_models.recompute_velocity``: ``[clean ; noisy]``, the clean half the rollout's
finished blocks at timestep 0, the noisy half every block's state at step ``i``), with gradients
through the context too. Memory: one forward per trained step, freed after its backward.
Conditioning: the forward sees exactly what the rollout's cache held. Noisy block ``j`` attends
the clean blocks the rule kept for it and itself; a clean block attends the clean blocks kept for
it and itself (its cached keys / values were computed so, when it was appended). With the window
covering the video that is the teacher-forcing mask; with a sink / window shorter than the video
(``rule``) it is ``diffusion.teacher_forcing.WindowedTeacherForcingMask`` of the same sink and
window, so the trained step's log-probability at the rollout's weights equals the rollout's.
Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional

import torch
from torch import Tensor

from ..diffusion.cfg import guided_denoise
from ..diffusion.teacher_forcing import WindowedTeacherForcingMask, local_frame_tokens
from ..generation.ar_models import block_model, recompute_velocity
from ..generation.streaming import WindowRule, padded_block_tokens, stream_autoregressive
from ..parallel import comm
from .flow_grpo import gaussian_logprob, group_mean, sde_transition
from .grpo import group_advantages
from .rules import check_rollout
from .seeding import seeded_normal

__all__ = ["ARRollout", "ar_rollout", "ar_grpo_backward", "ar_step_terms"]


@dataclasses.dataclass
class ARRollout:
    """A group's streamed rollout on this rank, in the Balanced SP ``layout``'s local order:
    ``states`` (``N + 1`` tensors ``[G, L/2, D]``: every block's noisy tokens at step ``i``),
    ``clean [G, L/2, D]`` (the finished blocks), ``logprobs [G, J, N]``, ``timesteps``, the full
    ``video [G, F*S, D]`` (every rank), the grid ``(height, width)``, ``cond`` / ``null`` /
    ``guidance_scale``, the CP ``group`` and the stream's ``rule`` (sink / window)."""

    states: List[Tensor]
    clean: Tensor
    logprobs: Tensor
    timesteps: List[float]
    video: Tensor
    layout: Any
    rank: int
    grid: tuple
    cond: Any
    null: Any
    guidance_scale: float
    group: Any
    rule: WindowRule

    @property
    def num_steps(self) -> int:
        return len(self.timesteps) - 1


def _cp(groups):
    return (1, 0, None) if groups is None else (groups.cp_size, groups.cp_rank, groups.cp_group)


def _check_rule(rule: WindowRule, nb: int) -> None:
    if rule.frames_per_block != nb:
        raise ValueError(
            f"rule.frames_per_block ({rule.frames_per_block}) must equal the layout's "
            f"frames_per_block ({nb})"
        )


def _recorder(G, n, D, T, mine, real, seeds, noise_level, group):
    """``(transition, states, logprobs)``: the SDE step for ``stream_autoregressive`` recording
    every block's local states and per-block log-probabilities."""
    states, lps = {}, {}
    seed, position = seeds

    def transition(x, v, i, j, ts):
        if i == 0:
            states[j], lps[j] = [x], []
        mean, std = sde_transition(x, v, ts[i], ts[i + 1], ts[1], noise_level)
        eps = _block_noise(G, n, D, T, seed, position, f"{i}.{j}")[:, mine]
        nxt = (mean + std * eps.to(mean)).to(x.dtype)
        lp = torch.where(real.to(x.device)[None, :, None], gaussian_logprob(nxt, mean, std), 0.0)
        lps[j].append(group_mean(lp, n * D, group))
        states[j].append(nxt)
        return nxt

    return transition, states, lps


def _block_noise(G, n, D, T, seed, position, key) -> Tensor:
    """The group's draw ``[G, T, D]`` of one block (``n`` real tokens, zero padding to ``T``)."""
    full = torch.stack([seeded_normal((n, D), seed, position, k, key) for k in range(G)])
    return torch.cat([full, full.new_zeros(G, T - n, D)], dim=1)


def _to_layout(parts: List[Tensor], n: int, layout, rank: int, group, N: int) -> Tensor:
    """Each block's local contiguous share -> this rank's Balanced SP tokens ``[G, L/2, D]``."""
    full = [p if N == 1 else comm.all_gather_cat(p, group, dim=1, tag="rl.ar") for p in parts]
    return local_frame_tokens(layout, rank, torch.cat([f[:, :n] for f in full], dim=1))


def ar_rollout(
    model,
    cond,
    layout,
    *,
    grid,
    groups=None,
    group_size: int,
    num_steps: int,
    noise_level: float,
    shift: float = 1.0,
    seed: int = 0,
    position=0,
    null_cond=None,
    guidance_scale: float = 1.0,
    rule: Optional[WindowRule] = None,
    dtype: torch.dtype = torch.float32,
) -> ARRollout:
    """``group_size`` streamed SDE rollouts of one condition (``cond``: the family's, batch 1,
    the same on every rank; collective over ``groups``) of ``layout``'s video (a
    ``BalancedSPLayout`` of the CP size), token ``grid = (height, width)``, ``D`` channels of
    the model's patch tokens; ``rule``: the stream's sink / window (None: all earlier frames; the
    loss then conditions as the cache did, module note). Checks ``group_size``, ``noise_level``,
    ``num_steps`` and the rule before any collective."""
    check_rollout(group_size, noise_level, num_steps)
    nb, S = layout.frames_per_block, layout.tokens_per_frame
    rule = rule or WindowRule(nb)
    _check_rule(rule, nb)
    G, D, (N, rank, group) = group_size, _channels(model), _cp(groups)
    n = nb * S
    T = padded_block_tokens(n, N)
    s = T // N
    mine = slice(rank * s, (rank + 1) * s)
    real = torch.arange(rank * s, (rank + 1) * s) < n
    transition, states, lps = _recorder(
        G, n, D, T, mine, real, (seed, position), noise_level, group
    )
    rows = [tuple(c.expand(G, *c.shape[1:]) for c in cond)]
    rows.append(None if null_cond is None else tuple(c.expand(G, *c.shape[1:]) for c in null_cond))
    device = next(model.parameters()).device
    blocks = stream_autoregressive(
        block_model(model, grid[0], grid[1], nb, rank, N),
        lambda j: _block_noise(G, n, D, n, seed, position, f"-1.{j}").to(device, dtype),
        layout.num_blocks,
        nb,
        S,
        rows[0],
        groups=groups,
        null_cond=rows[1],
        guidance_scale=guidance_scale,
        num_steps=num_steps,
        shift=shift,
        rule=rule,
        transition=transition,
    )
    with torch.no_grad():
        video = torch.cat([b for _, b, _ in blocks], dim=1)
    J = layout.num_blocks
    out = [
        _to_layout([states[j][i] for j in range(J)], n, layout, rank, group, N)
        for i in range(num_steps + 1)
    ]
    logprobs = torch.stack([torch.stack(lps[j], dim=1) for j in range(J)], dim=1)
    ts = list(_timesteps(num_steps, shift))
    clean = local_frame_tokens(layout, rank, video)
    return ARRollout(
        out,
        clean,
        logprobs,
        ts,
        video,
        layout,
        rank,
        tuple(grid),
        rows[0],
        rows[1],
        guidance_scale,
        group,
        rule,
    )


def _timesteps(num_steps: int, shift: float):
    from ..diffusion.samplers import flow_timesteps

    return [float(v) for v in flow_timesteps(num_steps, shift)]


def _channels(model) -> int:
    """The model's patch-token channels (``in_channels`` times the patch volume)."""
    from ..generation.ar_models import _unwrap

    cfg = _unwrap(model).config
    return cfg.in_channels * math.prod(cfg.patch_size)


def _mask(ro: ARRollout):
    """The rollout's conditioning (module note): None (the teacher-forcing mask) when the window
    covers the video, else the windowed teacher-forcing mask of the rule."""
    rule, L = ro.rule, ro.layout
    if rule.window is None or rule.window >= L.num_latent_frames - L.frames_per_block:
        return None
    return WindowedTeacherForcingMask(L, rule.sink, rule.window)


def _velocity(model, ro: ARRollout):
    """The teacher-forced velocity of the noisy half (CFG as in the rollout)."""
    v = recompute_velocity(model, ro.layout, ro.rank, ro.grid[0], ro.grid[1], _mask(ro))
    if ro.null is None or ro.guidance_scale == 1.0:
        return v
    return lambda x, t, c: guided_denoise(v, x, t, c, ro.null, ro.guidance_scale)


def _block_mean(per_element: Tensor, ro: ARRollout) -> Tensor:
    """``[G, L/2, D]`` -> ``[G, J]``: each block's element mean, summed over the CP group."""
    L = ro.layout
    blocks = (L.rope_frame_positions(ro.rank)[L.local_len // 2 :] // L.frames_per_block).to(
        per_element.device
    )
    G, J = per_element.shape[0], L.num_blocks
    local = per_element.new_zeros(G, J).index_add(1, blocks, per_element.sum(dim=2))
    n = L.frames_per_block * L.tokens_per_frame * per_element.shape[2]
    return group_mean(local.reshape(G * J, 1), n, ro.group).reshape(G, J)


def _step_mean(velocity, ro: ARRollout, i: int, noise_level: float):
    """(transition means ``[G, L/2, D]``, std) of step ``i`` of every block, teacher-forced."""
    x, ts = ro.states[i], ro.timesteps
    half = x.shape[1]
    t = torch.cat([torch.zeros_like(x[..., 0]), torch.full_like(x[..., 0], ts[i])], dim=1)
    v = velocity(torch.cat([ro.clean.to(x), x], dim=1), t, ro.cond)[:, half:]
    return sde_transition(x, v, ts[i], ts[i + 1], ts[1], noise_level)


def ar_step_terms(
    policy,
    reference,
    ro: ARRollout,
    i: int,
    adv: Tensor,
    *,
    noise_level: float,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
) -> dict:
    """Step ``i`` of every block re-run with gradients through ``policy``: ``loss [G, J]`` (the
    clipped PPO term of ``ratio = exp(lp - lp_old)`` plus ``kl_coef`` times Flow-GRPO's
    closed-form KL to ``reference``), ``ratio``, ``kl`` and ``clipped`` (all ``[G, J]``)."""
    mean, std = _step_mean(_velocity(policy, ro), ro, i, noise_level)
    lp = _block_mean(gaussian_logprob(ro.states[i + 1], mean, std), ro)
    ratio = torch.exp(lp - ro.logprobs[:, :, i].to(lp))
    a = adv.to(lp)[:, None]
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    clipped = ((ratio < 1.0 - clip_low) & (a < 0)) | ((ratio > 1.0 + clip_high) & (a > 0))
    kl = torch.zeros_like(lp)
    if kl_coef > 0 and reference is not None:
        with torch.no_grad():
            ref_mean, _ = _step_mean(_velocity(reference, ro), ro, i, noise_level)
        kl = _block_mean((mean - ref_mean) ** 2, ro) / (2.0 * std * std)
    return dict(loss=pg + kl_coef * kl, ratio=ratio.detach(), kl=kl.detach(), clipped=clipped)


def ar_grpo_backward(
    policy,
    reference,
    ro: ARRollout,
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
    """Back-propagate one group's loss (the mean over rollouts, blocks and trained ``steps``)
    times ``scale``, one teacher-forced forward per trained step, freed after its backward.
    Returns the loss and the means of kl, ratio and clipped (the same on every CP rank)."""
    adv = group_advantages(rewards, eps, normalise)
    n = len(steps) * adv.numel() * ro.layout.num_blocks
    stats = dict(loss=0.0, kl=0.0, ratio=0.0, clip_frac=0.0)
    for i in steps:
        terms = ar_step_terms(
            policy,
            reference,
            ro,
            i,
            adv,
            noise_level=noise_level,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_coef=kl_coef,
        )
        loss = terms["loss"].sum() / n
        (loss * scale).backward()
        stats["loss"] += float(loss.detach())
        stats["kl"] += float(terms["kl"].sum()) / n
        stats["ratio"] += float(terms["ratio"].sum()) / n
        stats["clip_frac"] += float(terms["clipped"].double().sum()) / n
    return stats
