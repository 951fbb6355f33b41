"""The model calls of the AR families for the samplers: one block against a KV cache
(``stream_autoregressive``'s ``block_model``) and the whole teacher-forcing sequence (the recompute
sampler ``sample_autoregressive``'s ``velocity``), for ``ar_dit`` (``ARVideoDiT``; condition
``(caption_ids, caption_mask, drop)``) and ``wan_ar`` (``WanModel``; condition ``(text,)`` or
``(text, image)``, the image being the TI2V hook). Both take patch tokens in ``embedders.patchify``
order and return the flow velocity in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layouts.geometry import VideoGeometry

__all__ = ["block_model", "sequence_velocity", "recompute_velocity", "is_wan", "rope_frames"]

WAN_TIMESTEP_SCALE = 1000.0  # Wan's timestep is t * num_train_timesteps


def _unwrap(model):
    """The model inside wrappers (Megatron's DDP, Float16Module: ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_wan(model) -> bool:
    from ..models.wan.model import WanModel

    return isinstance(_unwrap(model), WanModel)


def _call(model, x, t, cond, frames, spatial, geometry, mask):
    """The model on tokens at latent ``frames`` / ``spatial`` positions with ``mask``."""
    S = geometry.height * geometry.width
    ids = frames * S + spatial
    if is_wan(model):
        from .wan_sampling import _proj_out_to_patchify

        cfg = _unwrap(model).config
        image = cond[1] if len(cond) > 1 else None
        out = model(
            x,
            t * WAN_TIMESTEP_SCALE,
            cond[0],
            geometry,
            image,
            attention_mask=mask,
            positions=ids,
        )
        return _proj_out_to_patchify(out, cfg.patch_size, cfg.out_channels)
    return model(
        x,
        t,
        frame_positions=frames,
        token_ids=ids,
        mask=mask,
        caption_ids=cond[0],
        caption_mask=cond[1],
        geometry=geometry,
        drop=cond[2],
    )


def rope_frames(model) -> Optional[int]:
    """The latent frames the model's RoPE is defined for: Wan's table length, None (any) else."""
    return _unwrap(model).config.rope_max_seq_len if is_wan(model) else None


def _geometry(model, height: int, width: int, frames: torch.Tensor) -> VideoGeometry:
    top, limit = int(frames.max()) + 1, rope_frames(model)
    if limit is not None and top > limit:
        raise ValueError(
            f"latent frame ({top - 1}) must be below {limit} (Wan's rope_max_seq_len: its RoPE "
            f"table bounds the absolute frame positions)"
        )
    return VideoGeometry(limit or top, height, width)


def block_model(model, height: int, width: int, frames_per_block: int, cp_rank: int, cp_size: int):
    """``block_model(x, t, cond, step, j)`` of ``stream_autoregressive``: this CP rank's
    contiguous share of block ``j``'s tokens (padded to a multiple of ``cp_size``,
    ``streaming.padded_block_tokens``) at absolute latent frames ``j*nb ..``. A padding token
    takes the grid position of a real one (any: it attends nothing and is never attended).
    ``blocks=n``: the ``n`` consecutive blocks ``j .. j+n-1`` as one padded sequence (LongLive's
    one-pass re-cache, ``streaming._longlive_recache``)."""
    from .streaming import padded_block_tokens

    S = height * width

    def call(x, t, cond, step, j, blocks=1):
        n = blocks * frames_per_block * S
        s = padded_block_tokens(n, cp_size) // cp_size
        local = (cp_rank * s + torch.arange(s)) % n
        frames = j * frames_per_block + local // S
        geometry = _geometry(model, height, width, frames)
        return _call(model, x, t, cond, frames, local % S, geometry, step)

    return call


def sequence_velocity(
    model, frames: torch.Tensor, spatial: torch.Tensor, height: int, width: int, mask
):
    """``velocity(x [b, L, C], t [b, L], cond)`` of tokens at latent ``frames`` / ``spatial``
    positions ``[L]`` under the attention ``mask`` (no cache)."""
    geometry = _geometry(model, height, width, frames)

    def velocity(x, t, cond):
        return _call(model, x, t, cond, frames, spatial, geometry, mask)

    return velocity


def recompute_velocity(model, layout, rank: int, height: int, width: int, mask=None):
    """``velocity`` of the recompute sampler (``sample_autoregressive``) on the rank's
    ``[clean_r ; noisy_r]`` (``layout`` a ``BalancedSPLayout``; ``mask`` default: its
    teacher-forcing mask)."""
    from ..diffusion.teacher_forcing import TeacherForcingMask

    mask = TeacherForcingMask(layout) if mask is None else mask
    frames = layout.rope_frame_positions(rank)
    spatial = layout.local_global_ids(rank) % (height * width)
    return sequence_velocity(model, frames, spatial, height, width, mask)
