"""``megatron-video precompute``: encode a prepared energon dataset into latent shards once.

Training reads them with ``data.source=shards data.shards=DST``; the VAE then stays out of the
step (``precompute_latents``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from .config import Config, latent_shape

__all__ = ["precompute_latents"]


def precompute_latents(
    config: Config,
    out_dir,
    *,
    sp_size: int = 1,
    text_encoder=None,
    samples_per_shard: int = 64,
    progress: bool = False,
) -> dict:
    """Encode ``config.data.path`` (an energon dataset) into latent shards under ``out_dir``.
    Returns ``{"samples", "shards", "skipped"}``.

    Every clip is decoded as the ``sp_size`` halo windows SP ranks would decode
    (``data.energon_video``), each window encoded with its left halo
    (``data.video_windows.encode_rank_latents``: SP-folded encoding, exact) and concatenated; the
    latent means ``[z, F, h, w]`` (unscaled) and, with a text encoder (``data.text.HFTextEncoder``),
    the caption embeddings go into ``<key>.latent.pth`` (a dict of tensors, read back with
    ``torch.load(weights_only=True)``) next to ``<key>.caption.txt`` / ``<key>.meta.json`` in
    WebDataset tars."""
    import webdataset as wds

    from megatron_video.data.energon_video import video_window_loader
    from megatron_video.data.video_windows import encode_rank_latents
    from megatron_video.layouts.vae_halo import encoder_halo, halo_windows

    from .vae_stage import ensure_vae, load_vae

    d = config.data
    if not d.path:
        raise ValueError("data.path (None) must name the energon dataset to precompute")
    F, _, _ = latent_shape(config)
    if sp_size < 1 or F % sp_size:
        raise ValueError(f"sp_size ({sp_size}) must be >= 1 and divide the latent frames ({F})")
    vae, _ = load_vae(ensure_vae(config, progress=progress), config)
    windows = halo_windows(F, sp_size, encoder_halo(vae.encoder))
    loader, te = video_window_loader(
        d.path,
        windows,
        num_frames=d.num_frames,
        height=d.height,
        width=d.width,
        batch_size=1,
        dp_rank=0,
        dp_size=1,
        seed=d.seed,
    )
    summary_file = Path(d.path) / ".nv-meta" / "megatron_video.json"
    total = json.loads(summary_file.read_text())["samples"] if summary_file.is_file() else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen, shards, writer = set(), [], None
    z = config.vae.latent_channels
    try:
        for batch in loader:
            s = batch[0]
            if s.__key__ in seen:  # the dataset repeats: one epoch done
                break
            if len(seen) % samples_per_shard == 0:
                if writer is not None:
                    writer.close()
                shards.append(str(out / f"latents-{len(shards):06d}.tar"))
                writer = wds.TarWriter(shards[-1])
            seen.add(s.__key__)
            with torch.no_grad():
                lat = encode_rank_latents(vae.encoder, [w[None] for w in s.windows], windows)[0, :z]
            blob = {"latent": lat.contiguous()}
            if text_encoder is not None:
                emb, mask = text_encoder([s.caption])
                blob.update(text_emb=emb[0].contiguous(), text_mask=mask[0].contiguous())
            buf = io.BytesIO()
            torch.save(blob, buf)
            writer.write(
                {
                    "__key__": s.__key__,
                    "latent.pth": buf.getvalue(),
                    "caption.txt": s.caption,
                    "meta.json": dict(
                        s.meta, sp_size=sp_size, halo_latents=windows[0].halo_latents
                    ),
                }
            )
            if total is not None and len(seen) >= total:
                break
    finally:
        if writer is not None:
            writer.close()
    return {"samples": len(seen), "shards": shards, "skipped": te.skipped}
