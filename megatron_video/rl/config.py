"""The ``rl:`` section of the training config (GRPO, ``train.objective: grpo``): plain values,
validated where declared; no torch, so the config and the command line stay light. Used by
every GRPO: the VLMs' (``mmsp.rl``, ``training.grpo``) and the diffusion families'
(``training.grpo_wan``, ``training.grpo_dit``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["RLConfig", "LOSS_AGG"]


@dataclasses.dataclass
class RLConfig:
    """The ``rl:`` options (validated here)."""

    group_size: int = 4
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    clip: float = 0.2  # the ratio's lower clip 1 - clip (and upper 1 + clip unless clip_high)
    clip_high: Optional[float] = None  # the upper clip 1 + clip_high (Long-RL / DAPO: 0.3)
    dual_clip: Optional[float] = None  # dual clip for A < 0: loss <= -dual_clip * A (Long-RL 3.0)
    kl_coef: float = 0.04
    kl_clamp: Optional[float] = None  # k3 clamped to [-kl_clamp, kl_clamp] (Long-RL 10.0)
    loss_agg: str = "global_token_mean"  # or micro_token_mean (Long-RL's token mean)
    mini_batches: int = 1  # optimizer updates per rollout batch (Long-RL: 4)
    eps: float = 1e-6
    seed: int = 0
    train_encoder: bool = False
    reward: str = "megatron_video.mmsp.rl:exact_match_reward"
    # diffusion families (rl.flow_grpo): the SDE rollouts and the trained steps
    noise_level: float = 0.7  # Flow-GRPO's a: std_dev_t = a sqrt(t / (1 - t))
    sampling_steps: int = 10  # denoising steps of a rollout
    train_steps: str = "all"  # all | random (DanceGRPO) | window (MixGRPO)
    train_step_count: int = 1  # steps trained per rollout with random / window
    guidance_scale: float = 1.0  # CFG in rollouts (1: none)
    # AR families (rl.ar_flow): the stream's KV cache keeps the first ``sink`` latent frames and the
    # ``window`` frames before a block (null: all); whole blocks (generation.streaming.WindowRule)
    sink: int = 0
    window: Optional[int] = None

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"rl.{name} ({getattr(self, name)!r}) must be {rule}")

        ints = ("group_size", "max_new_tokens", "seed", "mini_batches", "sink")
        for name in ints + ("sampling_steps", "train_step_count"):
            if not _is_int(getattr(self, name)):
                bad(name, "an integer")
        if self.group_size < 2:
            bad("group_size", ">= 2 (GRPO normalises rewards within a group)")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", ">= 1")
        if self.mini_batches < 1:
            bad("mini_batches", ">= 1 (optimizer updates per rollout batch)")
        if self.sampling_steps < 1:
            bad("sampling_steps", ">= 1")
        if self.sink < 0:
            bad("sink", ">= 0 (latent frames)")
        if self.window is not None and not (_is_int(self.window) and self.window >= 0):
            bad("window", "null or an integer >= 0 (latent frames)")
        if self.train_steps not in ("all", "random", "window"):
            bad("train_steps", "'all', 'random' or 'window'")
        if not 1 <= self.train_step_count <= self.sampling_steps:
            bad("train_step_count", f"in [1, rl.sampling_steps = {self.sampling_steps}]")
        for name, ok, rule in _NUMBERS:
            v = getattr(self, name)
            if not (_is_finite(v) and ok(v)):
                bad(name, rule)
        for name, ok, rule in _OPTIONAL:
            v = getattr(self, name)
            if v is not None and not (_is_finite(v) and ok(v)):
                bad(name, rule)
        if self.loss_agg not in LOSS_AGG:
            bad("loss_agg", f"one of {', '.join(LOSS_AGG)}")
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
    ("guidance_scale", lambda v: v >= 1, "a finite number >= 1 (1: no guidance)"),
)

_OPTIONAL = (  # (field, test of a finite number, the rule); None: off
    ("clip_high", lambda v: v > 0, "null or a finite number > 0 (ratios clip above 1 + clip_high)"),
    ("dual_clip", lambda v: v > 1, "null or a finite number > 1 (the dual clip's -dual_clip * A)"),
    ("kl_clamp", lambda v: v > 0, "null or a finite number > 0 (k3 clamps to +-kl_clamp)"),
)
LOSS_AGG = ("global_token_mean", "micro_token_mean")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
