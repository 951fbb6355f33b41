"""Rewards of every GRPO: the registry (``resolve_reward``), the checks every reward's output
passes (``check_rewards``; the VLMs' ``mmsp.rl.score`` uses both) and the diffusion GRPO's
``score`` with two shipped rewards that need no download.

A reward is ``fn(latents, **sample) -> [G]``: ``latents [G, C, F, H, W]`` (the group's generated
latents, full, the same on every rank of the CP group) and keywords ``caption`` (str),
``clean [C, F, H, W]`` (the data sample's latents), ``position`` (its clip index) and, for the
families with a VAE (``video_dit``), ``videos [G, 3, T, H, W]`` (decoded, in ``[-1, 1]``); a
reward takes what it needs and ``**_`` for the rest. ``rl.reward`` is a ``module:function``
(``resolve_reward`` also takes a name of ``REWARDS``). Whatever it returns is checked (``check_rewards``): one
finite number per rollout, else a ``ValueError`` naming the function.
Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "REWARDS",
    "latent_colour",
    "dominant_colour",
    "caption_colour",
    "resolve_reward",
    "check_rewards",
    "score",
]


def latent_colour(latents: Tensor, clean: Tensor, **_) -> Tensor:
    """``-|mean_c(latents) - mean_c(clean)|^2``: how close each rollout's per-channel mean (its
    dominant colour in latent space, where a VAE keeps colour in the channel means) is to the
    captioned clip's. Works on precomputed latents (no decoder), so ``wan`` trains on shards."""
    if latents.dim() != 5 or clean.dim() != 4 or latents.shape[1:] != clean.shape:
        raise ValueError(
            f"latent_colour: latents ({tuple(latents.shape)}) must be [G, C, F, H, W] and clean "
            f"({tuple(clean.shape)}) [C, F, H, W] of the same sample shape"
        )
    gen = latents.double().mean(dim=(2, 3, 4))
    want = clean.double().mean(dim=(1, 2, 3))
    return -((gen - want[None]) ** 2).sum(dim=1)


def caption_colour(caption: str) -> Tensor:
    """RGB in [0, 1] of the first colour word of ``caption`` (the procedural clips' vocabulary,
    ``data.synthetic.COLORS``); ``ValueError`` if it names none."""
    from ..data.synthetic import COLORS

    for word in caption.lower().replace(",", " ").split():
        if word in COLORS:
            return torch.tensor(COLORS[word], dtype=torch.float64)
    raise ValueError(f"caption ({caption!r}) names no colour of {sorted(COLORS)}")


def dominant_colour(latents, caption: str, videos: Tensor = None, **_) -> Tensor:
    """``-|c(video) - c(caption)|``: the distance in RGB (``[0, 1]``) between each decoded video's
    dominant colour -- the mean colour of its pixels weighted by brightness, so the black
    background of the procedural clips counts for nothing -- and the caption's first colour.
    ``videos [G, 3, T, H, W]`` in ``[-1, 1]``: the decoded rollouts (families with a VAE)."""
    if videos is None:
        raise ValueError(
            "dominant_colour scores decoded videos: a family with a VAE (video_dit) passes them"
        )
    if videos.dim() != 5 or videos.shape[1] != 3:
        raise ValueError(f"dominant_colour: videos ({tuple(videos.shape)}) must be [G, 3, T, H, W]")
    rgb = ((videos.double() + 1.0) / 2.0).clamp(0.0, 1.0)
    weight = rgb.mean(dim=1, keepdim=True)
    colour = (rgb * weight).sum(dim=(2, 3, 4)) / weight.sum(dim=(2, 3, 4)).clamp_min(1e-12)
    return -(colour - caption_colour(caption)[None]).norm(dim=1)


REWARDS = {"latent_colour": latent_colour, "dominant_colour": dominant_colour}


def resolve_reward(spec: str) -> Callable:
    """A registered name or ``module:function`` -> the function (``ValueError`` naming
    ``rl.reward`` when neither)."""
    if spec in REWARDS:
        return REWARDS[spec]
    mod, sep, name = spec.partition(":")
    try:
        if not sep:
            raise ImportError(f"not a registered reward {sorted(REWARDS)}")
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"rl.reward ({spec!r}) must be one of {sorted(REWARDS)} or an importable "
            f"module:function ({e})"
        ) from e


def check_rewards(rewards, group_size: int, name: str) -> Tensor:
    """The reward's output as float64 ``[G]``, or ``ValueError`` naming the function (not
    numbers, the wrong shape, a NaN or an infinity)."""
    try:
        r = torch.as_tensor(rewards).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"rl.reward function {name} returned {type(rewards).__name__}, not numbers ({e})"
        ) from e
    if tuple(r.shape) != (group_size,):
        raise ValueError(
            f"rl.reward function {name} returned shape {tuple(r.shape)}; it must return one "
            f"reward per rollout ({group_size},)"
        )
    if not torch.isfinite(r).all():
        raise ValueError(f"rl.reward function {name} returned a non-finite reward ({r.tolist()})")
    return r


def score(spec: str, group_size: int, latents: Tensor, **sample) -> Tensor:
    """The checked rewards ``[G]`` of one group; any exception of the function becomes a
    ``ValueError`` naming it (the trainer's agree-then-raise path: every rank raises)."""
    fn = resolve_reward(spec)
    try:
        rewards = fn(latents, **sample)
    except Exception as e:
        raise ValueError(f"rl.reward function {spec} raised {type(e).__name__}: {e}") from e
    return check_rewards(rewards, group_size, spec)
