"""``train.objective: grpo`` for ``video_dit`` with ``diffusion.objective: flow``: the step of
``training.grpo_wan.FlowGRPOTrainer`` with the DiT's binding (``rl.video_dit``): rollouts from the
caption's ids under the model's CP layout, decoded by the project VAE, so a reward may score the
videos (``rl.rewards.dominant_colour``: the procedural clips' colour against the caption's) or the
latents. Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import torch

from megatron_video.generation import cp_sampling as cps
from megatron_video.rl.video_dit import dit_grpo_backward, dit_rollout, dit_tokens

from .grpo_wan import FlowGRPOTrainer

__all__ = ["DiTGRPOTrainer"]


class DiTGRPOTrainer(FlowGRPOTrainer):
    """Flow-GRPO of the project's DiT; the reward gets ``videos`` (decoded, ``[G, 3, T, H, W]``
    in ``[-1, 1]``) beside the latents."""

    def _group(self, mb, j: int, step: int, dtype):
        cfg, rl = self.config, self.config.rl
        patch, grid, ids, _ = self._grid()
        dr = dit_rollout(
            self.model,
            mb.caption_ids[j : j + 1].to(self.device),
            mb.caption_mask[j : j + 1].to(self.device),
            self.geometry,
            ids,
            self.groups.cp_group,
            group_size=rl.group_size,
            num_steps=rl.sampling_steps,
            noise_level=rl.noise_level,
            shift=cfg.diffusion.flow_shift,
            seed=rl.seed,
            position=f"{step}:{mb.indices[j]}",  # new noise every step
            guidance_scale=rl.guidance_scale,
            dtype=dtype,
        )
        tokens = dit_tokens(dr)
        videos = cps.decode_tokens(
            self.vae, tokens, patch, grid, cfg.vae.latent_channels, self.latent_scale
        ).to(torch.float64)
        return dr, self._score(self._latents(tokens), videos=videos, **self._sample(mb, j))

    def _backward(self, dr, rewards, steps, **kw):
        return dit_grpo_backward(self.model, self.reference, dr, rewards, steps, **kw)
