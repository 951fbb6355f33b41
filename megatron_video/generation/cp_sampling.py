"""Context-parallel sampling: partition the noise with the model's layout, denoise in parallel,
gather (``sample_edm`` / ``sample_flow`` for full-sequence models, ``sample_autoregressive`` for the
teacher-forcing AR DiT, ``decode_tokens``). The result equals single-process sampling with the same
noise. Design: docs/architecture.md, "Capabilities" 4.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..diffusion.cfg import guided_denoise
from ..diffusion.edm import edm_scalings, expand_like
from ..diffusion.samplers import (
    edm_euler_sampler,
    edm_heun_sampler,
    flow_euler_sampler,
    flow_timesteps,
)
from ..parallel import comm

__all__ = [
    "partition_tokens",
    "gather_tokens",
    "edm_denoiser",
    "sample_edm",
    "sample_flow",
    "sample_autoregressive",
    "decode_tokens",
]


def partition_tokens(x: Tensor, local_ids: Tensor) -> Tensor:
    """This rank's tokens ``x[:, local_ids]`` of a global ``[b, N, ...]`` tensor.

    Each CP rank holds the tokens ``local_ids`` (global ids in the sample's frame-major token
    sequence) of the model's layout: a contiguous slice for VideoDiT / ST-DiT, the Balanced SP
    frames for the AR DiT. The noise is drawn for the whole sequence (same seed everywhere) and
    partitioned; the samplers run elementwise on the local shard with a model that works on local
    shards (its attention communicates), and ``gather_tokens`` reassembles the sequence for VAE
    decoding. Model calls are collective, so every rank makes the same calls in the same order
    (deterministic schedules; no per-rank early exit).
    """
    return x.index_select(1, local_ids.to(x.device))


def gather_tokens(local: Tensor, local_ids: Tensor, group, num_tokens: int) -> Tensor:
    """Inverse of ``partition_tokens`` over ``group``: ``[b, s, ...]`` shards -> ``[b, N, ...]``.

    The ranks' id lists are gathered too (no layout is assumed); they must partition
    ``range(num_tokens)``. Every rank gets the full tensor.
    """
    ids = local_ids.to(torch.int64).cpu()
    if group is None or comm.group_size(group) == 1:
        all_x, all_ids = local, ids
    else:
        comm.check_same_shape({"tokens": local}, group, where="gather_tokens")
        all_x = comm.all_gather_cat(local.contiguous(), group, dim=1, tag="sample.gather")
        all_ids = comm.all_gather_cat(ids, group, dim=0, tag="sample.gather_ids")
    if sorted(all_ids.tolist()) != list(range(num_tokens)):
        raise ValueError(f"local_ids of the group must partition range(num_tokens={num_tokens})")
    out = torch.empty(
        (local.shape[0], num_tokens) + tuple(local.shape[2:]),
        dtype=local.dtype,
        device=local.device,
    )
    out[:, all_ids.to(local.device)] = all_x
    return out


def edm_denoiser(net: Callable[[Tensor, Tensor, Any], Tensor], sigma_data: float):
    """EDM preconditioning around a raw network ``net(c_in*x, c_noise [b], cond)``."""

    def denoise(x: Tensor, sigma: Tensor, cond: Any) -> Tensor:
        c_skip, c_out, c_in, c_noise = edm_scalings(sigma.to(torch.float64), sigma_data)
        c_skip, c_out, c_in = (
            expand_like(c, x, "sigma").to(x.dtype) for c in (c_skip, c_out, c_in)
        )
        return c_skip * x + c_out * net(c_in * x, c_noise.to(x.dtype), cond).to(x.dtype)

    return denoise


def _guided(fn, null_cond, guidance_scale: float):
    if null_cond is None or guidance_scale == 1.0:
        return fn
    return lambda x, s, cond: guided_denoise(fn, x, s, cond, null_cond, guidance_scale)


def sample_edm(
    net: Callable[[Tensor, Tensor, Any], Tensor],
    noise_local: Tensor,
    cond: Any,
    *,
    null_cond: Any = None,
    guidance_scale: float = 1.0,
    sigma_data: float = 0.5,
    sampler: str = "heun",
    num_steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    progress: bool = False,
) -> Tensor:
    """EDM sampling on this rank's shard; ``net`` is the raw network on local tokens."""
    if sampler not in ("heun", "euler"):
        raise ValueError(f"sampler ({sampler!r}) must be 'heun' or 'euler'")
    fn = _guided(edm_denoiser(net, sigma_data), null_cond, guidance_scale)
    run = edm_heun_sampler if sampler == "heun" else edm_euler_sampler
    return run(
        fn,
        noise_local,
        cond,
        num_steps=num_steps,
        sigma_min=sigma_min,
        sigma_max=sigma_max,
        progress=progress,
    )


def sample_flow(
    velocity: Callable[[Tensor, Tensor, Any], Tensor],
    noise_local: Tensor,
    cond: Any,
    *,
    null_cond: Any = None,
    guidance_scale: float = 1.0,
    num_steps: int = 32,
    shift: float = 1.0,
    progress: bool = False,
) -> Tensor:
    """Flow-matching Euler sampling on this rank's shard."""
    return flow_euler_sampler(
        _guided(velocity, null_cond, guidance_scale),
        noise_local,
        cond,
        num_steps=num_steps,
        shift=shift,
        progress=progress,
    )


def sample_autoregressive(
    velocity: Callable[[Tensor, Tensor, Any], Tensor],
    layout,
    rank: int,
    noise_local: Tensor,
    cond: Any,
    *,
    null_cond: Any = None,
    guidance_scale: float = 1.0,
    num_steps: int = 16,
    shift: float = 1.0,
    progress: bool = False,
) -> Tensor:
    """Generate this rank's clean frames block by block with the teacher-forcing AR model.

    ``velocity(x [b, L, C], t [b, L], cond)`` runs the model on the local sequence
    ``[clean_r ; noisy_r]`` (``L = layout.local_len``); ``noise_local [b, L/2, C]`` is the rank's
    share of the global noise. Returns the rank's generated clean tokens ``[b, L/2, C]``.

    Block by block on the Balanced SP layout: while block ``j`` is denoised, its noisy tokens see
    only clean blocks ``< j`` (the teacher-forcing mask), so the clean half is filled block by block
    with the finished frames; other noisy blocks are ignored by the mask and stay pure noise.
    """
    half = layout.local_len // 2
    if noise_local.dim() != 3 or noise_local.shape[1] != half:
        raise ValueError(
            f"noise_local shape ({tuple(noise_local.shape)}) must be [b, L/2 = {half}, C]"
        )
    fn = _guided(velocity, null_cond, guidance_scale)
    b = noise_local.shape[0]
    frames = layout.rope_frame_positions(rank)[half:]  # global frame of each noisy token
    blocks = frames // layout.frames_per_block
    clean = torch.zeros_like(noise_local)
    noisy = noise_local.clone()
    ts = [float(v) for v in flow_timesteps(num_steps, shift)]
    total = layout.num_blocks * num_steps
    bar = tqdm(total=total, disable=not progress, desc="sampling", leave=False)
    for j in range(layout.num_blocks):
        mine = (blocks == j).to(noise_local.device)  # may be empty on this rank
        for i in range(num_steps):
            t_noisy = torch.where(mine, ts[i], 1.0).to(noise_local.dtype).expand(b, half)
            t = torch.cat([torch.zeros_like(t_noisy), t_noisy], dim=1)
            v = fn(torch.cat([clean, noisy], dim=1), t, cond)[:, half:]
            noisy = torch.where(mine[None, :, None], noisy + (ts[i + 1] - ts[i]) * v, noisy)
            bar.update(1)
        clean = torch.where(mine[None, :, None], noisy, clean)
    bar.close()
    return clean


def decode_tokens(
    vae, tokens: Tensor, patch, grid, latent_channels: int, latent_scale: float
) -> Tensor:
    """Full token sequence ``[b, N, C*pt*ph*pw]`` -> video ``[b, 3, T, H, W]`` in ``[-1, 1]``."""
    from ..models.embedders import unpatchify

    latents = unpatchify(tokens, patch, grid, latent_channels) / latent_scale
    with torch.no_grad():
        return vae.decode(latents.to(next(vae.parameters()).dtype)).clamp(-1.0, 1.0)
