"""A reward that rises: GRPO of the tiny random Qwen2.5-VL on the procedural video QA.

A short supervised run of ``examples/configs/qwen_vl.yaml`` (``--sft-steps``), then
``--grpo-steps`` GRPO steps of ``examples/configs/qwen_vl_grpo.yaml`` from it (``model.init_from``),
both in this process at CP = 1 on one rank (the CP layouts equal CP = 1 to 1e-10:
``tests/test_grpo_qwen_vl.py``). The questions ask the colour of the moving shape at the start or
the end of the clip, or its shape (``data.video_qa``); ``--prompts`` prompts x ``--group`` sampled
one-word answers a step (temperature 1), the learning rate ``--lr`` constant. The reward is the
shipped text reward on the decoded answer (``megatron_video.mmsp.rewards:text_reward``: 0.9 for
the right word; the 0.1 format part needs ``<think>`` / ``<answer>`` tags, which a one-word answer
never has). The run folders ``--out``/sft and ``--out``/grpo are replaced.

Writes the mean reward of each GRPO step, the means of the first and last ``--window`` steps, their
difference and its standard error (the two windows' step rewards taken as independent) to
``--json``, and the curve to ``--png``.

    python benchmarks/qwen_vl_grpo_reward.py [--sft-steps 30] [--grpo-steps 100] [--window 20]
        [--prompts 8] [--group 8] [--lr 1e-3] [--out runs/qwen_vl_grpo_reward]
        [--json docs/images/qwen_vl_grpo_reward.json] [--png docs/images/qwen_vl_grpo_reward.png]
        [--verbose]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "examples" / "configs"
REWARD = "megatron_video.mmsp.rewards:text_reward"
ONE_RANK = [  # CP = 1 in this process
    "parallel.context_parallel_size=1",
    "parallel.ulysses_size=1",
    "parallel.ring_size=1",
    "parallel.ranks_per_node=1",
    "train.tensorboard=false",
]


def _train(config: Path, overrides):
    """One ``megatron-video train`` run in this process: its metrics (with ``history``)."""
    import torch
    import torch.distributed as dist

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer, init_distributed

    if not torch.cuda.is_available():
        from megatron_video.compat import ensure_cpu_mode

        ensure_cpu_mode()
    owns = init_distributed()  # a world of one
    try:
        t = Trainer(load_config(str(config), ONE_RANK + list(overrides)), progress=False)
        try:
            return t.run()
        finally:
            t.close()
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


def summary(rewards, window: int) -> dict:
    """First / last ``window`` means, their difference and its standard error."""
    k = min(window, len(rewards))
    first, last = rewards[:k], rewards[-k:]

    def var(x):
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / max(len(x) - 1, 1)

    se = math.sqrt(var(first) / k + var(last) / k)
    diff = sum(last) / k - sum(first) / k
    return dict(
        window=k,
        first_mean=sum(first) / k,
        last_mean=sum(last) / k,
        difference=diff,
        standard_error=se,
        difference_in_se=diff / se if se > 0 else None,
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--grpo-steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per GRPO step")
    ap.add_argument("--group", type=int, default=8, help="answers per prompt (rl.group_size)")
    ap.add_argument("--lr", type=float, default=1e-3, help="GRPO's constant learning rate")
    ap.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    ap.add_argument("--out", default="runs/qwen_vl_grpo_reward", help="the two run folders")
    ap.add_argument("--json", default="docs/images/qwen_vl_grpo_reward.json")
    ap.add_argument("--png", default="docs/images/qwen_vl_grpo_reward.png")
    ap.add_argument("--verbose", action="store_true", help="show the known environment warnings")
    a = ap.parse_args(argv)
    out = Path(a.out)
    for run in ("sft", "grpo"):  # this script's run folders: a fresh run, never a resumed one
        shutil.rmtree(out / run, ignore_errors=True)
    t0 = time.perf_counter()
    sft = _train(CONFIGS / "qwen_vl.yaml", [f"train.steps={a.sft_steps}", f"output={out}/sft"])
    t1 = time.perf_counter()
    grpo = _train(
        CONFIGS / "qwen_vl_grpo.yaml",
        [
            f"train.steps={a.grpo_steps}",
            f"model.init_from={out}/sft",
            f"rl.reward={REWARD}",
            f"train.micro_batch_size={a.prompts}",
            f"rl.group_size={a.group}",
            f"train.lr={a.lr}",
            f"train.min_lr={a.lr}",
            "train.save=false",
            f"output={out}/grpo",
        ],
    )
    t2 = time.perf_counter()
    hist = grpo["history"]
    rewards = [h["reward_mean"] for h in hist]
    record = dict(
        what="GRPO of the tiny random Qwen2.5-VL (examples/configs/qwen_vl_grpo.yaml) at CP = 1 "
        f"from {a.sft_steps} supervised steps of examples/configs/qwen_vl.yaml; reward {REWARD}",
        sft_steps=a.sft_steps,
        sft_loss=[h["loss"] for h in sft["history"]],
        grpo_steps=a.grpo_steps,
        prompts_per_step=a.prompts,
        group_size=a.group,
        lr=a.lr,
        sft_seconds=round(t1 - t0, 1),
        grpo_seconds=round(t2 - t1, 1),
        **summary(rewards, a.window),
        reward_mean=rewards,
        kl=[h["kl"] for h in hist],
    )
    for path in (a.json, a.png):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    from megatron_video.training.outputs import plot_loss

    plot_loss(
        a.png,
        [h["step"] for h in hist],
        rewards,
        title=f"qwen_vl GRPO from {a.sft_steps} SFT steps (text_reward)",
        quantity="reward (mean of the batch)",
    )
    k = record["window"]
    print(
        f"SFT {a.sft_steps} steps: {record['sft_seconds']} s; GRPO {a.grpo_steps} steps: "
        f"{record['grpo_seconds']} s"
    )
    print(
        f"reward: first {k} steps {record['first_mean']:.3f}, last {k} "
        f"{record['last_mean']:.3f} (difference {record['difference']:+.3f}, standard error "
        f"{record['standard_error']:.3f})"
    )
    print(f"wrote {a.json} and {a.png}")
    return record


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
