"""What ``megatron-video generate`` loads for the Wan families: the text encoder (a local UMT5 / T5
folder, ``data.text.HFTextEncoder``, the kind ``precompute --text-encoder`` stores embeddings with)
and the Wan VAE's decoder (a local diffusers ``AutoencoderKLWan`` folder, the inverse of
``precompute.wan_vae_encoder``'s normalisation). Design: docs/generation.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch

from .config import Config

__all__ = ["wan_folders", "wan_text_conditions", "wan_vae_decoder", "wan_first_frame"]


def wan_folders(config: Config, text_encoder: Optional[str], vae: Optional[str]) -> Tuple[str, str]:
    """``(text encoder folder, VAE folder)``: ``--text-encoder`` (required) and ``--vae`` (default:
    the checkpoint's ``vae.diffusers``), each a local folder with ``config.json``."""
    vae = vae if vae is not None else config.vae.diffusers
    for option, folder, what in (
        ("--text-encoder", text_encoder, "UMT5 / T5 encoder and tokenizer (save_pretrained)"),
        ("--vae", vae, "diffusers AutoencoderKLWan (default: the checkpoint's vae.diffusers)"),
    ):
        if folder is None or not (Path(folder) / "config.json").is_file():
            raise ValueError(
                f"{option} ({folder!r}) must be a local {what} folder with config.json: "
                f"model.family {config.model.family!r} encodes the prompt and decodes with them"
            )
    return text_encoder, vae


def wan_text_conditions(
    folder: str, config: Config, prompts: Sequence[str], device
) -> Tuple[list, tuple]:
    """``([cond of each prompt], null)``: ``(text [1, L, d],)`` embedded by the encoder at the
    trained caption length (padded positions zero, as precompute stores them); the null
    condition is all zeros (what training's CFG dropout feeds)."""
    from megatron_video.data.text import HFTextEncoder

    d = config.data
    enc = HFTextEncoder.from_pretrained(folder, max_len=d.caption_len)
    if enc.dim != d.text_embed_dim:
        raise ValueError(
            f"--text-encoder ({folder!r}): its width ({enc.dim}) must equal the checkpoint's "
            f"data.text_embed_dim ({d.text_embed_dim})"
        )
    conds = [(enc([p])[0].to(device),) for p in prompts]
    return conds, (torch.zeros_like(conds[0][0]),)


def wan_vae_decoder(folder: str, config: Config) -> Callable[[torch.Tensor], torch.Tensor]:
    """``decode(latents [B, z, F, h, w] as the transformer sees them) -> video [B, 3, T, H, W]``
    in ``[-1, 1]``: ``latents * latents_std + latents_mean`` through the VAE's decoder."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(folder), local_files_only=True).eval()
    c = vae.config
    if c.z_dim != config.vae.latent_channels:
        raise ValueError(
            f"--vae ({str(folder)!r}): its z_dim ({c.z_dim}) must equal the checkpoint's "
            f"vae.latent_channels ({config.vae.latent_channels})"
        )
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(vae.dtype) * std.to(vae.dtype) + mean.to(vae.dtype)
        return vae.decode(z).sample.clamp(-1.0, 1.0)

    return decode


def wan_first_frame(folder: str, config: Config, image: str) -> torch.Tensor:
    """The tokens ``[1, h*w / patch, C]`` of latent frame 0 for TI2V: ``image`` resized and
    centre-cropped to ``data.height x data.width`` pixels, encoded alone by the Wan VAE (a causal
    VAE's first latent frame is its first raw frame) and normalised as training's latents."""
    from megatron_video.data.energon_video import read_image_frame
    from megatron_video.models.embedders import patchify

    from .precompute import wan_vae_encoder

    frame = read_image_frame(image, config.data.height, config.data.width)
    with torch.no_grad():
        latent = wan_vae_encoder(folder, config.vae.latent_channels)(frame)
    return patchify(latent.float(), tuple(config.model.patch_size))
