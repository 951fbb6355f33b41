"""``train.objective: grpo``: GRPO of ``video_llava`` and ``qwen_vl`` with MR-SP (``mmsp.rl``) in
the supervised trainer's job: the same build, checkpoints, resume and outputs (``Trainer``),
another step.

Each DP rank takes the prompts of its micro-batches (DP ranks own whole groups). Per prompt the
video is encoded once (this CP rank's frames: the embedding cache), ``rl.group_size`` responses are
sampled (seeded by ``rl.seed``, the sample's position in the stream and the response, so any layout
and a resumed run sample the same tokens: there is no rollout RNG state to checkpoint) and scored by
``rl.reward`` (with the decoded ``answer`` and ``decode`` where the family has a tokenizer:
``FamilySpec.tokenizer``); then the GRPO loss of the policy against the frozen reference (the
starting weights: ``model.init_from``'s or the seed's, sharded like the policy) is
back-propagated, normalised by the response tokens of the whole global batch. The vision encoder
is frozen unless ``rl.train_encoder``: then the policy's forward re-encodes with gradients and the
reference encodes with its own encoder (3 encoder calls per prompt instead of 1). Map: docs/mmsp.md ("GRPO").
"""

from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import torch

from megatron_video.data.video_qa import ANSWER_IDS
from megatron_video.mmsp import rl
from megatron_video.parallel import comm
from megatron_video.rl.grpo import token_normalisers

from .batches.protocol import checked_step_batches
from .model_factory import build_model
from .trainer import Trainer

__all__ = ["GRPOTrainer", "prompts_of", "answers_of"]

ENCODER = ("vision_model.", "vision_projection.", "visual.")  # video_llava's; qwen_vl's
RL_KEYS = ("reward_mean", "reward_std", "kl", "response_len", "clip_frac")


def prompts_of(mb) -> List[Tuple[object, torch.Tensor, int, int]]:
    """``(video, prompt ids [1, n], answer id, sample position)`` of each sample: the prompt is
    the text up to the question's last token (the answer is what the policy says). ``video``:
    ``frames [T, 3, H, W]`` of a ``VideoQABatch``; ``(pixel_values_videos, video_grid_thw [3])``
    of a ``qwen_vl`` batch (placeholders expanded, HF labels: the first labelled token is the
    answer)."""
    if hasattr(mb, "video_grid_thw"):
        return _qwen_prompts(mb)
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


def _qwen_prompts(mb) -> List[Tuple[object, torch.Tensor, int, int]]:
    """``video``: ``(pixel rows, grid)``, with the clip's ``second_per_grid_t`` where the batch has
    timing; the rows are every temporal patch's or, where the batch says (``pixel_rows``: an
    energon loader decoding only this CP rank's frames), this rank's."""
    out, rows = [], 0
    counts, secs = getattr(mb, "pixel_rows", None), getattr(mb, "second_per_grid_ts", None)
    for j in range(mb.input_ids.shape[0]):
        grid = mb.video_grid_thw[j]
        n = int(grid.prod()) if counts is None else int(counts[j])
        k = int(torch.nonzero(mb.labels[j] != -100)[0, 0])
        video = (mb.pixel_values_videos[rows : rows + n], grid)
        if secs is not None:
            video = (*video, float(secs[j]))
        out.append(
            (video, mb.input_ids[j : j + 1, :k], int(mb.labels[j, k]), int(mb.sample_ids[j]))
        )
        rows += n
    return out


def answers_of(mb) -> List[object]:
    """Each sample's answer text where the batch carries it (``answers``: energon video QA, the
    clip's caption), else None (the reward reads the answer token decoded)."""
    answers = getattr(mb, "answers", None)
    return list(answers) if answers is not None else [None] * mb.input_ids.shape[0]


def _to(video, device, dtype):
    """A video of ``prompts_of`` on ``device`` (pixels in ``dtype``)."""
    if isinstance(video, tuple):
        return (video[0].to(device, dtype), *video[1:])
    return video.to(device, dtype)


class GRPOTrainer(Trainer):
    """``Trainer`` whose step is GRPO (``forward_backward``); records and plots the rewards."""

    def _prepare_model(self, model) -> None:
        """Freeze the encoder (unless ``rl.train_encoder``); build the reference: the same model
        (``model.init_from`` loaded again), frozen, with the policy's starting weights. Checks
        that ``rl.mini_batches`` divides this rank's micro-batches (every rank, before any
        collective)."""
        k, n = self.config.rl.mini_batches, self.num_microbatches
        if n % k:
            raise ValueError(
                f"rl.mini_batches ({k}) must divide the micro-batches per DP rank ({n} = "
                f"train.global_batch_size / (train.micro_batch_size x DP {self.dp_size}))"
            )
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
        self.tokenizer = self.family.tokenizer(self.config)

    def _text_fields(self, answer_id: int, text=None) -> Dict[str, object]:
        """What a text reward reads besides the ids, where the family has a tokenizer:
        ``answer`` (``text``, the sample's answer text, or else the answer token decoded) and
        ``decode`` (ids -> text, special tokens skipped: the completion as the tokenizer writes
        it)."""
        if self.tokenizer is None:
            return {}
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        return {"answer": decode([answer_id]) if text is None else text, "decode": decode}

    def _rollouts(self, step: int) -> List[tuple]:
        """``(micro-batch index, frames, prompt, visual, rollout, rewards)`` of this rank's
        prompts; a prompt too long or a bad reward is raised by every rank (agree-then-raise)."""
        cfg, policy = self.config.rl, self.model
        dtype = next(policy.parameters()).dtype  # bf16 under Float16Module
        groups, reason = [], None
        try:  # a prompt too long or a bad reward: raised by a whole DP group (same prompts)
            for i, mb in enumerate(checked_step_batches(self.batches, step)):
                for (frames, prompt, answer, position), text in zip(prompts_of(mb), answers_of(mb)):
                    frames, prompt = _to(frames, self.device, dtype), prompt.to(self.device)
                    visual = rl.encode_video(policy, frames)  # once: rollout, reference, policy
                    ro = rl.rollout(policy, visual, prompt, cfg, prompt_seed=position)
                    rewards = rl.score(
                        cfg,
                        ro,
                        answer_id=answer,
                        format_ids=ANSWER_IDS,
                        **self._text_fields(answer, text),
                    )
                    groups.append((i, frames, prompt, visual, ro, rewards))
        except ValueError as e:
            reason = str(e)
        comm.agree_or_raise(reason, f"GRPO step {step}")  # every rank raises, none waits
        return groups

    def _update(self, groups: List[tuple]) -> torch.Tensor:
        """Gradients of one mini-batch (``groups``): ``[loss, kl, clipped, tokens]`` summed over
        the CP and DP ranks; normalised by ``rl.loss_agg`` (``token_normalisers``)."""
        cfg, policy = self.config.rl, self.model
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro = sorted({g[0] for g in groups})
        micro_tokens = [sum(int(g[4].lengths.sum()) for g in groups if g[0] == i) for i in micro]
        tokens = torch.tensor([float(sum(micro_tokens))], dtype=torch.float64)
        comm.all_reduce(tokens, self.dp_group, tag="rl.tokens")  # the mini-batch's, all DP ranks
        norms = token_normalisers(cfg, micro_tokens, int(tokens), self.dp_size)
        norms = dict(zip(micro, norms))
        scale = self.dp_size * self.cp_size  # DDP averages the gradients over DP x CP
        sums = torch.zeros(3, dtype=torch.float64)  # loss, kl, clipped (this rank's share)
        for i, frames, prompt, visual, ro, rewards in groups:
            ref_visual = None
            if cfg.train_encoder:  # the policy re-encodes with gradients, the reference its own
                ref_visual = rl.encode_video(self.reference, frames)
                visual = rl.encode_video(policy, frames, grad=True)
            loss, stats = rl.grpo_loss(
                policy, self.reference, visual, prompt, ro, rewards, cfg, norms[i], ref_visual
            )
            (loss * scale).backward()
            sums += torch.tensor([float(loss.detach()), stats["kl_sum"], stats["clipped"]])
        self.tcfg.finalize_model_grads_func([self.ddp])
        comm.all_reduce(sums, self.groups.cp_group, tag="rl.loss")
        comm.all_reduce(sums, self.dp_group, tag="rl.loss")
        return torch.cat([sums, tokens])

    def train_step(self, step: int) -> Dict[str, float]:
        """Rollouts of the whole step's prompts with the policy as it is, then ``rl.mini_batches``
        updates, each on its share of this rank's micro-batches (Long-RL's mini-batches: from the
        second on the policy has moved, so the ratio differs from 1 and the clip acts). A
        non-finite loss or gradient skips that update and ends the step (``train_step``)."""
        cfg = self.config.rl
        groups = self._rollouts(step)
        r = torch.cat([g[5] for g in groups])
        counts = torch.tensor([r.sum(), (r * r).sum(), r.numel()], dtype=torch.float64)
        comm.all_reduce(counts, self.dp_group, tag="rl.counts")  # every response of the batch
        r_sum, r_sq, n = counts.tolist()
        k = cfg.mini_batches
        total = torch.zeros(4, dtype=torch.float64)
        rec = {}
        for j in range(k):
            sums = self._update([g for g in groups if g[0] * k // self.num_microbatches == j])
            total += sums
            finite, loss = self._all_finite(float(sums[0]))
            if not finite:
                self.optimizer.zero_grad()
                rec = {"loss": loss, "grad_norm": None, "skipped": True, "nonfinite": True}
                break
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=self.global_batch // k)
            rec = {
                "loss": float(total[0]) / (j + 1),  # the mean of the mini-batches' losses
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "skipped": not ok or rec.get("skipped", False),
                "nonfinite": False,
            }
        rec["lr"] = float(self.optimizer.param_groups[0]["lr"])
        _, kl, clipped, tokens = total.tolist()
        var = max(0.0, r_sq / n - (r_sum / n) ** 2) * n / max(n - 1, 1)
        rec.update(
            reward_mean=r_sum / n,
            reward_std=var**0.5,
            kl=kl / tokens,
            response_len=tokens / n,
            clip_frac=clipped / tokens,
        )
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
