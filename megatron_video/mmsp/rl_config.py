"""The ``rl:`` section of the training config (GRPO, ``train.objective: grpo``): plain values,
validated where declared; no torch, so the config and the command line stay light. Used by
``mmsp.rl`` and ``training.grpo``."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["RLConfig"]


@dataclasses.dataclass
class RLConfig:
    """The ``rl:`` options (validated here)."""

    group_size: int = 4
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    clip: float = 0.2
    kl_coef: float = 0.04
    eps: float = 1e-6
    seed: int = 0
    train_encoder: bool = False
    reward: str = "megatron_video.mmsp.rl:exact_match_reward"
    # diffusion families (rl.flow_grpo): the SDE rollouts and the trained steps
    noise_level: float = 0.7  # Flow-GRPO's a: std_dev_t = a sqrt(t / (1 - t))
    sampling_steps: int = 10  # denoising steps of a rollout
    clip_high: float = -1.0  # ratio clip above 1 (-1: rl.clip, symmetric)
    train_steps: str = "all"  # all | random (DanceGRPO) | window (MixGRPO)
    train_step_count: int = 1  # steps trained per rollout with random / window
    guidance_scale: float = 1.0  # CFG in rollouts (1: none)

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"rl.{name} ({getattr(self, name)!r}) must be {rule}")

        for name in ("group_size", "max_new_tokens", "seed", "sampling_steps", "train_step_count"):
            if not _is_int(getattr(self, name)):
                bad(name, "an integer")
        if self.group_size < 2:
            bad("group_size", ">= 2 (GRPO normalises rewards within a group)")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", ">= 1")
        if self.sampling_steps < 1:
            bad("sampling_steps", ">= 1")
        if self.train_steps not in ("all", "random", "window"):
            bad("train_steps", "'all', 'random' or 'window'")
        if not 1 <= self.train_step_count <= self.sampling_steps:
            bad("train_step_count", f"in [1, rl.sampling_steps = {self.sampling_steps}]")
        for name, ok, rule in _NUMBERS:
            v = getattr(self, name)
            if not (_is_finite(v) and ok(v)):
                bad(name, rule)
        if not isinstance(self.train_encoder, bool):
            bad("train_encoder", "a bool")
        if not isinstance(self.reward, str) or ":" not in self.reward:
            bad("reward", "'module:function'")


_NUMBERS = (  # (field, test of a finite number, the rule)
    ("temperature", lambda v: v >= 0, "a finite number >= 0 (0: greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("clip", lambda v: 0 < v < 1, "a finite number in (0, 1) (ratios clip to 1 +- clip)"),
    ("kl_coef", lambda v: v >= 0, "a finite number >= 0"),
    ("eps", lambda v: v > 0, "a finite number > 0"),
    ("noise_level", lambda v: v > 0, "a finite number > 0 (the SDE's noise; 0 is the ODE)"),
    ("clip_high", lambda v: v == -1 or 0 < v < 1, "-1 (rl.clip) or a number in (0, 1)"),
    ("guidance_scale", lambda v: v >= 1, "a finite number >= 1 (1: no guidance)"),
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
