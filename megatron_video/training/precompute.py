"""``megatron-video precompute``: encode a prepared energon dataset into latent shards once.

Training reads them with ``data.source=shards data.shards=DST``; the VAE then stays out of the
step (``precompute_latents``). The encoder is the project's VAE, or with ``vae.diffusers`` a
diffusers ``AutoencoderKLWan`` (Wan's latents, normalised by its ``latents_mean / std``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Tuple

import torch

from .config import Config

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

    vae = AutoencoderKLWan.from_pretrained(
        str(path), local_files_only=True, low_cpu_mem_usage=False
    ).eval()  # (explicit: no "accelerate not found" notice)
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
    # float64 (the config's numbers), cast to the latents' dtype: exact for a float64 VAE too
    mean = torch.tensor(c.latents_mean, dtype=torch.float64).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std, dtype=torch.float64).view(1, -1, 1, 1, 1)

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


def _check_config(config: Config, sp_size: int) -> None:
    """The config against the VAE before anything is read (``ValueError`` naming the field)."""
    from .config import vae_fits_data, vae_geometry
    from .vae_halo import _requested

    d = config.data
    if not d.path:
        raise ValueError("data.path (None) must name the energon dataset to precompute")
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"--sp-size ({sp_size!r}) must be an integer >= 1")
    config.vae.validate()
    _requested(config, None)
    g = vae_geometry(config)
    if g.video_channels != 3:
        raise ValueError(
            f"vae.diffusers ({config.vae.diffusers!r}): the VAE takes {g.video_channels}-channel "
            f"video (in_channels / patch_size^2); rule: precompute encodes RGB clips (3)"
        )
    vae_fits_data(config)  # latent channels, strides


def precompute_latents(
    config: Config,
    out_dir,
    *,
    sp_size: int = 1,
    text_encoder=None,
    samples_per_shard: int = 64,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Encode ``config.data.path`` (an energon dataset) into latent shards under ``out_dir``
    (``LatentShardWriter``). Returns ``{"samples", "shards", "skipped", "left_out", "halo"}``.

    Every clip is decoded as the ``sp_size`` halo windows SP ranks would decode
    (``data.energon_video``), each window encoded with its left halo (``vae.halo_latents``:
    ``training.vae_halo.choose_halo``; nothing probed at ``sp_size`` 1) and concatenated; the
    latent means ``[z, F, h, w]`` (unscaled; Wan's normalised) and, with a text encoder
    (``data.text.HFTextEncoder``, T5 or UMT5), the caption embeddings ``text_emb`` /
    ``text_mask``. Every clip is encoded at its bucket of ``data.buckets``, or without it at the
    one fixed shape (``batches.clips.clip_grid``), and its latent checked against that grid
    before it is written. ``progress``: clips done / total and clips per second on ``log``.
    """
    _check_config(config, sp_size)
    return _precompute_buckets(
        config, out_dir, sp_size, text_encoder, samples_per_shard, progress, log
    )


def _precompute_buckets(config, out_dir, sp_size, text_encoder, samples_per_shard, progress, log):
    """Every clip of ``data.path`` at its bucket (``batches.clips.clip_grid``): read by
    key (``data.energon_video.KeyedClips``) as ``min(sp_size, F)`` near-equal halo windows of its
    ``F`` latent frames, each decoded and encoded with its halo; ``meta`` adds the bucket, latent
    shape, tokens and frame window. Clips the grid refuses or that fail to decode are skipped and
    named (``left_out``)."""
    from megatron_video.data.energon_video import KeyedClips, dataset_records
    from megatron_video.data.video_windows import encode_window
    from megatron_video.layouts.vae_halo import windows_for_bounds

    from .batches.clips import clip_grid
    from .config import vae_geometry
    from .vae_halo import choose_halo

    d, z, st = config.data, config.vae.latent_channels, vae_geometry(config).temporal_stride
    left_out: list = []
    records = {r["key"]: r for r in dataset_records(d.path)}
    plans = clip_grid(config).plan_many(list(records.values()), left_out)
    clips = KeyedClips(d.path)
    encoder, kind = _encoder(config, progress)
    halo = choose_halo(config, encoder, sp_size, log=log)
    meter = _Progress(len(plans), log if progress else None)
    with LatentShardWriter(out_dir, samples_per_shard) as writer:
        for plan in plans:
            F, p = plan.latent[0], min(sp_size, plan.latent[0])
            bounds = [(r * F // p, (r + 1) * F // p) for r in range(p)]
            windows = windows_for_bounds(bounds, halo, st)
            try:  # each window decoded on its own, as the SP ranks would
                raws = [clips.read(plan, w)[None] for w in windows]
            except ValueError as e:
                left_out.append((plan.key, str(e)))
                meter.step()
                continue
            with torch.no_grad():
                parts = [encode_window(encoder, x, w) for x, w in zip(raws, windows)]
                lat = torch.cat(parts, dim=2)[0, :z]
            _check_latent(plan, lat, z, config)
            caption = records[plan.key].get("caption", "")
            tensors = {"latent": lat.float()}
            if text_encoder is not None:
                emb, mask = text_encoder([caption])
                tensors.update(text_emb=emb[0], text_mask=mask[0])
            meta = dict(records[plan.key], **_plan_meta(plan), sp_size=sp_size, encoder=kind)
            writer.write(plan.key, tensors, caption, dict(meta, halo_latents=halo))
            meter.step()
    return {"samples": writer.count, "shards": writer.shards, "skipped": len(left_out),
            "left_out": left_out, "halo": halo}  # fmt: skip


def _check_latent(plan, lat: torch.Tensor, z: int, config: Config) -> None:
    """A clip's latent against the training config's grid, before it is written."""
    want = (z, *plan.latent)
    if tuple(lat.shape) != want:
        d = config.data
        raise ValueError(
            f"clip {plan.key!r}: latent shape {list(lat.shape)} must be [vae.latent_channels, "
            f"F, h, w] = {list(want)} (data.num_frames={d.num_frames}, height={d.height}, "
            f"width={d.width} in pixels over the VAE's strides); rule: precompute writes the "
            f"latents training reads"
        )
    if not torch.isfinite(lat).all():
        raise ValueError(f"clip {plan.key!r}: latent has non-finite values (rule: finite)")


class _Progress:
    """``clips done / total`` and clips per second, about 20 lines per run (and the last)."""

    def __init__(self, total: int, log):
        import time

        self.total, self.log, self.done, self.t0 = total, log, 0, time.perf_counter()
        self.every = max(1, total // 20)

    def step(self) -> None:
        import time

        self.done += 1
        if self.log is not None and (self.done % self.every == 0 or self.done == self.total):
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
            self.log(
                f"[megatron-video] precompute: {self.done}/{self.total} clips ({rate:.2f} clips/s)"
            )


def _plan_meta(plan) -> dict:
    return dict(
        bucket=plan.bucket,
        latent_shape=list(plan.latent),
        tokens=plan.tokens,
        frames_used=plan.num_frames,
        frame_offset=plan.frame_offset,
        frame_step=plan.frame_step,
    )
