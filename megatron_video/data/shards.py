"""WebDataset shards of clips or latents: a writer (``write_shards``) and a data-parallel-sharded
reader (``ShardReader``); the sample format is described on ``write_shards``.
"""

from __future__ import annotations

import glob
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple, Union

import numpy as np
import torch
import webdataset as wds
from tqdm.auto import tqdm

from .synthetic import check_dp_rank

__all__ = ["write_shards", "list_shards", "ShardReader", "ShardIndex"]

_DATA_KEYS = ("video", "latent")
_SPLITS = ("shards", "samples")


def _to_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def write_shards(
    samples: Iterable[Mapping],
    out_dir: Union[str, Path],
    *,
    samples_per_shard: int = 64,
    prefix: str = "shard",
    progress: bool = False,
) -> list[str]:
    """Write ``samples`` into ``out_dir/<prefix>-000000.tar, ...``; returns the shard paths in order.

    Each sample is a mapping with exactly one of ``video`` / ``latent`` (array or tensor), a
    ``caption`` string, and optionally ``meta`` (a JSON-serialisable dict) and ``key`` (no dots;
    default: the running sample number, zero-padded).

    A shard is a tar of samples, each ``<key>.video.npy`` (raw clip, by convention ``[C, T, H, W]``
    in ``[-1, 1]``) or ``<key>.latent.npy`` (VAE latents), plus ``<key>.caption.txt`` and
    ``<key>.meta.json``. ``megatron-video precompute`` writes ``<key>.latent.pth`` instead (a dict
    of tensors: ``latent`` and optionally ``text_emb`` / ``text_mask``; read with
    ``torch.load(weights_only=True)``, never unpickled).
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard ({samples_per_shard}) must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    writer = None
    seen: set[str] = set()
    try:
        for n, sample in enumerate(tqdm(samples, disable=not progress, desc="writing shards")):
            record = _record(n, sample)
            if record["__key__"] in seen:
                raise ValueError(f"sample {n}: key ({record['__key__']!r}) must be unique")
            seen.add(record["__key__"])
            if n % samples_per_shard == 0:
                if writer is not None:
                    writer.close()
                paths.append(str(out / f"{prefix}-{len(paths):06d}.tar"))
                writer = wds.TarWriter(paths[-1])
            writer.write(record)
    finally:
        if writer is not None:
            writer.close()
    return paths


def _record(n: int, sample: Mapping) -> dict:
    present = [k for k in _DATA_KEYS if k in sample]
    if len(present) != 1:
        raise ValueError(
            f"sample {n}: keys {sorted(sample)} must contain exactly one of {_DATA_KEYS}"
        )
    caption = sample.get("caption")
    if not isinstance(caption, str):
        raise ValueError(f"sample {n}: caption ({caption!r}) must be a str")
    meta = dict(sample.get("meta", {}))
    json.dumps(meta)  # fail here, not half-way through a shard, if meta is not JSON-serialisable
    key = str(sample.get("key", f"{n:09d}"))
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample {n}: key ({key!r}) must be non-empty without '.' or '/'")
    return {
        "__key__": key,
        f"{present[0]}.npy": _to_numpy(sample[present[0]]),
        "caption.txt": caption,
        "meta.json": meta,
    }


def list_shards(source: Union[str, Path, Sequence[Union[str, Path]]]) -> list[str]:
    """Sorted shard paths from a folder (its ``*.tar``), a glob pattern, or an explicit list."""
    if isinstance(source, (list, tuple)):
        paths = [str(p) for p in source]
    elif Path(source).is_dir():
        paths = glob.glob(str(Path(source) / "*.tar"))
    else:
        paths = glob.glob(str(source))
    if not paths:
        raise ValueError(f"source ({source!r}) must name at least one .tar shard")
    return sorted(paths)


def _identity(src):
    return src


class ShardReader(torch.utils.data.IterableDataset):
    """Yield ``{"key", "video" | "latent" (tensor), "caption", "meta"}`` from shards, split by DP
    rank.

    The data-parallel split is deterministic: with ``split="shards"`` rank ``r`` reads shards
    ``r::dp_size`` of the sorted shard list (each rank opens only its own files); with
    ``split="samples"`` every rank reads all shards and keeps global samples ``r::dp_size`` (even
    with fewer shards than ranks). Either way the ranks' subsets are disjoint and their union is
    every sample. Inside a rank, DataLoader workers split the rank's share the same way.
    """

    def __init__(
        self,
        shards: Union[str, Path, Sequence[Union[str, Path]]],
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        split: str = "shards",
    ):
        super().__init__()
        check_dp_rank(dp_rank, dp_size)
        if split not in _SPLITS:
            raise ValueError(f"split ({split!r}) must be one of {_SPLITS}")
        self.shards = list_shards(shards)
        if split == "shards" and len(self.shards) < dp_size:
            raise ValueError(
                f"number of shards ({len(self.shards)}) must be >= dp_size ({dp_size}) with "
                "split='shards'; write more shards or use split='samples'"
            )
        self.dp_rank, self.dp_size, self.split = dp_rank, dp_size, split

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.split == "shards":
            urls = self.shards[self.dp_rank :: self.dp_size][worker::num_workers]

            def keep(j):
                return True  # every sample of the rank's own shards
        else:
            urls = self.shards

            def keep(j):
                # Global sample j belongs to rank j % dp_size; within the rank, to worker (j // dp_size) % nw.
                return (
                    j % self.dp_size == self.dp_rank and (j // self.dp_size) % num_workers == worker
                )

        if not urls:
            return
        # Node/worker splitting is done above, deterministically; webdataset only reads and decodes.
        stream = wds.WebDataset(
            urls,
            shardshuffle=False,
            nodesplitter=_identity,
            workersplitter=_identity,
            empty_check=False,
        ).map(_decode)
        for j, raw in enumerate(stream):
            if keep(j):
                yield _sample(raw)


_ENTRIES = {f"{k}.npy" for k in _DATA_KEYS} | {"caption.txt", "meta.json", "latent.pth"}
_PTH_KEYS = ("latent", "text_emb", "text_mask")  # tensors of a precomputed ``latent.pth`` entry


def _decode(raw: dict) -> dict:
    """Decode one tar sample without running code from the file: ``.npy`` with
    ``allow_pickle=False`` (object arrays refused), text as UTF-8, JSON with ``json``; any other
    entry (``.pyd`` / ``.pickle`` / ``.pth``, which webdataset's default decoders would unpickle)
    is refused. Precomputed text embeddings belong in ``.npy`` entries, converted when preparing
    the shards, never as pickles."""
    out = {}
    key = raw.get("__key__")
    for name, value in raw.items():
        if name.startswith("__"):
            out[name] = value
            continue
        if name not in _ENTRIES:
            raise ValueError(
                f"shard sample {key!r}: entry {name!r} must be one of {sorted(_ENTRIES)} "
                f"(pickled or unknown entries are refused; nothing was decoded)"
            )
        if name == "latent.pth":  # `megatron-video precompute`: tensors only, read weights-only
            try:
                blob = torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
            except Exception as e:
                raise ValueError(
                    f"shard sample {key!r}: entry 'latent.pth' must be a weights-only torch "
                    f"file of tensors (refused, nothing executed): {type(e).__name__}"
                ) from None
            if (
                not isinstance(blob, dict)
                or not isinstance(blob.get("latent"), torch.Tensor)
                or any(
                    k not in _PTH_KEYS or not isinstance(v, torch.Tensor) for k, v in blob.items()
                )
            ):
                raise ValueError(
                    f"shard sample {key!r}: entry 'latent.pth' must hold a dict of tensors with "
                    f"'latent' and optionally 'text_emb' / 'text_mask'"
                )
            out[name] = blob
        elif name.endswith(".npy"):
            try:
                out[name] = np.lib.format.read_array(io.BytesIO(value), allow_pickle=False)
            except ValueError as e:
                raise ValueError(
                    f"shard sample {key!r}: entry {name!r} must be a plain numeric .npy "
                    f"array (object arrays need pickle, refused): {e}"
                ) from None
        elif name.endswith(".json"):
            out[name] = json.loads(value.decode("utf-8"))
        else:
            out[name] = value.decode("utf-8")
    return out


def _sample(raw: dict) -> dict:
    out = {"key": raw["__key__"], "caption": raw["caption.txt"], "meta": raw.get("meta.json", {})}
    for k in _DATA_KEYS:
        if f"{k}.npy" in raw:
            out[k] = torch.from_numpy(np.ascontiguousarray(raw[f"{k}.npy"]))
    out.update(raw.get("latent.pth", {}))  # precomputed latent (+ text embeddings)
    return out


_MEMBER = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's <key>.<entry> split
_TEXT_ENTRIES = ("caption.txt", "meta.json")


class ShardIndex:
    """Random access by key to the samples of shards (a folder, glob or list, as ``ShardReader``)
    without reading their tensors up front: one pass over each tar's headers (``tarfile`` seeks
    past every member's data) records where each entry lies; only the small text entries
    (``caption.txt``, ``meta.json``) are read. ``keys`` (in shard order), ``caption(key)``,
    ``meta(key)``; ``read(key)`` reads one sample's entries from their offsets and decodes them
    as ``ShardReader`` does (``.npy`` without pickle, ``latent.pth`` weights-only)."""

    def __init__(self, shards: Union[str, Path, Sequence[Union[str, Path]]]):
        self.shards = list_shards(shards)
        self.entries: Dict[str, Dict[str, Tuple[int, int, int]]] = {}
        self._text: Dict[str, Dict[str, bytes]] = {}
        for s, path in enumerate(self.shards):
            seen: set = set()
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    parts = _MEMBER.match(m.name) if m.isfile() else None
                    if parts is None:
                        continue
                    key, entry = parts.groups()
                    if key in self.entries and key not in seen:
                        raise ValueError(
                            f"shard sample {key!r} ({path}): keys must be unique across the shards"
                        )
                    seen.add(key)
                    self.entries.setdefault(key, {})[entry] = (s, m.offset_data, m.size)
                    if entry in _TEXT_ENTRIES:
                        self._text.setdefault(key, {})[entry] = tar.extractfile(m).read()
        self.keys: List[str] = list(self.entries)

    def caption(self, key: str) -> str:
        return self._text.get(key, {}).get("caption.txt", b"").decode("utf-8")

    def meta(self, key: str) -> dict:
        raw = self._text.get(key, {}).get("meta.json")
        return json.loads(raw.decode("utf-8")) if raw else {}

    def read(self, key: str) -> dict:
        """One sample, ``{"key", "video" | "latent", "caption", "meta", ...}`` (``ShardReader``'s
        form), read from its recorded offsets."""
        raw: dict = {"__key__": key}
        by_shard: Dict[int, List[Tuple[str, int, int]]] = {}
        for entry, (s, offset, size) in self.entries[key].items():
            by_shard.setdefault(s, []).append((entry, offset, size))
        for s, members in by_shard.items():  # a sample's entries lie in one shard: one open
            with open(self.shards[s], "rb") as f:
                for entry, offset, size in members:
                    f.seek(offset)
                    raw[entry] = f.read(size)
        raw.setdefault("caption.txt", b"")
        return _sample(_decode(raw))
