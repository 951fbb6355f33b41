"""``megatron-video precompute``: encode a prepared energon dataset into latent shards once.

Training reads them with ``data.source=shards data.shards=DST``; the VAE then stays out of the
step (``precompute_latents``). The encoder is the project's VAE, or with ``vae.diffusers`` a
diffusers ``AutoencoderKLWan`` (Wan's latents, normalised by its ``latents_mean / std``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable, Tuple

import torch

from .config import Config, latent_shape

__all__ = ["precompute_latents", "LatentShardWriter", "wan_vae_encoder"]


class LatentShardWriter:
    """WebDataset tars of precomputed samples under ``out_dir``: ``<key>.latent.pth`` (a dict of
    tensors: ``latent`` and optionally ``text_emb`` / ``text_mask``, read back with
    ``torch.load(weights_only=True)``), ``<key>.caption.txt``, ``<key>.meta.json``;
    ``samples_per_shard`` per tar. A context manager; ``shards`` lists the tars written."""

    def __init__(self, out_dir, samples_per_shard: int = 64):
        import webdataset as wds

        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard ({samples_per_shard}) must be >= 1")
        self._wds, self.out, self.per_shard = wds, Path(out_dir), samples_per_shard
        self.out.mkdir(parents=True, exist_ok=True)
        self.shards, self.count, self._writer = [], 0, None

    def write(self, key: str, tensors: dict, caption: str, meta: dict) -> None:
        if self.count % self.per_shard == 0:
            self.close()
            self.shards.append(str(self.out / f"latents-{len(self.shards):06d}.tar"))
            self._writer = self._wds.TarWriter(self.shards[-1])
        buf = io.BytesIO()
        torch.save({k: v.contiguous() for k, v in tensors.items()}, buf)
        self._writer.write(
            {
                "__key__": key,
                "latent.pth": buf.getvalue(),
                "caption.txt": caption,
                "meta.json": meta,
            }
        )
        self.count += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wan_vae_encoder(path, latent_channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``encode(video [B, 3, T, H, W] in [-1, 1]) -> [B, z, F, h, w]``: a local diffusers
    ``AutoencoderKLWan`` folder's posterior means normalised as Wan's pipelines feed the
    transformer, ``(mu - latents_mean) / latents_std``."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(path), local_files_only=True).eval()
    c = vae.config
    if c.z_dim != latent_channels:
        raise ValueError(
            f"vae.latent_channels ({latent_channels}) must equal the z_dim ({c.z_dim}) of "
            f"vae.diffusers ({str(path)!r})"
        )
    if len(c.latents_mean) != c.z_dim or len(c.latents_std) != c.z_dim:
        raise ValueError(
            f"vae.diffusers ({str(path)!r}): latents_mean / latents_std must have z_dim "
            f"({c.z_dim}) entries (got {len(c.latents_mean)} / {len(c.latents_std)})"
        )
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)

    def encode(x: torch.Tensor) -> torch.Tensor:
        mu = vae.encode(x.to(vae.dtype)).latent_dist.mean
        return (mu - mean.to(mu)) / std.to(mu)

    encode.vae = vae  # keeps the module reachable (halo probe, dtype)
    return encode


def _encoder(config: Config, progress: bool) -> Tuple[Callable, str]:
    """``(encoder, kind)``: the Wan VAE of ``vae.diffusers`` or the project's cached VAE."""
    if config.vae.diffusers is not None:
        return wan_vae_encoder(config.vae.diffusers, config.vae.latent_channels), "wan_vae"
    from .vae_stage import ensure_vae, load_vae

    vae, _ = load_vae(ensure_vae(config, progress=progress), config)
    return vae.encoder, "causal_vae"


def _loader(config: Config, windows):
    from megatron_video.data.energon_video import video_window_loader

    d = config.data
    return video_window_loader(
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


def precompute_latents(
    config: Config,
    out_dir,
    *,
    sp_size: int = 1,
    text_encoder=None,
    samples_per_shard: int = 64,
    progress: bool = False,
) -> dict:
    """Encode ``config.data.path`` (an energon dataset) into latent shards under ``out_dir``
    (``LatentShardWriter``). Returns ``{"samples", "shards", "skipped"}``.

    Every clip is decoded as the ``sp_size`` halo windows SP ranks would decode
    (``data.energon_video``), each window encoded with its left halo
    (``data.video_windows.encode_rank_latents``: SP-folded encoding, exact; the halo of a Wan VAE
    is probed, ``models.vae_halo_probe.probe_halo``) and concatenated; the latent means ``[z, F, h, w]``
    (unscaled; Wan's normalised) and, with a text encoder (``data.text.HFTextEncoder``, T5 or
    UMT5), the caption embeddings ``text_emb`` / ``text_mask``. With ``data.buckets`` every clip
    is encoded at its own bucket (``_precompute_buckets``)."""
    from megatron_video.layouts.vae_halo import halo_windows
    from megatron_video.models.vae_halo_probe import encoder_halo

    d = config.data
    if not d.path:
        raise ValueError("data.path (None) must name the energon dataset to precompute")
    if d.buckets is not None:
        return _precompute_buckets(
            config, out_dir, sp_size, text_encoder, samples_per_shard, progress
        )
    F, _, _ = latent_shape(config)
    if sp_size < 1 or F % sp_size:
        raise ValueError(f"sp_size ({sp_size}) must be >= 1 and divide the latent frames ({F})")
    encoder, kind = _encoder(config, progress)
    windows = halo_windows(F, sp_size, encoder_halo(encoder))
    loader, te = _loader(config, windows)
    summary_file = Path(d.path) / ".nv-meta" / "megatron_video.json"
    total = json.loads(summary_file.read_text())["samples"] if summary_file.is_file() else None
    extra = dict(sp_size=sp_size, halo_latents=windows[0].halo_latents, encoder=kind)
    with LatentShardWriter(out_dir, samples_per_shard) as writer:
        _encode_all(loader, encoder, windows, config, text_encoder, writer, total, extra)
    return {"samples": writer.count, "shards": writer.shards, "skipped": te.skipped}


def _encode_all(loader, encoder, windows, config, text_encoder, writer, total, extra) -> None:
    """One epoch of ``loader`` (it repeats: stop at the first key seen twice or at ``total``)."""
    from megatron_video.data.video_windows import encode_rank_latents

    seen, z = set(), config.vae.latent_channels
    for batch in loader:
        s = batch[0]
        if s.__key__ in seen:
            break
        seen.add(s.__key__)
        with torch.no_grad():
            lat = encode_rank_latents(encoder, [w[None] for w in s.windows], windows)[0, :z]
        tensors = {"latent": lat.float()}
        if text_encoder is not None:
            emb, mask = text_encoder([s.caption])
            tensors.update(text_emb=emb[0], text_mask=mask[0])
        writer.write(s.__key__, tensors, s.caption, dict(s.meta, **extra))
        if total is not None and len(seen) >= total:
            break


def _precompute_buckets(config, out_dir, sp_size, text_encoder, samples_per_shard, progress):
    """Every clip of ``data.path`` at its ``data.buckets`` bucket (``config.bucket_grid``): read by
    key (``data.energon_video.KeyedClips``) as ``min(sp_size, F)`` near-equal halo windows of its
    ``F`` latent frames, each decoded and encoded with its halo; ``meta`` adds the bucket, latent
    shape, tokens and frame window. Clips the grid refuses or that fail to decode are skipped and
    named (``left_out``)."""
    from megatron_video.data.energon_video import KeyedClips, dataset_records
    from megatron_video.data.video_windows import encode_rank_latents
    from megatron_video.layouts.vae_halo import windows_for_bounds
    from megatron_video.models.vae_halo_probe import encoder_halo

    from .config import bucket_grid

    if sp_size < 1:
        raise ValueError(f"sp_size ({sp_size}) must be >= 1")
    d, z = config.data, config.vae.latent_channels
    left_out: list = []
    records = {r["key"]: r for r in dataset_records(d.path)}
    plans = bucket_grid(config).plan_many(list(records.values()), left_out)
    clips = KeyedClips(d.path)
    encoder, kind = _encoder(config, progress)
    halo = encoder_halo(encoder)
    with LatentShardWriter(out_dir, samples_per_shard) as writer:
        for plan in plans:
            F, p = plan.latent[0], min(sp_size, plan.latent[0])
            windows = windows_for_bounds([(r * F // p, (r + 1) * F // p) for r in range(p)], halo)
            try:  # each window decoded on its own, as the SP ranks would
                raws = [clips.read(plan, w)[None] for w in windows]
            except ValueError as e:
                left_out.append((plan.key, str(e)))
                continue
            with torch.no_grad():
                lat = encode_rank_latents(encoder, raws, windows)[0, :z]
            caption = records[plan.key].get("caption", "")
            tensors = {"latent": lat.float()}
            if text_encoder is not None:
                emb, mask = text_encoder([caption])
                tensors.update(text_emb=emb[0], text_mask=mask[0])
            meta = dict(records[plan.key], **_plan_meta(plan), sp_size=sp_size, encoder=kind)
            writer.write(plan.key, tensors, caption, dict(meta, halo_latents=halo))
    return {"samples": writer.count, "shards": writer.shards, "skipped": len(left_out),
            "left_out": left_out}  # fmt: skip


def _plan_meta(plan) -> dict:
    return dict(
        bucket=plan.bucket,
        latent_shape=list(plan.latent),
        tokens=plan.tokens,
        frames_used=plan.num_frames,
        frame_offset=plan.frame_offset,
        frame_step=plan.frame_step,
    )
