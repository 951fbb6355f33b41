"""Rollout seeding of every GRPO: a rollout's random draws come from a generator keyed by the
run's seed, the sample's position in the stream and the rollout (and, for the diffusion
rollouts, the denoising step), so any parallel layout and a resumed run draw the same numbers
and there is no RNG state to checkpoint. Maps: docs/mmsp.md ("GRPO"), docs/wan.md
("Reinforcement learning (Flow-GRPO)").
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["rollout_generator", "seeded_normal"]


def rollout_generator(seed: int, position, k: int) -> torch.Generator:
    """The CPU generator of rollout ``k`` of the sample at ``position`` (the VLM's response
    ``k`` samples its tokens from it)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{position}/{k}".encode()))


def seeded_normal(shape: Sequence[int], seed: int, position, k: int, step: int) -> Tensor:
    """A float64 standard normal ``shape`` from the generator keyed by ``(seed, position, k,
    step)``: rollout ``k`` of the sample ``position``, denoising ``step`` (-1: the initial noise)."""
    key = zlib.crc32(f"flow_grpo:{seed}:{position}:{k}:{step}".encode())
    gen = torch.Generator().manual_seed(key)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)
