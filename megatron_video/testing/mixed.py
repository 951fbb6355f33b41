"""Tiny mixed-shape data for tests and the ``mixed_tiny`` example (nothing encoded): latent shards
in ``precompute``'s format where every clip has its own ``(frames, height, width)`` on a tiny
``data.buckets`` grid (images are one-frame clips), and the matching training config."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "MIXED_GRID",
    "MIXED_LATENTS",
    "WAN_MIXED_GRID",
    "WAN_MIXED_LATENTS",
    "write_mixed_latent_shards",
    "write_tiny_mixed_shards",
    "tiny_mixed_config",
    "packed_maker",
]

# the tiny grid: latent h x w in {3x3, 2x3, 3x2} (area 9), 1..4 latent frames (13 raw at most)
MIXED_GRID = dict(
    area=9,
    area_tolerance=0.5,
    aspect_ratios=["1:1", "3:2", "2:3"],
    max_frames=13,
    tokens_per_microbatch=48,
)
# latent (frames, height, width) of the clips, cycled; frames 1 = an image
MIXED_LATENTS: Tuple[Tuple[int, int, int], ...] = (
    (4, 3, 3),
    (1, 2, 3),
    (2, 3, 2),
    (3, 2, 3),
    (1, 3, 3),
    (2, 2, 3),
    (4, 3, 2),
    (3, 3, 3),
    (1, 3, 2),
)

# Wan (patch 1 x 2 x 2): latent h x w in {4x4, 4x6, 6x4} (area 24), 1..4 latent frames
WAN_MIXED_GRID = dict(MIXED_GRID, area=24)
WAN_MIXED_LATENTS: Tuple[Tuple[int, int, int], ...] = (
    (4, 4, 6),
    (1, 4, 4),
    (2, 6, 4),
    (3, 4, 4),
    (1, 6, 4),
    (2, 4, 6),
    (4, 4, 4),
    (3, 6, 4),
    (1, 4, 6),
)


def write_mixed_latent_shards(
    out_dir,
    num_samples: int = 12,
    latent_channels: int = 4,
    shapes: Sequence[Tuple[int, int, int]] = MIXED_LATENTS,
    text: Optional[Tuple[int, int]] = None,
    seed: int = 0,
    samples_per_shard: int = 4,
) -> str:
    """``num_samples`` clips of latent shapes ``shapes`` (cycled) in ``precompute``'s shard format
    (``<key>.latent.pth``, caption, meta with the latent shape); ``text = (caption_len, dim)``
    adds caption embeddings. Latents are smooth random fields (a learnable signal). Returns
    ``out_dir``."""
    from megatron_video.training.precompute import LatentShardWriter

    g = torch.Generator().manual_seed(seed)
    with LatentShardWriter(out_dir, samples_per_shard=samples_per_shard) as w:
        for i in range(num_samples):
            F, h, wd = shapes[i % len(shapes)]
            base = torch.randn(latent_channels, 1, 1, 1, generator=g)
            lat = base + 0.3 * torch.randn(latent_channels, F, h, wd, generator=g)
            tensors = dict(latent=lat)
            if text is not None:
                L, D = text
                mask = torch.arange(L) < 1 + i % L
                tensors.update(text_emb=torch.randn(L, D, generator=g) * mask[:, None])
                tensors.update(text_mask=mask)
            meta = dict(latent_shape=[latent_channels, F, h, wd], tokens=F * h * wd)
            w.write(f"m{i:04d}", tensors, f"clip {i} of {F} frames", meta)
    return str(out_dir)


def tiny_mixed_config(family: str, tmp, shards, budget: Optional[int] = None, **parallel):
    """A tiny ``data.buckets`` job on ``write_mixed_latent_shards``' clips, flow matching, fp32 on
    CPU: ``video_dit`` / ``ar_dit`` (2 layers of width 48, patch 1, frames per block 1, the
    ``MIXED_LATENTS`` shapes) or ``wan`` / ``wan_ar`` (the tiny Wan of ``testing.wan``, patch
    1 x 2 x 2, text embeddings ``[8, 32]``, the ``WAN_MIXED_LATENTS`` shapes)."""
    from megatron_video.training.config import config_from_dict

    from .configs import TINY_TRAIN

    wan = _is_wan(family)
    grid = dict(WAN_MIXED_GRID if wan else MIXED_GRID)
    if budget is not None:
        grid["tokens_per_microbatch"] = budget
    model = dict(family=family, num_layers=2, num_attention_heads=4, frames_per_block=1)
    if wan:
        model.update(hidden_size=64, ffn_hidden_size=96, patch_size=[1, 2, 2])
        text = dict(text_embed_dim=TEXT[1], caption_len=TEXT[0], num_frames=13, height=32, width=32)
    else:
        model.update(hidden_size=48, lora_rank=8, patch_size=[1, 1, 1])
        text = dict(num_frames=13, height=16, width=16)
    return config_from_dict(
        dict(
            model=model,
            parallel=dict(parallel),
            data=dict(source="shards", shards=str(shards), buckets=grid, **text),
            vae=dict(base_channels=4, train_steps=1, batch_size=1, cache_dir=f"{tmp}/cache"),
            diffusion=dict(objective="flow", cfg_dropout=0.2),
            train=dict(TINY_TRAIN, micro_batch_size=1),
            output=f"{tmp}/run",
        )
    )


TEXT = (8, 32)  # (caption_len, text_embed_dim) of the Wan clips


def write_tiny_mixed_shards(family: str, out_dir, num_samples: int = 12, seed: int = 0) -> str:
    """``write_mixed_latent_shards`` with the family's shapes (and text embeddings for Wan)."""
    wan = _is_wan(family)
    return write_mixed_latent_shards(
        out_dir,
        num_samples,
        shapes=WAN_MIXED_LATENTS if wan else MIXED_LATENTS,
        text=TEXT if wan else None,
        seed=seed,
    )


def _is_wan(family: str) -> bool:
    """Whether ``model.family`` is a Wan family (its transformer, text embeddings, patch 1x2x2)."""
    from megatron_video.training.families import WanFamily, get_family

    return isinstance(get_family(family), WanFamily)


def packed_maker(
    cfg,
    *,
    latent_scale: float = 1.0,
    cp_rank: int = 0,
    U: int = 1,
    R: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    log=None,
    store=None,
    source=None,
):
    """A ``PackedBatchMaker`` of ``cfg`` for CP rank ``cp_rank`` of ``U x R`` (the family's packed
    kind), as the tests of packed training build it without process groups."""
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.packed import PackedBatchMaker
    from megatron_video.training.families import get_family

    coords = RankCoords(
        dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank, ulysses_size=U, ring_size=R
    )
    return PackedBatchMaker(
        cfg,
        coords,
        kind=get_family(cfg.model.family).packed_kind,
        latent_scale=latent_scale,
        log=log,
        store=store,
        source=source,
    )
