"""Where the clips of packed micro-batches come from (``data.buckets``; docs/data.md, "Training on
mixed shapes"): one small interface, ``ClipSource``, with two implementations.

* ``LazyShardClipSource``: latent shards from ``megatron-video precompute`` with ``data.buckets``
  (``data.source: shards``), an index up front and each clip's tensors read when needed
  (``ShardClipSource``: the same from an in-memory ``load_clip_store``).
* ``RawClipSource``: a prepared energon dataset of raw videos and images (``data.source:
  energon``). Each clip's latent grid is its ``BucketGrid`` plan (``config.bucket_grid``, the grid
  ``precompute`` uses, so token counts, costs, sampler and ledger are those of the shards path);
  ``latents(key, ranges)`` decodes ONLY the raw frames of each requested latent range's halo
  window (``layouts.vae_halo.halo_window``; ``KeyedClips.read(plan, window)``) and encodes them
  with the halo (``data.video_windows.encode_window``, the halo ``training.vae_halo.choose_halo``
  gives); other latent frames stay zero.

Every rank builds the same clip set (ids, grids) in the same order: the sampler is a pure function
of it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..config import Config, bucket_grid, latent_shape, vae_geometry

__all__ = [
    "ClipSource",
    "ShardClipSource",
    "LazyShardClipSource",
    "RawClipSource",
    "EncodingClipSource",
    "SyntheticClipSource",
    "fixed_grid",
    "clip_grid",
    "load_clip_store",
    "clip_source",
]

Ranges = Sequence[Tuple[int, int]]


class ClipSource:
    """The clips of a mixed-shape dataset by key: ``ids`` (sorted), ``latent_grid(key)`` ->
    latent ``(F, h, w)``, ``caption(key)``, ``text(key)`` -> ``(text_emb, text_mask)`` or None, and
    ``latents(key, ranges)`` -> ``[z, F, h, w]`` (unscaled) holding at least the latent frames of
    ``ranges`` (half-open ``(a, b)`` pairs of latent frames)."""

    ids: List[str]
    kind: str = "clips"

    def latent_grid(self, key: str) -> Tuple[int, int, int]:
        raise NotImplementedError

    def caption(self, key: str) -> str:
        raise NotImplementedError

    def text(self, key: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return None

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        """One phrase for the run log."""
        return self.kind


class ShardClipSource(ClipSource):
    """Precomputed latents in memory (``load_clip_store``); ``latents`` returns the whole clip."""

    kind = "precomputed latent shards"

    def __init__(self, store: Dict[str, dict]):
        self.store = store
        self.ids = sorted(store)

    def latent_grid(self, key: str) -> Tuple[int, int, int]:
        _, F, h, w = self.store[key]["latent"].shape
        return int(F), int(h), int(w)

    def caption(self, key: str) -> str:
        return self.store[key]["caption"]

    def text(self, key: str):
        item = self.store[key]
        return (item["text_emb"], item["text_mask"]) if "text_emb" in item else None

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        return self.store[key]["latent"]


class EncodingClipSource(ClipSource):
    """A source of raw frames, encoded per CP rank: ``raw(key, window)`` -> the window's raw
    frames ``[3, T_w, H, W]`` in ``[-1, 1]``; ``latents(key, ranges)`` decodes only the halo
    windows of ``ranges`` and encodes them with the halo (``encode``: one encoder call per
    window for a whole micro-batch of same-grid clips)."""

    encoder = None
    z = halo = 0

    temporal_stride = 4

    def _init_encoder(self, encoder, config: Config, halo_latents=None) -> None:
        from ..vae_halo import choose_halo

        if encoder is None:
            raise ValueError(
                "vae (None) must be the trainer's causal VAE for raw clips: they are encoded "
                "per CP rank"
            )
        self.encoder, self.z = encoder, int(config.vae.latent_channels)
        self.temporal_stride = vae_geometry(config).temporal_stride
        # any latent range may be asked for: the halo of any split (halo_latents overrides
        # vae.halo_latents)
        self.halo = choose_halo(config, encoder, None, halo_latents)

    def raw(self, key: str, window) -> torch.Tensor:
        raise NotImplementedError

    def windows(self, key: str, ranges: Ranges):
        """One halo window per run of ``ranges`` (runs closer than the halo merge: their windows
        would overlap)."""
        from megatron_video.layouts.vae_halo import halo_window

        runs: List[List[int]] = []
        for a, b in sorted(ranges):
            if runs and a - runs[-1][1] <= self.halo:
                runs[-1][1] = max(runs[-1][1], b)
            else:
                runs.append([a, b])
        return [halo_window(a, b, self.halo, self.temporal_stride, True) for a, b in runs]

    def encode(self, keys: Sequence[str], ranges: Ranges) -> torch.Tensor:
        """``[b, z, F, h, w]`` of clips ``keys`` (one latent grid): the latent frames of
        ``ranges`` encoded from their halo windows' raw frames only; every other frame zero."""
        from megatron_video.data.video_windows import encode_window

        F, h, w = self.latent_grid(keys[0])
        dtype = next((p.dtype for p in _parameters(self.encoder)), torch.float32)
        out = torch.zeros(len(keys), self.z, F, h, w, dtype=dtype)
        for win in self.windows(keys[0], ranges):
            raw = torch.stack([self.raw(k, win) for k in keys]).to(dtype)
            with torch.no_grad():
                lat = encode_window(self.encoder, raw, win)[:, : self.z]
            out[:, :, win.latent_start : win.latent_end] = lat
        return out

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        return self.encode([key], ranges)[0]


class SyntheticClipSource(EncodingClipSource):
    """The procedural clips (``data.source: synthetic``): ``data.num_samples`` clips of
    ``data.num_frames x data.height x data.width``, ids ``0 .. num_samples - 1``, each rendered
    when a window of it is read (the last few kept)."""

    kind = "procedural clips (each CP rank encodes its own halo windows)"

    def __init__(self, config: Config, encoder, halo_latents: Optional[int] = None):
        from megatron_video.data.synthetic import ProceduralVideoDataset

        d = config.data
        self.dataset = ProceduralVideoDataset(
            d.num_samples,
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            seed=d.seed,
            caption_len=d.caption_len,
        )
        self.grid = fixed_latent_shape(config)
        self.ids = list(range(d.num_samples))
        self.encoder, self._recent = None, {}
        if encoder is not None:
            self._init_encoder(encoder, config, halo_latents)

    def latent_grid(self, key) -> Tuple[int, int, int]:
        return self.grid

    def caption(self, key) -> str:
        from megatron_video.data.synthetic import caption_for

        return caption_for(self.dataset.attributes(int(key)))

    def raw(self, key, window) -> torch.Tensor:
        from megatron_video.data.synthetic import render_video

        if key not in self._recent:
            if len(self._recent) >= 8:
                self._recent.pop(next(iter(self._recent)))
            ds = self.dataset
            attrs = ds.attributes(int(key))
            self._recent[key] = render_video(
                attrs, num_frames=ds.num_frames, height=ds.height, width=ds.width
            )
        return self._recent[key][:, window.raw_start : window.raw_end]


class RawClipSource(EncodingClipSource):
    """Raw clips of the energon dataset ``config.data.path`` at their buckets, encoded per request
    with ``encoder`` (``[B, 3, T, H, W]`` in ``[-1, 1]`` -> ``[B, >= z, F, h, w]``; channels past
    ``vae.latent_channels`` are dropped) and ``halo_latents`` (None: the encoder's temporal
    receptive field, ``models.vae_halo_probe.encoder_halo``). Clips the grid refuses are left out
    (``left_out``: ``(key, reason)``), as ``precompute`` leaves them out. ``reads`` records each
    decoded ``(key, HaloWindow)``. ``text_encoder`` (``data.text.HFTextEncoder``; Wan): each
    caption encoded when a micro-batch reads it (``text``), one caption per call as ``precompute``
    stores it."""

    kind = "raw energon clips (each CP rank decodes and encodes its own halo windows)"

    def __init__(
        self, config: Config, encoder, halo_latents: Optional[int] = None, text_encoder=None
    ):
        from megatron_video.data.energon_video import KeyedClips, dataset_records

        d = config.data
        self.path, self.text_encoder = d.path, text_encoder
        self._init_encoder(encoder, config, halo_latents)
        records = dataset_records(d.path)
        self.left_out: List[Tuple[str, str]] = []
        plans = clip_grid(config).plan_many(records, self.left_out)
        self.plans = {p.key: p for p in plans}
        self.captions = {r["key"]: str(r.get("caption", "")) for r in records}
        if not self.plans:
            raise ValueError(
                f"data.path ({d.path!r}) holds no clip the data.buckets grid accepts "
                f"(left out: {self.left_out[:3]})"
            )
        self.ids = sorted(self.plans)
        self.clips = KeyedClips(d.path)
        self.reads: list = []

    def latent_grid(self, key: str) -> Tuple[int, int, int]:
        return tuple(self.plans[key].latent)

    def caption(self, key: str) -> str:
        return self.captions.get(key, "")

    def text(self, key: str):
        if self.text_encoder is None:
            return None
        emb, mask = self.text_encoder([self.caption(key)])
        return emb[0], mask[0]

    def describe(self) -> str:
        out = f"{self.kind}, halo {self.halo} latent(s)"
        if self.left_out:
            out += f"; {len(self.left_out)} left out by the grid: " + "; ".join(
                f"{k}: {why}" for k, why in self.left_out[:3]
            )
        return out

    def raw(self, key: str, window) -> torch.Tensor:
        return self._read(self.plans[key], window)

    def _read(self, plan, win) -> torch.Tensor:
        self.reads.append((plan.key, win))
        try:
            return self.clips.read(plan, win)
        except Exception as e:  # PyAV / PIL raise their own types for broken files
            raise ValueError(
                f"clip {plan.key!r} of data.path ({self.path!r}) cannot be decoded: raw frames "
                f"{win.raw_start}..{win.raw_end - 1} of its plan ({type(e).__name__}: {e}); rule: "
                f"every clip of a data.buckets energon dataset must decode its planned frames "
                f"(re-run `megatron-video prepare`, which leaves unreadable files out)"
            ) from None


def _parameters(encoder):
    """The encoder's parameters (a module, or a function carrying its module as ``.vae``)."""
    params = getattr(encoder, "parameters", getattr(getattr(encoder, "vae", None), "parameters", 0))
    return params() if callable(params) else iter(())


def _clip_item(config: Config, s: dict) -> dict:
    """``{latent [z, F, h, w] float, caption, text_emb?, text_mask?}`` of one shard sample
    (``ShardReader``'s form), checked: ``ValueError`` names the sample and the rule."""
    d, z, key = config.data, config.vae.latent_channels, s["key"]
    lat = s.get("latent")
    if lat is None and s.get("video") is not None and d.buckets is None:  # raw clips of one shape
        v = s["video"].float()
        want = (3, d.num_frames, d.height, d.width)
        if tuple(v.shape) != want:
            raise ValueError(
                f"shard sample {key!r}: video shape {tuple(v.shape)} must be [3, data.num_frames="
                f"{d.num_frames}, data.height={d.height}, data.width={d.width}]"
            )
        return dict(video=v, caption=s.get("caption", ""))
    if lat is None or lat.dim() != 4 or lat.shape[0] != z or min(lat.shape) < 1:
        raise ValueError(
            f"shard sample {key!r}: data.buckets trains on precomputed latents [z="
            f"{z}, F, h, w] (`megatron-video precompute` with data.buckets); got "
            f"{None if lat is None else tuple(lat.shape)}"
        )
    item = dict(latent=lat.float(), caption=s.get("caption", ""))
    if d.text_embed_dim is not None:
        emb, tm = s.get("text_emb"), s.get("text_mask")
        if emb is None or tm is None or tuple(emb.shape) != (d.caption_len, d.text_embed_dim):
            raise ValueError(
                f"shard sample {key!r}: data.text_embed_dim ({d.text_embed_dim}) needs "
                f"text_emb [data.caption_len={d.caption_len}, {d.text_embed_dim}] and text_mask"
            )
        item.update(text_emb=emb.float(), text_mask=tm.bool())
    return item


def load_clip_store(config: Config) -> Dict[str, dict]:
    """Every clip of ``data.shards`` (``precompute`` with ``data.buckets``: latents at each clip's
    own bucket) in memory: ``key -> {latent [z, F, h, w], caption, text_emb?, text_mask?}``, read
    by every rank in the same order (the sampler is a pure function of the clip ids). Training
    reads the shards lazily instead (``LazyShardClipSource``)."""
    from megatron_video.data.shards import ShardReader

    d = config.data
    store: Dict[str, dict] = {}
    for s in ShardReader(d.shards, split="samples"):
        if s["key"] in store:
            raise ValueError(f"shard sample {s['key']!r}: keys must be unique across data.shards")
        store[s["key"]] = _clip_item(config, s)
    if not store:
        raise ValueError(f"data.shards ({d.shards!r}) holds no samples")
    return store


class LazyShardClipSource(EncodingClipSource):
    """``data.shards`` by key without holding every clip's latents: up front only the index
    (``data.shards.ShardIndex``: tar member offsets from the headers, captions, and each clip's
    latent grid from ``meta.json``'s ``latent_shape`` as ``precompute`` writes it; a sample
    without one is read once for its shape); a clip's tensors are read from its offsets
    (weights-only, nothing unpickled) when a micro-batch needs them, the last ``cache`` kept.
    Without ``data.buckets`` a shard may hold raw clips (``video``) instead: they are encoded per
    CP rank with ``encoder`` as the other raw sources are."""

    kind = "precomputed latent shards (read lazily)"

    def __init__(self, config: Config, cache: int = 32, encoder=None):
        from collections import OrderedDict

        from megatron_video.data.shards import ShardIndex

        self.config, self.cache = config, cache
        if encoder is not None:
            self._init_encoder(encoder, config)
        self.index = ShardIndex(config.data.shards)
        self._recent: "OrderedDict[str, dict]" = OrderedDict()
        self.loads = 0
        self.grids: Dict[str, Tuple[int, int, int]] = {}
        for k in self.index.keys:
            self.grids[k] = self._grid(k)  # (an item loaded for its grid has none to match yet)
        if not self.grids:
            raise ValueError(f"data.shards ({config.data.shards!r}) holds no samples")
        self.ids = sorted(self.grids)

    def _grid(self, key: str) -> Tuple[int, int, int]:
        shape = self.index.meta(key).get("latent_shape")
        z = self.config.vae.latent_channels
        if isinstance(shape, list) and len(shape) == 4 and shape[0] == z:
            shape = shape[1:]  # [z, F, h, w]
        if isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) for v in shape):
            return tuple(shape)
        item = self._item(key)
        if "video" in item:
            return fixed_latent_shape(self.config)
        return tuple(item["latent"].shape[1:])

    def _item(self, key: str) -> dict:
        if key in self._recent:
            self._recent.move_to_end(key)
            return self._recent[key]
        item = _clip_item(self.config, self.index.read(key))
        self.loads += 1
        grid = self.grids.get(key)
        if grid is not None and "latent" in item and tuple(item["latent"].shape[1:]) != grid:
            raise ValueError(
                f"shard sample {key!r}: latent {tuple(item['latent'].shape)} must match its "
                f"meta.json latent_shape {list(grid)} (rule: the index is the clip's grid)"
            )
        self._recent[key] = item
        while len(self._recent) > self.cache:
            self._recent.popitem(last=False)
        return item

    def latent_grid(self, key: str) -> Tuple[int, int, int]:
        return self.grids[key]

    def caption(self, key: str) -> str:
        return self.index.caption(key)

    def text(self, key: str):
        item = self._item(key)
        return (item["text_emb"], item["text_mask"]) if "text_emb" in item else None

    def raw(self, key: str, window) -> torch.Tensor:
        return self._item(key)["video"][:, window.raw_start : window.raw_end]

    def encode(self, keys: Sequence[str], ranges: Ranges) -> torch.Tensor:
        items = [self._item(k) for k in keys]
        if all("latent" in i for i in items):
            return torch.stack([i["latent"] for i in items])
        if self.encoder is None:
            raise ValueError(
                f"shard sample {keys[0]!r} holds a raw video: data.shards of raw clips need the "
                f"trainer's causal VAE (and no data.buckets)"
            )
        return super().encode(keys, ranges)

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        return self.encode([key], ranges)[0]


def fixed_latent_shape(config: Config) -> Tuple[int, int, int]:
    """``(F, h, w)`` latent frames and size of a clip without ``data.buckets``."""
    return latent_shape(config)


def fixed_grid(config: Config):
    """A fixed shape as a grid of ONE bucket (``data.num_frames x data.height x data.width``; a
    longer or larger clip is cropped to it, a shorter one left out), one clip per sequence."""
    from megatron_video.data.buckets import BucketConfig, BucketGrid

    d, ps = config.data, list(config.model.patch_size)
    F, h, w = fixed_latent_shape(config)
    tokens = (F // ps[0]) * (h // ps[1]) * (w // ps[2])
    return BucketGrid(
        BucketConfig(
            area=h * w,
            area_tolerance=0.0,
            aspect_ratios=[w / h],
            max_frames=d.num_frames,
            frame_counts=[d.num_frames],
            tokens_per_microbatch=max(tokens, 1),
            patch_size=ps,
            spatial_stride=vae_geometry(config).spatial_stride,
            temporal_stride=vae_geometry(config).temporal_stride,
        )
    )


def clip_grid(config: Config):
    """The grid clips are planned on: ``data.buckets``'s, else the one-bucket ``fixed_grid``."""
    return bucket_grid(config) if config.data.buckets is not None else fixed_grid(config)


def clip_source(config: Config, vae=None) -> ClipSource:
    """The source of ``config.data.source``: ``shards`` -> ``LazyShardClipSource``, ``energon`` ->
    ``RawClipSource`` encoding with ``vae.encoder`` (the trainer's causal VAE, or Wan's
    ``families.wan_raw.WanRawEncoders`` with its ``text`` encoder) and ``vae.halo_latents``;
    without ``data.buckets`` also ``synthetic`` -> ``SyntheticClipSource``."""
    d = config.data
    if d.source == "shards":
        return LazyShardClipSource(config, encoder=None if vae is None else vae.encoder)
    if d.source == "synthetic" and d.buckets is None:
        return SyntheticClipSource(config, getattr(vae, "encoder", None), config.vae.halo_latents)
    if d.source == "energon":
        if vae is None:  # (a family without a VAE is refused by config.validate)
            raise ValueError(
                "vae (None) must be the trainer's causal VAE with data.source 'energon': raw "
                "clips are encoded per CP rank"
            )
        text = getattr(vae, "text", None)
        return RawClipSource(config, vae.encoder, config.vae.halo_latents, text_encoder=text)
    raise ValueError(
        f"data.source ({d.source!r}) must be 'shards' or 'energon' with data.buckets "
        f"(clips are read by key)"
    )
