"""What a video VAE does to a clip's shape, read from the VAE itself, never guessed: the video's
channels, the temporal and spatial strides (pixels per latent, any patchify inside the VAE
included) and the latent channels. The project's causal VAE (``models.vae``): 3 channels, 4x
temporal, 8x spatial. A diffusers ``AutoencoderKLWan``: its config (Wan 2.1: ``in_channels`` 3,
``scale_factor_temporal`` 4, ``scale_factor_spatial`` 8, ``z_dim`` 16; Wan 2.2:
``is_residual``, ``patch_size`` 2 -> ``in_channels`` 12 = 3 RGB x 2 x 2 patchified inside the
VAE, 16x spatial, ``z_dim`` 48), checked against its own architecture.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from .vae import SPATIAL_STRIDE, TEMPORAL_STRIDE

__all__ = [
    "VAEGeometry",
    "project_vae_geometry",
    "wan_vae_geometry",
    "wan_vae_folder_geometry",
    "module_geometry",
]


@dataclass(frozen=True)
class VAEGeometry:
    """``video_channels`` in, ``latent_channels`` out; latent frame ``k`` <- raw frames
    ``st*k-st+1 .. st*k`` (causal first frame), ``spatial_stride`` pixels per latent per axis;
    ``patch_size``: the VAE's own pixel patchify (1 when none, already inside ``spatial_stride``)."""

    video_channels: int
    temporal_stride: int
    spatial_stride: int
    latent_channels: int
    patch_size: int = 1
    source: str = "the project's causal VAE"


def project_vae_geometry(latent_channels: int) -> VAEGeometry:
    return VAEGeometry(3, TEMPORAL_STRIDE, SPATIAL_STRIDE, int(latent_channels))


@functools.lru_cache(maxsize=None)
def _wan_defaults() -> dict:
    """diffusers' own defaults of ``AutoencoderKLWan`` (a config.json may omit keys)."""
    from diffusers import AutoencoderKLWan

    sig = inspect.signature(AutoencoderKLWan.__init__)
    return {k: p.default for k, p in sig.parameters.items() if p.default is not p.empty}


def wan_vae_geometry(config: Mapping, name: str = "vae.diffusers") -> VAEGeometry:
    """The geometry of an ``AutoencoderKLWan`` config (a dict or its ``FrozenDict``);
    ``ValueError`` naming ``name``, the key, its value and the rule when the declared strides or
    channels contradict the architecture."""
    c = dict(_wan_defaults())
    c.update({k: v for k, v in dict(config).items() if not k.startswith("_")})
    patch = c.get("patch_size") or 1
    ds_t = sum(bool(v) for v in c["temperal_downsample"])
    arch_t, arch_s = 2**ds_t, 2 ** (len(c["dim_mult"]) - 1) * patch
    st = c.get("scale_factor_temporal") or 4  # diffusers' pipelines: None -> 4 / 8
    ss = c.get("scale_factor_spatial") or 8
    in_ch = c["in_channels"]
    if not isinstance(patch, int) or patch < 1:
        raise ValueError(f"{name}: patch_size ({patch!r}) must be null or an integer >= 1")
    if in_ch % (patch * patch):
        raise ValueError(
            f"{name}: in_channels ({in_ch}) must be video channels x patch_size^2 "
            f"(patch_size {patch}): the VAE patchifies the video itself"
        )
    if st != arch_t:
        raise ValueError(
            f"{name}: scale_factor_temporal ({st}) must equal 2^(temporal downsamplings) = "
            f"{arch_t} (temperal_downsample {c['temperal_downsample']})"
        )
    if ss != arch_s:
        raise ValueError(
            f"{name}: scale_factor_spatial ({ss}) must equal 2^(len(dim_mult) - 1) x "
            f"patch_size = {arch_s} (dim_mult {c['dim_mult']}, patch_size {c.get('patch_size')})"
        )
    return VAEGeometry(
        video_channels=in_ch // (patch * patch),
        temporal_stride=st,
        spatial_stride=ss,
        latent_channels=int(c["z_dim"]),
        patch_size=patch,
        source=name,
    )


@functools.lru_cache(maxsize=32)
def _folder_geometry(path: str, mtime: float) -> VAEGeometry:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return wan_vae_geometry(cfg, f"vae.diffusers ({path!r})")


def wan_vae_folder_geometry(path) -> VAEGeometry:
    """The geometry of a local ``AutoencoderKLWan`` folder, from its ``config.json`` alone."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ValueError(
            f"vae.diffusers ({str(path)!r}) must be a local diffusers AutoencoderKLWan folder "
            f"(with config.json)"
        )
    return _folder_geometry(str(path), p.stat().st_mtime)


def module_geometry(module) -> Optional[VAEGeometry]:
    """The geometry of a module carrying an ``AutoencoderKLWan``-style ``config`` (None if not)."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "get") or cfg.get("z_dim") is None:
        return None
    if cfg.get("temperal_downsample") is None or cfg.get("dim_mult") is None:
        return None
    return wan_vae_geometry(cfg, f"{type(module).__name__} config")
