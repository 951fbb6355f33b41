"""The short VAE stage: train the project's small causal video VAE once and cache its weights.

A few hundred Adam steps on procedural videos (``megatron-video train-vae``, or automatically
before the first run), single process, deterministic; cached under ``vae.cache_dir`` keyed by a
hash of everything that affects it, with ``latent_scale`` (1 / std of the latent means), which maps
latents to unit variance for the diffusion model.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional, Tuple

import torch
from tqdm.auto import tqdm

from megatron_video.data.synthetic import ProceduralVideoDataset
from megatron_video.models.vae import CausalVideoVAE

from .config import Config

__all__ = ["vae_cache_path", "train_vae", "load_vae", "ensure_vae"]

_VAE_DATA_SEED = 9173  # the VAE sees its own sample stream, not the DiT's


def _key(config: Config) -> dict:
    v, d = config.vae, config.data
    return dict(
        latent_channels=v.latent_channels,
        base_channels=v.base_channels,
        train_steps=v.train_steps,
        batch_size=v.batch_size,
        lr=v.lr,
        kl_weight=v.kl_weight,
        foreground_weight=v.foreground_weight,
        num_frames=d.num_frames,
        height=d.height,
        width=d.width,
        version=3,
    )


def vae_cache_path(config: Config) -> Path:
    """Where the cached VAE for ``config`` lives (or ``vae.weights`` when given)."""
    if config.vae.weights:
        return Path(config.vae.weights)
    digest = hashlib.sha1(json.dumps(_key(config), sort_keys=True).encode()).hexdigest()[:12]
    return Path(config.vae.cache_dir) / f"vae-{digest}.pt"


def _loss(vae: CausalVideoVAE, video: torch.Tensor, kl_weight: float, fg_weight: float):
    """Foreground-weighted reconstruction of the posterior MEAN + a small KL term.

    The DiT trains on posterior means, so the decoder learns to decode means (sampling the
    posterior in this short stage drowns the colour information in noise for hundreds of steps).
    The procedural clips are mostly background: a plain squared error is minimised early by
    painting the background alone, so pixels of the shapes weigh ``1 + fg_weight``."""
    mean, logvar = vae.split_moments(vae.encoder(video))
    recon = vae.decoder(mean)
    foreground = (video.amax(dim=1, keepdim=True) > -0.9).to(video.dtype)
    err = (recon - video) ** 2
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
    return (err * (1 + fg_weight * foreground)).mean() + kl_weight * kl, float(err.detach().mean())


def train_vae(config: Config, path: Path, progress: bool = True) -> Path:
    """Train the VAE per ``config.vae`` on procedural videos and save it to ``path`` (atomically)."""
    v, d = config.vae, config.data
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_VAE_DATA_SEED)
        vae = CausalVideoVAE(3, v.latent_channels, v.base_channels)
    data = ProceduralVideoDataset(
        1 << 30, num_frames=d.num_frames, height=d.height, width=d.width, seed=_VAE_DATA_SEED
    )
    opt = torch.optim.Adam(vae.parameters(), lr=v.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, max(1, v.train_steps), eta_min=v.lr * 0.05
    )
    history, start = [], time.time()
    bar = tqdm(range(v.train_steps), desc="vae", disable=not progress, dynamic_ncols=True)
    for step in bar:
        video = torch.stack([data[step * v.batch_size + i]["video"] for i in range(v.batch_size)])
        loss, recon = _loss(vae, video, v.kl_weight, v.foreground_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(recon)
        bar.set_postfix(recon=f"{recon:.4f}")
    with torch.no_grad():  # latent scale from fresh samples
        probe = torch.stack([data[(1 << 29) + i]["video"] for i in range(8)])
        std = float(vae.encode(probe).std())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(
        {
            "state_dict": vae.state_dict(),
            "latent_scale": 1.0 / max(std, 1e-6),
            "key": _key(config),
            "recon_history": history,
            "train_seconds": time.time() - start,
        },
        tmp,
    )
    os.replace(tmp, path)
    return path


def load_vae(path: Path, config: Optional[Config] = None) -> Tuple[CausalVideoVAE, float]:
    """``(vae in eval mode, latent_scale)`` from a file written by ``train_vae``."""
    try:
        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything that is not plain tensors / containers
        raise ValueError(
            f"vae.weights ({str(path)!r}) must be a weights-only torch file (refused, nothing "
            f"executed): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    key = blob.get("key", {})
    lc = key.get("latent_channels", config.vae.latent_channels if config else 4)
    bc = key.get("base_channels", config.vae.base_channels if config else 16)
    if config is not None and (lc, bc) != (config.vae.latent_channels, config.vae.base_channels):
        raise ValueError(
            f"vae.weights ({path}) hold a VAE with latent_channels={lc}, base_channels={bc}; "
            f"the config asks for {config.vae.latent_channels}, {config.vae.base_channels}"
        )
    vae = CausalVideoVAE(3, lc, bc)
    vae.load_state_dict(blob["state_dict"])
    vae.eval().requires_grad_(False)
    return vae, float(blob["latent_scale"])


def ensure_vae(config: Config, progress: bool = True) -> Path:
    """The VAE file for ``config``: the given weights, the cache, or a freshly trained one."""
    path = vae_cache_path(config)
    if path.is_file():
        return path
    if config.vae.weights:
        raise ValueError(f"vae.weights ({config.vae.weights!r}) must be an existing file")
    if progress:
        print(
            f"[megatron-video] training the VAE once ({config.vae.train_steps} steps), cached at {path}",
            flush=True,
        )
    return train_vae(config, path, progress=progress)
