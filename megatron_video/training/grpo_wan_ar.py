"""``train.objective: grpo`` for ``wan_ar``: the step of ``training.grpo_wan.FlowGRPOTrainer`` with
the AR binding (``rl.ar_flow``): per caption ``rl.group_size`` rollouts streamed block by block
through the KV-cache generator under the model's CP layout (the window covers the trained video),
the trained denoising steps re-run teacher-forced on the trainer's Balanced SP layout. The clean
latents the reward sees are gathered from the layout's tokens. Map: docs/wan.md, "Reinforcement
learning (Flow-GRPO)".
"""

from __future__ import annotations

import torch

from megatron_video.rl.ar_flow import ar_grpo_backward, ar_rollout

from .grpo_wan import FlowGRPOTrainer

__all__ = ["WanARGRPOTrainer"]


class WanARGRPOTrainer(FlowGRPOTrainer):
    """Flow-GRPO of ``wan_ar`` on precomputed caption embeddings (CFG against empty text when
    ``rl.guidance_scale`` is not 1)."""

    def _grid(self):
        """``FlowGRPOTrainer._grid`` with the Balanced SP layout's token ids of this rank."""
        patch, grid, _, n = super()._grid()
        return patch, grid, self.batches.token_ids, n

    def _group(self, mb, j: int, step: int, dtype):
        cfg, rl = self.config, self.config.rl
        _, grid, _, _ = self._grid()
        keep = mb.caption_mask[j : j + 1].to(mb.caption_ids.dtype)[..., None]
        text = (mb.caption_ids[j : j + 1] * keep).to(self.device, dtype)
        ro = ar_rollout(
            self.model,
            (text,),
            self.layout,
            grid=grid[1:],
            groups=self.groups,
            group_size=rl.group_size,
            num_steps=rl.sampling_steps,
            noise_level=rl.noise_level,
            shift=cfg.diffusion.flow_shift,
            seed=rl.seed,
            position=f"{step}:{mb.indices[j]}",  # new noise every step
            null_cond=(torch.zeros_like(text),) if rl.guidance_scale != 1 else None,
            guidance_scale=rl.guidance_scale,
            dtype=dtype,
        )
        return ro, self._score(self._latents(ro.video), **self._sample(mb, j))

    def _backward(self, ro, rewards, steps, **kw):
        return ar_grpo_backward(self.model, self.reference, ro, rewards, steps, **kw)
