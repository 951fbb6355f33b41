"""A tiny prepared energon dataset of raw clips of mixed lengths and shapes (mp4 videos and a PNG
image) on the ``testing.mixed`` grid, a tiny causal VAE file, and the ``data.buckets`` training
config that reads the dataset raw (``data.source: energon``; tests/test_train_raw_mixed.py)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["RAW_CLIPS", "write_raw_mixed_dataset", "write_tiny_vae", "tiny_raw_mixed_config"]

# (folder, count, raw frames, height, width) in pixels; the grid's buckets are 24x24 (3x3 latent),
# 16x24 (2x3) and 24x16 (3x2), 1..4 latent frames (13 raw at most: longer clips are cut)
RAW_CLIPS = (
    ("long", 2, 13, 24, 24),  # 4 x 3 x 3 latent: 36 tokens
    ("wide", 1, 9, 16, 24),  # 3 x 2 x 3
    ("tall", 1, 17, 32, 24),  # cut to 13 frames; 4 x 3 x 2 (resized to 32 x 24, cropped)
    ("short", 1, 5, 24, 24),  # 2 x 3 x 3
)


def write_raw_mixed_dataset(root, image: bool = True) -> Path:
    """Videos of ``RAW_CLIPS`` (H.264 mp4, ``data.energon_video.write_procedural_videos``) and a
    24 x 32 PNG image with sidecar captions, prepared as an energon dataset at ``root / "ds"``."""
    import numpy as np
    from PIL import Image

    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    root = Path(root)
    src = root / "src"
    for seed, (name, n, frames, h, w) in enumerate(RAW_CLIPS):
        write_procedural_videos(src / name, n, num_frames=frames, height=h, width=w, seed=seed)
    if image:
        g = np.random.default_rng(7)
        yy, xx = np.mgrid[0:24, 0:32]
        rgb = np.stack([yy * 10, xx * 7, (yy + xx) * 4], -1) + g.integers(0, 20, (24, 32, 3))
        (src / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(src / "img" / "photo.png")
        (src / "img" / "photo.txt").write_text("a photo of a gradient")
    prepare_dataset(src, root / "ds")
    return root / "ds"


def write_tiny_vae(path, base_channels: int = 4, latent_channels: int = 4, seed: int = 0) -> Path:
    """A randomly initialised ``models.vae.CausalVideoVAE`` in ``vae_stage.load_vae``'s format
    (latent scale 0.5)."""
    from megatron_video.models.vae import CausalVideoVAE

    torch.manual_seed(seed)
    vae = CausalVideoVAE(3, latent_channels, base_channels).eval()
    key = {"latent_channels": latent_channels, "base_channels": base_channels}
    torch.save({"state_dict": vae.state_dict(), "latent_scale": 0.5, "key": key}, path)
    return Path(path)


def tiny_raw_mixed_config(family: str, root, dataset, vae_file, budget=None, **parallel):
    """``testing.mixed.tiny_mixed_config`` reading ``dataset`` raw (``data.source: energon``)
    with the VAE ``vae_file``."""
    from .mixed import tiny_mixed_config

    cfg = tiny_mixed_config(family, root, None, budget=budget, **parallel)
    cfg.data.source, cfg.data.path, cfg.data.shards = "energon", str(dataset), None
    cfg.vae.weights = str(vae_file)
    return cfg
