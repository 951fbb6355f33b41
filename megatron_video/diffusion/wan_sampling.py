"""Wan through the context-parallel sampler (``diffusion.cp_sampling``): ``sample_wan`` partitions
the full noise with Wan's layout (a contiguous token cut per CP rank, as ``diffusers_forward``),
integrates the flow on each rank's shard with the model as the velocity, and gathers. It equals
single-process sampling with the same noise (tests/test_wan_io.py)."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_video.diffusion import cp_sampling as cps
from megatron_video.models.embedders import patchify, unpatchify
from megatron_video.models.wan.interop import _check_inputs, _cp_group
from megatron_video.models.wan.model import WanModel

__all__ = ["sample_wan", "wan_velocity", "TIMESTEP_SCALE"]

TIMESTEP_SCALE = 1000.0  # Wan's timestep is t * num_train_timesteps (1000), t in [0, 1]


def _proj_out_to_patchify(tokens: torch.Tensor, patch, channels: int) -> torch.Tensor:
    """``[b, s, pt*ph*pw*C]`` (``proj_out`` order, the model's output) -> ``[b, s, C*pt*ph*pw]``
    (``embedders.patchify`` order, the model's input)."""
    b, s = tokens.shape[:2]
    x = tokens.reshape(b, s, *patch, channels)
    return x.permute(0, 1, 5, 2, 3, 4).reshape(b, s, -1)


def wan_velocity(model: WanModel, geometry):
    """``velocity(x_local, t [b] in [0, 1], cond)`` of the samplers on patch tokens (patchify
    order in and out): ``cond`` is ``(text,)`` or ``(text, image)``; Wan predicts the flow
    velocity ``noise - x0`` (diffusers' convention)."""
    cfg = model.config
    if cfg.out_channels != cfg.in_channels:
        raise ValueError(
            f"out_channels ({cfg.out_channels}) must equal in_channels ({cfg.in_channels}) to "
            f"sample (the output is the velocity of the input)"
        )

    def velocity(x, t, cond):
        image = cond[1] if len(cond) > 1 else None
        out = model(x, t * TIMESTEP_SCALE, cond[0], geometry, image)
        return _proj_out_to_patchify(out, cfg.patch_size, cfg.out_channels)

    return velocity


def sample_wan(
    model: WanModel,
    noise: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: Optional[torch.Tensor] = None,
    *,
    negative_encoder_hidden_states: Optional[torch.Tensor] = None,
    guidance_scale: float = 1.0,
    num_steps: int = 50,
    shift: float = 1.0,
    progress: bool = False,
) -> torch.Tensor:
    """Flow-matching Euler sampling (``cp_sampling.sample_flow``) of ``model`` (PP = 1) under its
    CP layout. ``noise [B, C, F, H, W]`` and the text (and image) embeddings are the full tensors,
    identical on every rank (collective); the full latents ``[B, C, F, H, W]`` come back on every
    rank. ``negative_encoder_hidden_states`` with ``guidance_scale != 1``: classifier-free
    guidance (the image condition is kept for the negative pass, as diffusers' I2V)."""
    b = noise.shape[0]
    zero_t = torch.zeros(b, dtype=noise.dtype, device=noise.device)
    geometry = _check_inputs(
        model, noise, zero_t, encoder_hidden_states, encoder_hidden_states_image
    )
    cfg, group = model.config, _cp_group(model)
    P, rank = model.cp()
    s = geometry.tokens // P
    local_ids = torch.arange(rank * s, (rank + 1) * s)
    image = () if encoder_hidden_states_image is None else (encoder_hidden_states_image,)
    cond = (encoder_hidden_states,) + image
    null = None
    if negative_encoder_hidden_states is not None:
        null = (negative_encoder_hidden_states,) + image
    out = cps.sample_flow(
        wan_velocity(model, geometry),
        cps.partition_tokens(patchify(noise, cfg.patch_size), local_ids),
        cond,
        null_cond=null,
        guidance_scale=guidance_scale,
        num_steps=num_steps,
        shift=shift,
        progress=progress,
    )
    full = cps.gather_tokens(out, local_ids, group, geometry.tokens)
    grid = (geometry.frames, geometry.height, geometry.width)
    return unpatchify(full, cfg.patch_size, grid, cfg.in_channels)
