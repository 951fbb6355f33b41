"""``train.objective: grpo`` for ``wan_ar``: the step of ``training.grpo_wan.FlowGRPOTrainer`` with
the AR binding (``rl.ar_flow``): per caption ``rl.group_size`` rollouts streamed block by block
through the KV-cache generator under the model's CP layout (the cache keeps ``rl.sink`` /
``rl.window``'s frames, default all), the trained denoising steps re-run teacher-forced on the
trainer's Balanced SP layout under the same conditioning (``rl.ar_flow``'s note). The clean
latents the reward sees are gathered from the layout's tokens. Map: docs/wan.md, "Reinforcement
learning (Flow-GRPO)". ``ar_dit``: ``ARDiTGRPOTrainer`` (caption ids, the project VAE's videos).
"""

from __future__ import annotations

import torch

from megatron_video.generation.streaming import WindowRule
from megatron_video.rl.ar_flow import ar_grpo_backward, ar_rollout

from .grpo_wan import FlowGRPOTrainer

__all__ = ["WanARGRPOTrainer", "ARDiTGRPOTrainer"]


class WanARGRPOTrainer(FlowGRPOTrainer):
    """Flow-GRPO of ``wan_ar`` on precomputed caption embeddings (CFG against empty text when
    ``rl.guidance_scale`` is not 1)."""

    def _grid(self):
        """``FlowGRPOTrainer._grid`` with the Balanced SP layout's token ids of this rank."""
        patch, grid, _, n = super()._grid()
        return patch, grid, self.batches.token_ids, n

    def _rollout(self, cond, null, mb, j: int, step: int, dtype):
        """``rl.ar_flow.ar_rollout`` of one sample's condition under the trainer's layout."""
        cfg, rl = self.config, self.config.rl
        _, grid, _, _ = self._grid()
        return ar_rollout(
            self.model,
            cond,
            self.layout,
            grid=grid[1:],
            groups=self.groups,
            group_size=rl.group_size,
            num_steps=rl.sampling_steps,
            noise_level=rl.noise_level,
            shift=cfg.diffusion.flow_shift,
            seed=rl.seed,
            position=f"{step}:{mb.indices[j]}",  # new noise every step
            null_cond=null if rl.guidance_scale != 1 else None,
            guidance_scale=rl.guidance_scale,
            rule=WindowRule(cfg.model.frames_per_block, rl.sink, rl.window),
            dtype=dtype,
        )

    def _group(self, mb, j: int, step: int, dtype):
        keep = mb.caption_mask[j : j + 1].to(mb.caption_ids.dtype)[..., None]
        text = (mb.caption_ids[j : j + 1] * keep).to(self.device, dtype)
        ro = self._rollout((text,), (torch.zeros_like(text),), mb, j, step, dtype)
        return ro, self._score(self._latents(ro.video), **self._sample(mb, j))

    def _backward(self, ro, rewards, steps, **kw):
        return ar_grpo_backward(self.model, self.reference, ro, rewards, steps, **kw)


class ARDiTGRPOTrainer(WanARGRPOTrainer):
    """Flow-GRPO of ``ar_dit`` on the caption's ids (CFG with the model's own null caption); the
    reward gets ``videos`` decoded by the project VAE, as ``grpo_dit.DiTGRPOTrainer``'s."""

    def _group(self, mb, j: int, step: int, dtype):
        from megatron_video.generation import cp_sampling as cps

        ids = mb.caption_ids[j : j + 1].to(self.device)
        mask = mb.caption_mask[j : j + 1].to(self.device)
        off = torch.zeros(1, dtype=torch.bool, device=self.device)
        ro = self._rollout((ids, mask, off), (ids, mask, ~off), mb, j, step, dtype)
        patch, grid, _, _ = self._grid()
        z = self.config.vae.latent_channels
        videos = cps.decode_tokens(self.vae, ro.video, patch, grid, z, self.latent_scale)
        return ro, self._score(
            self._latents(ro.video), videos=videos.to(torch.float64), **self._sample(mb, j)
        )
