"""What ``megatron-video generate`` loads for the Wan families: the text encoder (a local UMT5 / T5
folder, ``data.text.HFTextEncoder``, the kind ``precompute --text-encoder`` stores embeddings with),
the Wan VAE's decoder (a local diffusers ``AutoencoderKLWan`` folder, the inverse of
``training.precompute.wan_vae_encoder``'s normalisation) and TI2V's first frame. Plain arguments:
the checkpoint's config is read in ``training.generate``. Design: docs/generation.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch

__all__ = ["wan_folders", "wan_text_conditions", "wan_vae_decoder", "wan_first_frame"]


def wan_folders(
    family: str, text_encoder: Optional[str], vae: Optional[str], default_vae: Optional[str]
) -> Tuple[str, str]:
    """``(text encoder folder, VAE folder)``: ``--text-encoder`` (required) and ``--vae`` (default:
    ``default_vae``, the checkpoint's ``vae.diffusers``), each a local folder with ``config.json``;
    ``family``: the checkpoint's ``model.family``, named in the error."""
    vae = vae if vae is not None else default_vae
    for option, folder, what in (
        ("--text-encoder", text_encoder, "UMT5 / T5 encoder and tokenizer (save_pretrained)"),
        ("--vae", vae, "diffusers AutoencoderKLWan (default: the checkpoint's vae.diffusers)"),
    ):
        if folder is None or not (Path(folder) / "config.json").is_file():
            raise ValueError(
                f"{option} ({folder!r}) must be a local {what} folder with config.json: "
                f"model.family {family!r} encodes the prompt and decodes with them"
            )
    return text_encoder, vae


def wan_text_conditions(
    folder: str, caption_len: int, text_embed_dim: int, prompts: Sequence[str], device
) -> Tuple[list, tuple]:
    """``([cond of each prompt], null)``: ``(text [1, L, d],)`` embedded by the encoder at the
    trained caption length ``caption_len`` (padded positions zero, as precompute stores them),
    its width the checkpoint's ``text_embed_dim``; the null condition is all zeros (what
    training's CFG dropout feeds)."""
    from megatron_video.data.text import HFTextEncoder

    enc = HFTextEncoder.from_pretrained(folder, max_len=caption_len)
    if enc.dim != text_embed_dim:
        raise ValueError(
            f"--text-encoder ({folder!r}): its width ({enc.dim}) must equal the checkpoint's "
            f"data.text_embed_dim ({text_embed_dim})"
        )
    conds = [(enc([p])[0].to(device),) for p in prompts]
    return conds, (torch.zeros_like(conds[0][0]),)


def wan_vae_decoder(folder: str, latent_channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``decode(latents [B, z, F, h, w] as the transformer sees them) -> video [B, 3, T, H, W]``
    in ``[-1, 1]``: ``latents * latents_std + latents_mean`` through the VAE's decoder; its
    ``z_dim`` must be the checkpoint's ``latent_channels``."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(folder), local_files_only=True).eval()
    c = vae.config
    if c.z_dim != latent_channels:
        raise ValueError(
            f"--vae ({str(folder)!r}): its z_dim ({c.z_dim}) must equal the checkpoint's "
            f"vae.latent_channels ({latent_channels})"
        )
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(vae.dtype) * std.to(vae.dtype) + mean.to(vae.dtype)
        return vae.decode(z).sample.clamp(-1.0, 1.0)

    return decode


def wan_first_frame(
    encode: Callable[[torch.Tensor], torch.Tensor],
    image: str,
    height: int,
    width: int,
    patch_size: Sequence[int],
) -> torch.Tensor:
    """The tokens ``[1, h*w / patch, C]`` of latent frame 0 for TI2V: ``image`` resized and
    centre-cropped to ``height x width`` pixels, encoded alone by the Wan VAE's ``encode``
    (``training.precompute.wan_vae_encoder``: a causal VAE's first latent frame is its first raw
    frame, normalised as training's latents), patchified with ``patch_size``."""
    from megatron_video.data.energon_video import read_image_frame
    from megatron_video.models.embedders import patchify

    frame = read_image_frame(image, height, width)
    with torch.no_grad():
        latent = encode(frame)
    return patchify(latent.float(), tuple(patch_size))
