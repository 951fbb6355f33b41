"""``train.objective: grpo`` for ``wan``: Flow-GRPO in the supervised trainer's job (the same build,
checkpoints, resume, outputs; the reference, reward records and ``reward.png`` of
``training.grpo.GRPOTrainer``), another step.

Each DP rank takes the samples of its micro-batches (DP ranks own whole groups). Per sample (its
precomputed caption embedding; its latents' shape) ``rl.group_size`` SDE rollouts of
``rl.sampling_steps`` steps run under the model's CP layout (``rl.wan.wan_rollout``, seeded by
``rl.seed``, the optimiser step, the clip's index and the rollout: no RNG state to
checkpoint), are scored by
``rl.reward`` on every rank of the group (a failure anywhere is raised on every rank before any
collective of the update), and the trained steps (``rl.train_steps``) are re-run with gradients
one at a time (``rl.wan.wan_grpo_backward``). The loss is the mean over the global batch's groups;
the gradients are reduced as the supervised step's.
Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_video.generation import cp_sampling as cps
from megatron_video.models.embedders import unpatchify
from megatron_video.parallel import comm
from megatron_video.rl.flow_grpo import select_steps
from megatron_video.rl.rewards import score
from megatron_video.rl.wan import wan_grpo_backward, wan_rollout, wan_videos

from .batches.clips import fixed_latent_shape
from .batches.fixed import rank_token_ids
from .batches.protocol import checked_step_batches
from .grpo import GRPOTrainer
from .trainer import Trainer

__all__ = ["FlowGRPOTrainer", "WanGRPOTrainer"]


class FlowGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` (reference, records, ``reward.png``) whose step is Flow-GRPO; a model's
    binding gives ``_group`` (one sample's rollouts and rewards) and ``_backward``."""

    def _grid(self):
        """``(patch, token grid, this rank's token ids, tokens per sample)``."""
        F, h, w = fixed_latent_shape(self.config)
        patch = tuple(self.config.model.patch_size)
        grid = (F // patch[0], h // patch[1], w // patch[2])
        ids = rank_token_ids(grid, self.groups.cp_rank, self.cp_size)
        return patch, grid, ids, grid[0] * grid[1] * grid[2]

    def _latents(self, tokens):
        """Full tokens ``[b, N, D]`` -> latents ``[b, C, F, H, W]``."""
        patch, grid, _, _ = self._grid()
        return unpatchify(tokens, patch, grid, self.config.vae.latent_channels)

    def _sample(self, mb, j: int) -> dict:
        """The reward's keywords of sample ``j``: caption, clean latents, position (clip index)."""
        _, _, ids, n = self._grid()
        full = cps.gather_tokens(mb.clean[j : j + 1], ids, self.groups.cp_group, n)
        return dict(caption=mb.captions[j], clean=self._latents(full)[0], position=mb.indices[j])

    def _flow_rollouts(self, step: int, dtype) -> Tuple[list, object]:
        groups, reason = [], None
        try:  # a bad reward: raised by a whole CP group (the same latents), agreed below
            for mb in checked_step_batches(self.batches, step):
                for j in range(len(mb.indices)):
                    groups.append(self._group(mb, j, step, dtype))
        except ValueError as e:
            reason = str(e)
        return groups, reason

    def _score(self, latents, **sample):
        rl = self.config.rl
        return score(rl.reward, rl.group_size, latents, **sample)

    def forward_backward(self, step: int) -> float:
        rl = self.config.rl
        dtype = next(self.model.parameters()).dtype
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        groups, reason = self._flow_rollouts(step, dtype)
        comm.agree_or_raise(reason, f"GRPO step {step}")  # every rank raises, none waits
        r = torch.cat([g[1] for g in groups]) if groups else torch.zeros(0, dtype=torch.float64)
        counts = torch.tensor([len(groups), r.sum(), (r * r).sum(), r.numel()], dtype=torch.float64)
        comm.all_reduce(counts, self.dp_group, tag="rl.counts")
        n_groups, r_sum, r_sq, n = counts.tolist()
        steps = select_steps(rl.sampling_steps, rl.train_steps, rl.train_step_count, step, rl.seed)
        kw = dict(
            noise_level=rl.noise_level,
            clip_low=rl.clip,
            clip_high=rl.clip if rl.clip_high is None else rl.clip_high,
            kl_coef=rl.kl_coef,
            eps=rl.eps,
            scale=self.dp_size * self.cp_size / n_groups,  # DDP averages over DP x CP
        )
        sums = torch.zeros(3, dtype=torch.float64)  # loss, kl, clipped fraction (group means)
        for handle, rewards in groups:
            st = self._backward(handle, rewards, steps, **kw)
            sums += torch.tensor([st["loss"], st["kl"], st["clip_frac"]], dtype=torch.float64)
        self.tcfg.finalize_model_grads_func([self.ddp])
        comm.all_reduce(sums, self.dp_group, tag="rl.loss")  # identical over CP already
        loss, kl, clip_frac = (v / n_groups for v in sums.tolist())
        var = max(0.0, r_sq / n - (r_sum / n) ** 2) * n / max(n - 1, 1)
        self._rl = dict(
            reward_mean=r_sum / n,
            reward_std=var**0.5,
            kl=kl,
            response_len=float(len(steps)),  # the denoising steps trained per rollout
            clip_frac=clip_frac,
        )
        return loss

    def train_step(self, step: int) -> dict:
        """The supervised trainer's step (``forward_backward`` above, one optimiser step) with
        the rewards' records (``GRPOTrainer``'s own step is the VLM's)."""
        rec = Trainer.train_step(self, step)
        rec.update(self._rl)
        return rec


class WanGRPOTrainer(FlowGRPOTrainer):
    """Flow-GRPO of Wan (``rl.wan``) on precomputed caption embeddings."""

    def _group(self, mb, j: int, step: int, dtype):
        cfg, rl = self.config, self.config.rl
        keep = mb.caption_mask[j : j + 1].to(mb.caption_ids.dtype)[..., None]
        text = (mb.caption_ids[j : j + 1] * keep).to(self.device)
        null = torch.zeros_like(text) if rl.guidance_scale != 1 else None
        wr = wan_rollout(
            self.model,
            text,
            (cfg.vae.latent_channels,) + tuple(fixed_latent_shape(cfg)),
            group_size=rl.group_size,
            num_steps=rl.sampling_steps,
            noise_level=rl.noise_level,
            shift=cfg.diffusion.flow_shift,
            seed=rl.seed,
            position=f"{step}:{mb.indices[j]}",  # new noise every step
            null_text=null,
            guidance_scale=rl.guidance_scale,
            dtype=dtype,
        )
        return wr, self._score(wan_videos(self.model, wr), **self._sample(mb, j))

    def _backward(self, wr, rewards, steps, **kw):
        return wan_grpo_backward(self.model, self.reference, wr, rewards, steps, **kw)
