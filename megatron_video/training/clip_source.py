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
  with the halo (``data.video_windows.encode_with_halo``); other latent frames stay zero.

Every rank builds the same clip set (ids, grids) in the same order: the sampler is a pure function
of it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .config import TEMPORAL_STRIDE, Config, bucket_grid

__all__ = [
    "ClipSource",
    "ShardClipSource",
    "LazyShardClipSource",
    "RawClipSource",
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


class RawClipSource(ClipSource):
    """Raw clips of the energon dataset ``config.data.path`` at their buckets, encoded per request
    with ``encoder`` (``[B, 3, T, H, W]`` in ``[-1, 1]`` -> ``[B, >= z, F, h, w]``; channels past
    ``vae.latent_channels`` are dropped) and ``halo_latents`` (None: the encoder's temporal
    receptive field, ``models.vae_halo_probe.encoder_halo``). Clips the grid refuses are left out
    (``left_out``: ``(key, reason)``), as ``precompute`` leaves them out. ``reads`` records each
    decoded ``(key, HaloWindow)``."""

    kind = "raw energon clips (each CP rank decodes and encodes its own halo windows)"

    def __init__(self, config: Config, encoder, halo_latents: Optional[int] = None):
        from megatron_video.data.energon_video import KeyedClips, dataset_records
        from megatron_video.models.vae_halo_probe import encoder_halo

        d = config.data
        self.path, self.encoder, self.z = d.path, encoder, config.vae.latent_channels
        need = encoder_halo(encoder, temporal_stride=TEMPORAL_STRIDE)
        self.halo = need if halo_latents is None else int(halo_latents)
        records = dataset_records(d.path)
        self.left_out: List[Tuple[str, str]] = []
        plans = bucket_grid(config).plan_many(records, self.left_out)
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

    def describe(self) -> str:
        out = f"{self.kind}, halo {self.halo} latent(s)"
        if self.left_out:
            out += f"; {len(self.left_out)} left out by the grid: " + "; ".join(
                f"{k}: {why}" for k, why in self.left_out[:3]
            )
        return out

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
        return [halo_window(a, b, self.halo, TEMPORAL_STRIDE, True) for a, b in runs]

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        """``[z, F, h, w]``: the latent frames of ``ranges`` encoded from their halo windows'
        raw frames only; every other frame zero. An undecodable or truncated clip raises
        ``ValueError`` naming the clip."""
        from megatron_video.data.video_windows import encode_with_halo

        plan = self.plans[key]
        F, h, w = plan.latent
        out: Optional[torch.Tensor] = None
        dtype = next((p.dtype for p in _parameters(self.encoder)), torch.float32)
        for win in self.windows(key, ranges):
            raw = self._read(plan, win)
            with torch.no_grad():
                lat = encode_with_halo(self.encoder, raw[None].to(dtype), win)[0, : self.z]
            if out is None:
                out = lat.new_zeros(self.z, F, h, w)
            out[:, win.latent_start : win.latent_end] = lat
        return out if out is not None else torch.zeros(self.z, F, h, w, dtype=dtype)

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
    params = getattr(encoder, "parameters", None)
    return params() if callable(params) else iter(())


def _clip_item(config: Config, s: dict) -> dict:
    """``{latent [z, F, h, w] float, caption, text_emb?, text_mask?}`` of one shard sample
    (``ShardReader``'s form), checked: ``ValueError`` names the sample and the rule."""
    d, z, key = config.data, config.vae.latent_channels, s["key"]
    lat = s.get("latent")
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


class LazyShardClipSource(ClipSource):
    """``data.shards`` by key without holding every clip's latents: up front only the index
    (``data.shards.ShardIndex``: tar member offsets from the headers, captions, and each clip's
    latent grid from ``meta.json``'s ``latent_shape`` as ``precompute`` writes it; a sample
    without one is read once for its shape); a clip's tensors are read from its offsets
    (weights-only, nothing unpickled) when a micro-batch needs them, the last ``cache`` kept."""

    kind = "precomputed latent shards (read lazily)"

    def __init__(self, config: Config, cache: int = 32):
        from collections import OrderedDict

        from megatron_video.data.shards import ShardIndex

        self.config, self.cache = config, cache
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
        return tuple(self._item(key)["latent"].shape[1:])

    def _item(self, key: str) -> dict:
        if key in self._recent:
            self._recent.move_to_end(key)
            return self._recent[key]
        item = _clip_item(self.config, self.index.read(key))
        self.loads += 1
        grid = self.grids.get(key)
        if grid is not None and tuple(item["latent"].shape[1:]) != grid:
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

    def latents(self, key: str, ranges: Ranges) -> torch.Tensor:
        return self._item(key)["latent"]


def clip_source(config: Config, vae=None) -> ClipSource:
    """The source of ``config.data.source``: ``shards`` -> ``LazyShardClipSource``, ``energon`` ->
    ``RawClipSource`` encoding with ``vae.encoder`` (the trainer's causal VAE) and
    ``vae.halo_latents``."""
    d = config.data
    if d.source == "shards":
        return LazyShardClipSource(config)
    if d.source == "energon":
        if vae is None:  # (a family without a VAE is refused by config.validate)
            raise ValueError(
                "vae (None) must be the trainer's causal VAE with data.source 'energon': raw "
                "clips are encoded per CP rank"
            )
        return RawClipSource(config, vae.encoder, config.vae.halo_latents)
    raise ValueError(
        f"data.source ({d.source!r}) must be 'shards' or 'energon' with data.buckets "
        f"(clips are read by key)"
    )
