"""The ``rl:`` section of the training config (GRPO, ``train.objective: grpo``): plain values,
validated where declared; no torch, so the config and the command line stay light. Used by
``mmsp.rl`` and ``training.grpo``."""

from __future__ import annotations

import dataclasses

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

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"rl.{name} ({getattr(self, name)!r}) must be {rule}")

        for name in ("group_size", "max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "an integer")
        if self.group_size < 2:
            bad("group_size", ">= 2 (GRPO normalises rewards within a group)")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", ">= 1")
        if not self.temperature >= 0:
            bad("temperature", ">= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not self.clip > 0:
            bad("clip", "> 0")
        if not self.kl_coef >= 0:
            bad("kl_coef", ">= 0")
        if not self.eps > 0:
            bad("eps", "> 0")
        if not isinstance(self.train_encoder, bool):
            bad("train_encoder", "a bool")
        if not isinstance(self.reward, str) or ":" not in self.reward:
            bad("reward", "'module:function'")
