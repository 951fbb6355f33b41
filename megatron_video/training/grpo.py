"""``train.objective: grpo``: GRPO of ``video_llava`` with MR-SP (``mmsp.rl``) in the supervised
trainer's job: the same build, checkpoints, resume and outputs (``Trainer``), another step.

Each DP rank takes the prompts of its micro-batches (DP ranks own whole groups). Per prompt the
video is encoded once (this CP rank's frames: the embedding cache), ``rl.group_size`` responses are
sampled (seeded by ``rl.seed``, the sample's position in the stream and the response, so any layout
and a resumed run sample the same tokens: there is no rollout RNG state to checkpoint) and scored by
``rl.reward``; then the GRPO loss of the policy against the frozen reference (the starting weights:
``model.init_from``'s or the seed's, sharded like the policy) is back-propagated, normalised by the
response tokens of the whole global batch. The vision encoder is frozen unless
``rl.train_encoder``: then the policy's forward re-encodes with gradients and the reference encodes
with its own encoder (3 encoder calls per prompt instead of 1). Map: docs/mmsp.md ("GRPO").
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_video.data.video_qa import ANSWER_IDS
from megatron_video.mmsp import rl
from megatron_video.parallel import comm

from . import checkpoint as ckpt
from .batches.protocol import checked_step_batches
from .model_factory import build_model
from .trainer import Trainer
from .vlm import VideoQABatch

__all__ = ["GRPOTrainer", "prompts_of"]

ENCODER = ("vision_model.", "vision_projection.")
RL_KEYS = ("reward_mean", "reward_std", "kl", "response_len", "clip_frac")


def prompts_of(mb: VideoQABatch) -> List[Tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``(frames [T, 3, H, W], prompt ids [1, n], answer id, sample position)`` of each sample:
    the prompt is the text up to the question's last token (the answer is what the policy says)."""
    out, frames = [], 0
    for j in range(mb.input_ids.shape[0]):
        T = int(mb.num_image_tiles[j])
        n = int(torch.nonzero(mb.loss_mask[j])[0, 0]) + 1
        out.append(
            (
                mb.images[frames : frames + T],
                mb.input_ids[j : j + 1, :n],
                int(mb.labels[j, n - 1]),
                int(mb.sample_ids[j]),
            )
        )
        frames += T
    return out


class GRPOTrainer(Trainer):
    """``Trainer`` whose step is GRPO (``forward_backward``); records and plots the rewards."""

    def _prepare_model(self, model) -> None:
        """Freeze the encoder (unless ``rl.train_encoder``); build the reference: the same model
        (``model.init_from`` loaded again), frozen, with the policy's starting weights."""
        if not self.config.rl.train_encoder:
            for name, p in model.named_parameters():
                if name.startswith(ENCODER):
                    p.requires_grad_(False)
        ref = build_model(self.config, self.tcfg, self.first_stage, self.last_stage)
        ref.load_state_dict(model.state_dict())
        if self.has_gpu:
            ref.cuda()
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference = ref.eval()

    def _build(self) -> None:
        super()._build()
        self.reference.to(next(self.model.parameters()).dtype)  # bf16 under Float16Module

    def forward_backward(self, step: int) -> float:
        cfg, policy = self.config.rl, self.model
        dtype = next(policy.parameters()).dtype  # bf16 under Float16Module
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        groups, reason = [], None
        try:  # a prompt too long or a bad reward: raised by a whole DP group (same prompts)
            for mb in checked_step_batches(self.batches, step):
                for frames, prompt, answer, position in prompts_of(mb):
                    frames, prompt = frames.to(self.device, dtype), prompt.to(self.device)
                    visual = rl.encode_video(policy, frames)  # once: rollout, reference, policy
                    ro = rl.rollout(policy, visual, prompt, cfg, prompt_seed=position)
                    rewards = rl.score(cfg, ro, answer_id=answer, format_ids=ANSWER_IDS)
                    groups.append((frames, prompt, visual, ro, rewards))
        except ValueError as e:
            reason = str(e)
        ckpt.agree_or_raise(reason, f"GRPO step {step}")  # every rank raises, none waits
        r = torch.cat([g[4] for g in groups])
        counts = torch.tensor(
            [sum(int(g[3].lengths.sum()) for g in groups), r.sum(), (r * r).sum(), r.numel()],
            dtype=torch.float64,
        )
        comm.all_reduce(counts, self.dp_group, tag="rl.counts")  # every response of the batch
        tokens, r_sum, r_sq, n = counts.tolist()
        scale = self.dp_size * self.cp_size  # DDP averages the gradients over DP x CP
        sums = torch.zeros(3, dtype=torch.float64)  # loss, kl, clipped tokens (this rank's share)
        for frames, prompt, visual, ro, rewards in groups:
            ref_visual = None
            if cfg.train_encoder:  # the policy re-encodes with gradients, the reference its own
                ref_visual = rl.encode_video(self.reference, frames)
                visual = rl.encode_video(policy, frames, grad=True)
            loss, stats = rl.grpo_loss(
                policy, self.reference, visual, prompt, ro, rewards, cfg, tokens, ref_visual
            )
            (loss * scale).backward()
            sums += torch.tensor([float(loss), stats["kl_sum"], stats["clipped"]])
        self.tcfg.finalize_model_grads_func([self.ddp])
        comm.all_reduce(sums, self.groups.cp_group, tag="rl.loss")
        comm.all_reduce(sums, self.dp_group, tag="rl.loss")
        loss, kl, clipped = sums.tolist()
        var = max(0.0, r_sq / n - (r_sum / n) ** 2) * n / max(n - 1, 1)
        self._rl = dict(
            reward_mean=r_sum / n,
            reward_std=var**0.5,
            kl=kl / tokens,
            response_len=tokens / n,
            clip_frac=clipped / tokens,
        )
        return loss

    def train_step(self, step: int) -> Dict[str, float]:
        rec = super().train_step(step)
        rec.update(self._rl)
        return rec

    def _postfix(self, rec: Dict) -> Dict[str, str]:
        return {
            "loss": f"{rec['loss']:.4f}",
            "reward": f"{rec['reward_mean']:.3f}",
            "kl": f"{rec['kl']:.3g}",
            "clip": f"{rec['clip_frac']:.2f}",
            "step_s": f"{rec['step_time']:.2f}",
        }

    def _log_step(self, rec: Dict, step: int, bar, writer) -> None:
        super()._log_step(rec, step, bar, writer)
        if writer is not None and step % self.config.train.log_interval == 0:
            for k in RL_KEYS:
                writer.add_scalar(f"rl/{k}", rec[k], step)

    def _write_outputs(self, history, train_wall, sample_wall, sample, out_dir, writer) -> Dict:
        from .outputs import plot_loss, write_metrics

        metrics = super()._write_outputs(history, train_wall, sample_wall, sample, out_dir, writer)
        rewards = [h["reward_mean"] for h in history]
        if rewards:
            k = metrics["loss_mean_steps"]
            metrics["reward_first_mean"] = sum(rewards[:k]) / len(rewards[:k])
            metrics["reward_last_mean"] = sum(rewards[-k:]) / len(rewards[-k:])
            plot_loss(
                out_dir / "reward.png",
                [h["step"] for h in history],
                rewards,
                title=f"GRPO reward ({self.config.rl.reward})",
                quantity="reward (mean of the batch)",
            )
            write_metrics(out_dir / "metrics.json", metrics)
        return metrics
