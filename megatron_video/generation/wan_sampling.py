"""Wan through the context-parallel sampler (``generation.cp_sampling``): ``sample_wan`` partitions
the full noise with Wan's layout (a contiguous token cut per CP rank, as ``diffusers_forward``),
integrates the flow on each rank's shard with the model as the velocity, and gathers. It equals
single-process sampling with the same noise (tests/test_wan_io.py), at any CP size up to the
clip's tokens: tokens the CP size does not divide are padded to a multiple of it (the padding
attends nothing, is never attended, and is dropped after the gather). ``image`` (TI2V, Wan 2.2's
``expand_timesteps`` convention): the first latent frame is held at the image's latent with
timestep 0 at every step (tests/test_wan_ti2v.py)."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_video.attention import masks
from megatron_video.diffusion.ti2v import check_first_frame_patch
from megatron_video.generation import cp_sampling as cps
from megatron_video.models.embedders import patchify, unpatchify
from megatron_video.models.wan.interop import _check_inputs, _cp_group
from megatron_video.models.wan.model import WanModel

__all__ = ["sample_wan", "wan_velocity", "first_frame_velocity", "TIMESTEP_SCALE"]

TIMESTEP_SCALE = 1000.0  # Wan's timestep is t * num_train_timesteps (1000), t in [0, 1]


def _proj_out_to_patchify(tokens: torch.Tensor, patch, channels: int) -> torch.Tensor:
    """``[b, s, pt*ph*pw*C]`` (``proj_out`` order, the model's output) -> ``[b, s, C*pt*ph*pw]``
    (``embedders.patchify`` order, the model's input)."""
    b, s = tokens.shape[:2]
    x = tokens.reshape(b, s, *patch, channels)
    return x.permute(0, 1, 5, 2, 3, 4).reshape(b, s, -1)


def wan_velocity(model: WanModel, geometry, positions=None, attention_mask=None):
    """``velocity(x_local, t [b] (or per token [b, s_local]) in [0, 1], cond)`` of the samplers on
    patch tokens (patchify order in and out): ``cond`` is ``(text,)`` or ``(text, image)``; Wan
    predicts the flow velocity ``noise - x0`` (diffusers' convention). ``positions`` /
    ``attention_mask``: the model's (a padded contiguous cut, ``sample_wan``)."""
    cfg = model.config
    if cfg.out_channels != cfg.in_channels:
        raise ValueError(
            f"out_channels ({cfg.out_channels}) must equal in_channels ({cfg.in_channels}) to "
            f"sample (the output is the velocity of the input)"
        )

    def velocity(x, t, cond):
        image = cond[1] if len(cond) > 1 else None
        out = model(
            x,
            t * TIMESTEP_SCALE,
            cond[0],
            geometry,
            image,
            attention_mask=attention_mask,
            positions=positions,
        )
        return _proj_out_to_patchify(out, cfg.patch_size, cfg.out_channels)

    return velocity


def first_frame_velocity(velocity, image_tokens: torch.Tensor, first: torch.Tensor):
    """``velocity`` with the tokens ``first [s]`` of latent frame 0 held at ``image_tokens [b, s,
    D]`` (their input: the image; their timestep: 0; their velocity: 0, so Euler keeps them), as
    diffusers' ``WanImageToVideoPipeline`` with ``expand_timesteps=True``. The batch of ``x`` may
    be a multiple of ``image_tokens``' (classifier-free guidance runs ``[x; x]``)."""
    mask = first.to(image_tokens.device)[None, :, None]

    def held(x, t, cond):
        img = image_tokens.repeat(x.shape[0] // image_tokens.shape[0], 1, 1)
        x = torch.where(mask, img.to(x.dtype), x)
        t_tok = torch.where(mask[..., 0], torch.zeros_like(t)[:, None], t[:, None])
        return torch.where(mask, torch.zeros_like(x), velocity(x, t_tok, cond))

    return held


def _pad(tokens: torch.Tensor, T: int) -> torch.Tensor:
    """``tokens [b, n, D]`` with zero tokens appended up to ``T``."""
    pad = tokens.new_zeros(tokens.shape[0], T - tokens.shape[1], tokens.shape[2])
    return torch.cat([tokens, pad], dim=1)


def _check_image(image: torch.Tensor, noise: torch.Tensor, patch) -> None:
    want = (noise.shape[0], noise.shape[1], 1, noise.shape[3], noise.shape[4])
    if not isinstance(image, torch.Tensor) or tuple(image.shape) != want:
        got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(
            f"image ({got}) must be the first frame's latent [B, C, 1, H, W] = {list(want)} "
            f"(the VAE-encoded, normalised image, as diffusers' latent_condition; noise "
            f"{list(noise.shape)})"
        )
    check_first_frame_patch(patch, "the model's patch_size")


def sample_wan(
    model: WanModel,
    noise: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: Optional[torch.Tensor] = None,
    *,
    image: Optional[torch.Tensor] = None,
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
    guidance (the image condition is kept for the negative pass, as diffusers' I2V).

    ``image [B, C, 1, H, W]`` (TI2V, Wan 2.2): the first frame's LATENT -- the image encoded by the
    Wan VAE and normalised, ``(z - latents_mean) / latents_std`` (diffusers' ``latent_condition``);
    the first latent frame is that latent at every step, with timestep 0 (``first_frame_velocity``),
    and in the result. ``encoder_hidden_states_image`` is Wan 2.1 I2V's CLIP embedding instead."""
    b = noise.shape[0]
    if image is not None:  # before _check_inputs' collective
        _check_image(image, noise, model.config.patch_size)
    zero_t = torch.zeros(b, dtype=noise.dtype, device=noise.device)
    geometry = _check_inputs(
        model, noise, zero_t, encoder_hidden_states, encoder_hidden_states_image, padded=True
    )
    cfg, group = model.config, _cp_group(model)
    P, rank = model.cp()
    S = geometry.tokens
    T = -(-S // P) * P  # padded to a multiple of the CP size (any CP size up to the tokens)
    s = T // P
    local_ids = torch.arange(rank * s, (rank + 1) * s)
    padded = T > S  # the padding attends nothing and is never attended; any grid position
    positions = local_ids % S if padded else None
    mask = masks.packed([0, S]) if padded else None
    clip_image = () if encoder_hidden_states_image is None else (encoder_hidden_states_image,)
    cond = (encoder_hidden_states,) + clip_image
    null = None
    if negative_encoder_hidden_states is not None:
        null = (negative_encoder_hidden_states,) + clip_image
    velocity = wan_velocity(model, geometry, positions, mask)
    x = cps.partition_tokens(_pad(patchify(noise, cfg.patch_size), T), local_ids)
    if image is not None:
        first = local_ids < geometry.positions
        full = torch.cat([image, noise[:, :, 1:]], dim=2).to(noise.dtype)
        image_tokens = cps.partition_tokens(_pad(patchify(full, cfg.patch_size), T), local_ids)
        velocity = first_frame_velocity(velocity, image_tokens, first)
        x = torch.where(first.to(x.device)[None, :, None], image_tokens, x)
    out = cps.sample_flow(
        velocity,
        x,
        cond,
        null_cond=null,
        guidance_scale=guidance_scale,
        num_steps=num_steps,
        shift=shift,
        progress=progress,
    )
    full = cps.gather_tokens(out, local_ids, group, T)[:, :S]
    grid = (geometry.frames, geometry.height, geometry.width)
    return unpatchify(full, cfg.patch_size, grid, cfg.in_channels)
