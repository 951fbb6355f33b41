"""The halo a run encodes with (``vae.halo_latents``): an integer is the user's choice (as
LongLive's ``vae_halo_latents``), ``auto`` the smallest exact halo: from the encoder's declared
causal ops (the project's VAE), else probed once (``models.vae_halo_probe.probe_halo``) and cached
next to the VAE (``<vae.diffusers>/megatron_video_halo.json``). An integer below the exact halo is
legal; its measured encoding error (``halo_error``) is printed once. At SP size 1 every window
starts at frame 0: nothing is probed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

from ..checks import check_nonneg_int
from .config import Config, vae_geometry

__all__ = ["choose_halo", "exact_halo", "HALO_CACHE_FILE"]

HALO_CACHE_FILE = "megatron_video_halo.json"
_REPORTED: set = set()


def _requested(config: Config, requested) -> Optional[int]:
    """The user's integer, or None for ``auto`` (``vae.halo_latents`` null or "auto")."""
    req = config.vae.halo_latents if requested is None else requested
    if req is None or req == "auto":
        return None
    if isinstance(req, bool) or not isinstance(req, int):
        raise ValueError(f"vae.halo_latents ({req!r}) must be 'auto' or an integer >= 0")
    return check_nonneg_int("vae.halo_latents", req)


def _cache_key(folder: Path, temporal_stride: int) -> str:
    text = (folder / "config.json").read_text()
    return hashlib.sha1(f"{text}|{temporal_stride}|causal".encode()).hexdigest()


def exact_halo(config: Config, encoder, log: Callable[[str], None] = print) -> int:
    """The smallest exact halo of ``encoder`` (the VAE of ``config``): declared causal ops, or a
    probe cached in ``<vae.diffusers>/megatron_video_halo.json`` (keyed by its config.json)."""
    from megatron_video.models.vae_halo_probe import _HALO_CACHE, _config_key, encoder_halo

    st = vae_geometry(config).temporal_stride
    folder = Path(config.vae.diffusers) if config.vae.diffusers else None
    if folder is None:
        return encoder_halo(encoder, temporal_stride=st)
    path, key = folder / HALO_CACHE_FILE, _cache_key(folder, st)
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if isinstance(cached.get(key), dict) and isinstance(cached[key].get("halo"), int):
        return cached[key]["halo"]
    log(f"[megatron-video] probing the VAE's exact halo ({folder}; once, cached) ...")
    h = encoder_halo(encoder, temporal_stride=st)
    probe = _HALO_CACHE.get(_config_key(encoder, st, True))
    cached[key] = dict(halo=h, lookback=None if probe is None else probe.lookback)
    try:  # atomic: ranks probing at once leave one whole file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only VAE folder: probed again next time, said so
        log(f"[megatron-video] halo probe not cached ({path}: {e})")
    log(f"[megatron-video] exact halo of {folder}: {h} latent(s)")
    return h


def choose_halo(
    config: Config,
    encoder,
    sp_size: Optional[int],
    requested=None,
    log: Callable[[str], None] = print,
) -> int:
    """The halo latents for ``sp_size`` windows per clip (None: any latent range, as training's
    clip sources ask; ``requested`` overrides ``vae.halo_latents``). SP 1: the user's integer or
    0, nothing probed (the one window starts at frame 0). An integer below the exact halo: its
    measured encoding error printed once."""
    from megatron_video.models.vae_halo_probe import halo_error

    req = _requested(config, requested)
    if sp_size is not None and sp_size <= 1:
        return 0 if req is None else req
    need = exact_halo(config, encoder, log)
    if req is None:
        return need
    if req < need and (config.vae.diffusers, req, need) not in _REPORTED:
        _REPORTED.add((config.vae.diffusers, req, need))
        st = vae_geometry(config).temporal_stride
        err = halo_error(encoder, req, st, num_latents=need + 3)
        log(
            f"[megatron-video] vae.halo_latents ({req}) is below the exact halo ({need}): "
            f"windowed latents differ from the full-clip encoding by up to {err:.3g} (max abs, "
            f"float64 probe clip in [-1, 1]); vae.halo_latents={need} or 'auto' is exact"
        )
    return req
