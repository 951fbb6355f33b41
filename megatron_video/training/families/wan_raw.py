"""Raw-video training for ``wan`` / ``wan_ar`` (``data.source: energon``, docs/wan.md "Training
from raw video"): the encoders of the step and their rules.

Each CP rank decodes and encodes only the raw frames of the latent frames it holds plus the left
halo (``batches.clips.RawClipSource``, the same ``ClipSource`` rule as the other families; halo:
``training.vae_halo.choose_halo``) with the diffusers ``AutoencoderKLWan`` of ``vae.diffusers``
(Wan 2.1 or 2.2; latents normalised by its ``latents_mean / std`` as ``precompute`` writes them).
Captions go through the frozen text encoder of ``data.text_encoder`` (a local UMT5 / T5 folder, the
one ``precompute --text-encoder`` takes; ``data.caption_len`` tokens), replicated: every rank
encodes the captions of its own micro-batch (a few hundred tokens, small next to the video).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_video.data.text import HFTextEncoder

from ..config import Config, vae_geometry
from ..precompute import wan_vae_encoder

__all__ = ["WanRawEncoders", "check_raw_video", "raw_encoders", "text_encoder_dim"]

_TEXT_KINDS = ("t5", "umt5")


@dataclass
class WanRawEncoders:
    """What ``batches.clips.clip_source`` reads as ``vae`` for Wan's raw clips: ``encoder`` (video
    ``[B, 3, T, H, W]`` in ``[-1, 1]`` -> normalised latents) and ``text`` (captions -> ``(emb,
    mask)``)."""

    encoder: object
    text: HFTextEncoder


def text_encoder_dim(path) -> int:
    """``d_model`` of the local UMT5 / T5 folder ``data.text_encoder`` (its config.json)."""
    cfg = Path(path) / "config.json"
    try:
        meta = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"data.text_encoder ({str(path)!r}) must be a local UMT5 / T5 folder with a "
            f"config.json: {type(e).__name__}: {e}"
        ) from None
    kind, dim = meta.get("model_type"), meta.get("d_model")
    if kind not in _TEXT_KINDS or not isinstance(dim, int):
        raise ValueError(
            f"data.text_encoder ({str(path)!r}): model_type ({kind!r}) must be one of "
            f"{_TEXT_KINDS} with an integer d_model (got {dim!r})"
        )
    return dim


def check_raw_video(config: Config) -> None:
    """The rules of ``data.source: energon`` for a Wan family (``ValueError`` naming the field, its
    value and the rule; nothing is loaded but the folders' config.json)."""
    d, v, name = config.data, config.vae, config.model.family
    where = f"for model.family {name!r} with data.source 'energon'"
    if v.diffusers is None:
        raise ValueError(
            f"vae.diffusers (None) must name a local diffusers AutoencoderKLWan folder (Wan 2.1 "
            f"or 2.2) {where}: each CP rank encodes its own raw frames with it in the step"
        )
    g = vae_geometry(config)
    if g.video_channels != 3:
        raise ValueError(
            f"vae.diffusers ({v.diffusers!r}): the VAE takes {g.video_channels}-channel video "
            f"(in_channels / patch_size^2); rule: raw clips are RGB (3)"
        )
    if d.text_encoder is None:
        raise ValueError(
            f"data.text_encoder (None) must name a local UMT5 / T5 folder (the one `megatron-video "
            f"precompute --text-encoder` takes) {where}: captions are encoded in the step"
        )
    dim = text_encoder_dim(d.text_encoder)
    if d.text_embed_dim != dim:
        raise ValueError(
            f"data.text_embed_dim ({d.text_embed_dim!r}) must equal the d_model ({dim}) of "
            f"data.text_encoder ({d.text_encoder!r}): it is the Wan model's text_dim"
        )


def raw_encoders(config: Config) -> WanRawEncoders:
    """The frozen VAE and text encoder of ``config`` (checked by ``check_raw_video``)."""
    d = config.data
    encoder = wan_vae_encoder(config.vae.diffusers, config.vae.latent_channels)
    text = HFTextEncoder.from_pretrained(d.text_encoder, d.caption_len)
    return WanRawEncoders(encoder, text)
