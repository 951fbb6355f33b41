"""Does Flow-GRPO raise the shipped reward? GRPO of the demo's model at U2 x R2 on 4 CPU ranks.

The demo's model (``examples/configs/demo.yaml``: 4 layers, hidden 96, 4 heads, LoRA 16, patch 1,
29 frames of 32 x 32 -> 8 latent frames of 4 x 4, the shipped VAE ``examples/vae/demo_vae.pt``),
``--family ar_dit`` (the demo's own: 4 blocks of 2 latent frames, rollouts streamed block by block
through the KV cache, ``training.grpo_wan_ar.ARDiTGRPOTrainer``) from the ``make demo`` checkpoint
(``--init-from``, default ``runs/demo``: ``model.init_from``), or ``--family video_dit`` (full
attention, ``training.grpo_dit``) from the seed's weights, trained by ``train.objective: grpo``
on ``--num-samples`` procedural clips (cycled, so every step scores the
same captions and the steps' means compare) with a shipped reward (``--reward``, default
``megatron_video.rl.rewards:latent_colour``: the generated latents' channel means against the
captioned clip's; ``dominant_colour``: the decoded video's colour against the caption's word), 4
ranks as 2 simulated nodes x 2, CP 4 = Ulysses 2 x ring 2.

Writes ``<out>/grpo_reward.json`` (the settings, the per-step reward / KL / clipped fraction, the
mean reward of the first and last ``--window`` steps, their difference over its standard error)
and ``<out>/reward.png`` (matplotlib: reward per step, its ``--window``-step moving mean, the KL).

    make demo   # (or megatron-video demo --cpu): runs/demo, the checkpoint ar_dit starts from
    python benchmarks/grpo_reward.py [--family ar_dit --steps 100 --out runs/grpo_reward]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def _model(a) -> dict:
    """The demo's model: ``ar_dit`` from ``a.init_from`` or ``video_dit`` from the seed."""
    m = dict(
        family=a.family, num_layers=4, hidden_size=96, num_attention_heads=4, lora_rank=16,
        patch_size=[1, 1, 1],
    )  # fmt: skip
    if a.family == "ar_dit":
        m.update(
            frames_per_block=2, init_from=os.path.abspath(a.init_from) if a.init_from else None
        )
    return m


def config_dict(a) -> dict:
    """The job: the demo's model and data (``--family``) + flow, GRPO with ``a``'s settings."""
    return dict(
        model=_model(a),
        parallel=dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2),
        data=dict(
            source="synthetic", num_frames=29, height=32, width=32, num_samples=a.num_samples
        ),
        vae=dict(weights=os.path.join(ROOT, "examples/vae/demo_vae.pt"), base_channels=16),
        diffusion=dict(objective="flow", flow_shift=a.shift),
        train=dict(
            objective="grpo",
            steps=a.steps,
            micro_batch_size=1,
            global_batch_size=a.prompts,
            lr=a.lr,
            min_lr=a.lr,
            warmup_steps=0,
            lr_decay_style="constant",
            clip_grad=1.0,
            save_interval=0,
            sample=False,
        ),
        rl=dict(
            group_size=a.group_size,
            sampling_steps=a.sampling_steps,
            noise_level=a.noise_level,
            clip=a.clip,
            kl_coef=a.kl_coef,
            train_steps=a.train_steps,
            train_step_count=a.train_step_count,
            seed=a.seed,
            reward=f"megatron_video.rl.rewards:{a.reward}",
        ),
        output=a.out,
    )


def _train(cfg: dict, progress: bool = False) -> dict:
    """One rank of the job (``Trainer.run``); the logger's history (``progress``: its bar, the
    reward and KL of each step, on stderr)."""
    import warnings

    from megatron_video.training.config import config_from_dict
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(config_from_dict(cfg), progress=progress)
    try:
        metrics = t.run()
        keys = ("step", "loss", "reward_mean", "reward_std", "kl", "clip_frac", "grad_norm")
        hist = [{k: h.get(k) for k in keys} for h in (metrics or {}).get("history", [])]
        return dict(history=hist, logger=t.is_logger)
    finally:
        t.close()


def summary(rewards, window: int) -> dict:
    """First / last ``window`` means of ``rewards``, their difference and its standard error
    (the two windows' standard errors of the mean, in quadrature)."""
    import statistics

    if len(rewards) < 2 * window:
        raise ValueError(f"--window ({window}) must be at most half the steps ({len(rewards)})")
    first, last = rewards[:window], rewards[-window:]
    se = (statistics.variance(first) / window + statistics.variance(last) / window) ** 0.5
    rise = statistics.fmean(last) - statistics.fmean(first)
    return dict(
        first_mean=statistics.fmean(first),
        last_mean=statistics.fmean(last),
        rise=rise,
        rise_se=se,
        rise_over_se=rise / se if se > 0 else float("inf"),
    )


def plot(history, window: int, path: str, family: str = "video_dit") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    r = [h["reward_mean"] for h in history]
    smooth = [sum(r[max(0, i - window + 1) : i + 1]) / len(r[max(0, i - window + 1) : i + 1])
              for i in range(len(r))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, r, ".", alpha=0.5, label="mean reward of the step")
    ax.plot(steps, smooth, "-", label=f"{window}-step moving mean")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    ax2.plot(steps, [h["kl"] for h in history], "r-", alpha=0.4, label="KL to the start")
    ax2.set_ylabel("KL", color="r")
    ax.legend(loc="lower right", fontsize=8)
    start = "the make demo checkpoint" if family == "ar_dit" else "the seed"
    ax.set_title(f"Flow-GRPO of {family} from {start}, U2 x R2, 4 CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--family", default="ar_dit", choices=("ar_dit", "video_dit"))
    ap.add_argument(
        "--init-from",
        default="runs/demo",
        help="ar_dit: the make demo run (model.init_from; '': the seed's weights)",
    )
    ap.add_argument(
        "--reward",
        default="latent_colour",
        choices=("latent_colour", "dominant_colour"),
        help="the shipped reward (megatron_video.rl.rewards)",
    )
    ap.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    ap.add_argument("--prompts", type=int, default=2, help="groups (captions) a step")
    ap.add_argument(
        "--num-samples",
        type=int,
        default=2,
        help="procedural clips (captions) cycled through: every step (or window) sees the same mix",
    )
    ap.add_argument("--group-size", type=int, default=6, help="rollouts a caption")
    ap.add_argument("--sampling-steps", type=int, default=4)
    ap.add_argument("--noise-level", type=float, default=1.0)
    ap.add_argument("--shift", type=float, default=3.0, help="diffusion.flow_shift")
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Adam's (default 5e-4 for ar_dit from the checkpoint: at 2e-3 Adam's first steps, "
        "lr on every weight, threw the trained model off, KL 0.08 after one step; 2e-3 for "
        "video_dit from the seed)",
    )
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.004)
    ap.add_argument("--train-steps", default="all", help="all | random | window")
    ap.add_argument("--train-step-count", type=int, default=1, help="with random / window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="the trainer's bar (reward, KL)")
    ap.add_argument("--out", default="runs/grpo_reward")
    a = ap.parse_args()
    if a.lr is None:
        a.lr = 5e-4 if a.family == "ar_dit" else 2e-3
    if not 2 <= a.window <= a.steps // 2:
        ap.error(f"--window ({a.window}) must be in [2, --steps / 2 = {a.steps // 2}]")
    from megatron_video.testing import WorkerPool

    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    cfg = config_dict(a)
    with WorkerPool(4, ranks_per_node=2, timeout=7200) as pool:
        got = next(r for r in pool.run(_train, cfg, a.progress, ranks_per_node=2) if r["logger"])
    hist = got["history"]
    res = dict(config=cfg, history=hist, **summary([h["reward_mean"] for h in hist], a.window))
    res["kl_max"] = max(h["kl"] for h in hist)
    with open(os.path.join(a.out, "grpo_reward.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(hist, a.window, os.path.join(a.out, "reward.png"), a.family)
    print(
        f"{len(hist)} steps: mean reward of the first {a.window} {res['first_mean']:.4f}, of the "
        f"last {a.window} {res['last_mean']:.4f}, rise {res['rise']:.4f} "
        f"({res['rise_over_se']:.1f} standard errors); KL max {res['kl_max']:.4g}"
    )


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
