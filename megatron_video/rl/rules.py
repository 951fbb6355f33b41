"""The configuration rules of the diffusion GRPO (no torch: the config checks stay light):
``check_flow_rl`` for ``wan`` and ``video_dit`` (flow) and ``refuse_rl`` for the diffusion
families it is not built for, each a ``ValueError`` naming the field and the reason.
Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)"."""

from __future__ import annotations

__all__ = ["VLM_REWARD", "check_flow_rl", "refuse_rl", "check_rollout"]

VLM_REWARD = "megatron_video.mmsp.rl:exact_match_reward"


def _check_objective(config) -> None:
    if config.train.objective != "grpo":
        raise ValueError(
            f"the rl section is read with train.objective 'grpo' (it is "
            f"{config.train.objective!r}): set train.objective=grpo or leave rl at its defaults"
        )


def _check_window(config, autoregressive: bool) -> None:
    """``rl.sink`` / ``rl.window``: the AR families' streamed rollouts only, whole blocks."""
    rl, nb = config.rl, config.model.frames_per_block
    for name, value, off in (("sink", rl.sink, 0), ("window", rl.window, None)):
        if value == off:
            continue
        if not autoregressive:
            raise ValueError(
                f"rl.{name} ({value!r}) must be {off!r} for model.family "
                f"{config.model.family!r} (the KV cache's sink / window of the AR families' "
                f"streamed rollouts)"
            )
        if value % nb:
            raise ValueError(
                f"rl.{name} ({value}) must be a multiple of model.frames_per_block ({nb}) "
                f"(whole blocks)"
            )


def check_flow_rl(config, placed: bool = False, autoregressive: bool = False) -> None:
    """The rules of ``train.objective: grpo`` for the flow families that have it (``wan``,
    ``video_dit`` with ``diffusion.objective: flow``, the AR ``wan_ar`` / ``ar_dit``):
    ``ValueError`` naming the field. ``placed``: the family places this config's clips by token
    (``batches.placed``); ``autoregressive``: ``rl.sink`` / ``rl.window`` are read."""
    _check_objective(config)
    _check_window(config, autoregressive)
    p, d = config.parallel, config.data
    if p.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size ({p.pipeline_model_parallel_size}) must be 1 "
            f"with train.objective 'grpo' (a rollout runs the whole model at every step)"
        )
    if p.fsdp:
        raise ValueError("parallel.fsdp (True) must be false with train.objective 'grpo'")
    if d.buckets is not None:
        raise ValueError("data.buckets must be null with train.objective 'grpo' (fixed shapes)")
    rl = config.rl
    for name, off in (("dual_clip", None), ("kl_clamp", None), ("mini_batches", 1)):
        if getattr(rl, name) != off:
            raise ValueError(
                f"rl.{name} ({getattr(rl, name)!r}) must be {off!r} with a diffusion family's "
                f"GRPO (a VLM option: not built for Flow-GRPO)"
            )
    if rl.loss_agg != "global_token_mean":
        raise ValueError(
            f"rl.loss_agg ({rl.loss_agg!r}) must be 'global_token_mean' with a diffusion "
            f"family's GRPO (the loss is the mean over the global batch's groups)"
        )
    if placed:
        raise ValueError(
            f"data.num_frames ({d.num_frames}) must give latent token frames that "
            f"parallel.context_parallel_size ({p.context_parallel_size}) divides with "
            f"train.objective 'grpo' (rollouts cut whole frames per CP rank; clips placed by "
            f"token are not wired)"
        )
    if d.i2v_probability:
        raise ValueError(
            f"data.i2v_probability ({d.i2v_probability}) must be null with train.objective "
            f"'grpo' (the rollouts are text-to-video)"
        )
    if config.rl.reward == VLM_REWARD:
        raise ValueError(
            f"rl.reward ({VLM_REWARD!r}, the VLM's) must name a diffusion reward: "
            f"'megatron_video.rl.rewards:latent_colour' or your module:function "
            f"(docs/wan.md, 'Reinforcement learning')"
        )


def refuse_rl(family: str, objective: str, rl_families) -> None:
    """``ValueError``: ``train.objective: grpo`` is not built for this diffusion family (or its
    objective), and why (``rl_families``: the families that have it)."""
    if objective == "edm":
        why = (
            "diffusion.objective 'edm' has no stochastic sampler with a Gaussian per-step "
            "log-probability (EDM's Heun / Euler samplers are deterministic; their churn "
            "re-noises before the step, so a step's density needs the churn's noise too)"
        )
    else:
        why = "its sampler is not wired to the Flow-GRPO step yet (rl.flow_grpo)"
    raise ValueError(
        f"train.objective ('grpo') and the rl section are for model.family in "
        f"{sorted(rl_families)}; "
        f"{family!r} has no GRPO: {why} (docs/wan.md, 'Reinforcement learning')"
    )


def check_rollout(group_size, noise_level, num_steps) -> None:
    """The arguments of a rollout, checked before its first collective: ``ValueError`` naming
    ``rl.group_size`` (an int >= 2: GRPO normalises within a group), ``rl.noise_level`` (> 0:
    the transition's density needs noise) or ``rl.sampling_steps`` (an int >= 1)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"rl.group_size ({group_size!r}) must be an int >= 2 (GRPO normalises the rewards "
            f"within a group of rollouts)"
        )
    if (
        isinstance(noise_level, bool)
        or not isinstance(noise_level, (int, float))
        or not (noise_level > 0)
    ):
        raise ValueError(
            f"rl.noise_level ({noise_level!r}) must be > 0 (the SDE step's Gaussian needs noise)"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"rl.sampling_steps ({num_steps!r}) must be an int >= 1")
