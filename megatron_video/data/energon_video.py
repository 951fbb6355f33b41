"""Real video through megatron-energon: dataset preparation (``prepare_dataset``, ``megatron-video
prepare``) and random access to its clips by key (``KeyedClips``), decoding only the raw frames of
a halo window: every rank reads the clips the sample ledger names, so there is no loader state.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..layouts.vae_halo import HaloWindow
from .buckets import ClipPlan, resize_crop

__all__ = [
    "VIDEO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "probe_image",
    "probe_video",
    "prepare_dataset",
    "dataset_records",
    "KeyedClips",
    "write_procedural_videos",
    "read_image_frame",
]

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # one-frame clips (mixed shapes)
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS + IMAGE_EXTENSIONS
log = logging.getLogger("megatron_video.data")


# ----------------------------------------------------------------------------------------------
# Preparation
# ----------------------------------------------------------------------------------------------
def probe_video(data: Union[bytes, str, Path], name: str = "") -> Dict:
    """``{"num_frames", "fps", "width", "height"}`` of an encoded video (frames counted by decoding
    packets' headers, i.e. demuxing: exact also where the container stores no frame count)."""
    import av

    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data)
    try:
        with av.open(src) as c:
            if not c.streams.video:
                raise ValueError(f"video {name or src!r} has no video stream")
            s = c.streams.video[0]
            n = sum(1 for p in c.demux(s) if p.size)
            fps = float(s.average_rate) if s.average_rate else 0.0
            w, h = s.codec_context.width, s.codec_context.height
    except (
        Exception
    ) as e:  # PyAV raises its own error types (some are ValueErrors) for broken files
        if str(e).startswith("video "):
            raise
        raise ValueError(f"video {name or src!r} is unreadable: {type(e).__name__}: {e}") from None
    if n < 1 or not w or not h:
        raise ValueError(f"video {name or src!r} has no frames")
    return {"num_frames": int(n), "fps": fps, "width": int(w), "height": int(h)}


def probe_image(data: bytes, name: str = "") -> Dict:
    """``{"num_frames": 1, "fps": 0.0, "width", "height"}`` of an encoded image (a one-frame clip)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            im.verify()
    except Exception as e:  # PIL raises its own error types for broken files
        raise ValueError(f"image {name!r} is unreadable: {type(e).__name__}: {e}") from None
    return {"num_frames": 1, "fps": 0.0, "width": int(w), "height": int(h)}


def _captions(src: Path, manifest: Optional[Path]) -> List[Tuple[Path, str]]:
    if manifest is not None:
        out = []
        for n, line in enumerate(Path(manifest).read_text().splitlines()):
            if not line.strip():
                continue
            rec = json.loads(line)
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("video"), str)
                or not isinstance(rec.get("caption"), str)
            ):
                raise ValueError(
                    f"manifest {manifest} line {n + 1} ({line[:80]!r}) must be a JSON object "
                    f"with string fields 'video' and 'caption'"
                )
            out.append((src / rec["video"], rec["caption"]))
        return out
    out = []
    for f in sorted(p for p in src.rglob("*") if p.suffix[1:].lower() in MEDIA_EXTENSIONS):
        txt, js = f.with_suffix(".txt"), f.with_suffix(".json")
        if txt.is_file():
            cap = txt.read_text().strip()
        elif js.is_file():
            cap = json.loads(js.read_text()).get("caption")
            if not isinstance(cap, str):
                raise ValueError(f'caption file {js} must hold {{"caption": <string>}}')
        else:
            raise ValueError(
                f"video {f} has no caption: add {txt.name} or {js.name}, or pass a JSONL manifest"
            )
        out.append((f, cap))
    return out


def prepare_dataset(
    src: Union[str, Path],
    dst: Union[str, Path],
    *,
    manifest: Optional[Union[str, Path]] = None,
    samples_per_shard: int = 64,
    progress: bool = False,
) -> Dict:
    """Turn the videos + captions under ``src`` into an energon dataset at ``dst``.
    Returns a summary: ``{"samples", "shards", "skipped": [(file, reason)], "videos": [meta...]}``.

    ``src``: a folder of videos (``.mp4`` / ``.webm`` / ``.mkv``) with captions -- a sidecar
    ``<name>.txt`` (the caption) or ``<name>.json`` (``{"caption": ...}``), or a JSONL ``manifest``
    of ``{"video": <relative path>, "caption": ...}`` lines. The result: WebDataset tars of crude
    samples ``<key>.<ext>`` (the encoded video bytes, untouched) + ``<key>.json`` (caption,
    ``num_frames``, ``fps``, ``width``, ``height``, ``source``), indexed by energon's own
    ``BaseWebdatasetFactory.prepare_dataset`` (``.nv-meta``: split, index) with a
    ``CrudeWebdataset`` ``dataset.yaml``. Unreadable videos are reported by name and left out.
    """
    import webdataset as wds
    from megatron.energon import BaseWebdatasetFactory

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"SRC ({str(src)!r}) must be a folder of videos")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard ({samples_per_shard}) must be >= 1")
    items = _captions(src, Path(manifest) if manifest else None)
    if not items:
        raise ValueError(f"SRC ({str(src)!r}) holds no {'/'.join(MEDIA_EXTENSIONS)} files")
    dst.mkdir(parents=True, exist_ok=True)
    shards, skipped, metas, writer, n = [], [], [], None, 0
    try:
        for path, caption in items:
            ext = path.suffix[1:].lower()
            if ext not in MEDIA_EXTENSIONS:
                skipped.append((str(path), f"extension must be one of {MEDIA_EXTENSIONS}"))
                continue
            try:
                data = path.read_bytes()
                probe = probe_image if ext in IMAGE_EXTENSIONS else probe_video
                meta = probe(data, str(path))
            except (OSError, ValueError) as e:
                skipped.append((str(path), str(e)))
                log.warning("prepare: skipped %s: %s", path, e)
                continue
            if n % samples_per_shard == 0:
                if writer is not None:
                    writer.close()
                shards.append(f"videos-{len(shards):06d}.tar")
                writer = wds.TarWriter(str(dst / shards[-1]))
            meta = dict(meta, caption=caption, source=str(path.relative_to(src)), ext=ext)
            writer.write({"__key__": f"{n:09d}", ext: data, "json": json.dumps(meta).encode()})
            metas.append(dict(meta, key=f"{n:09d}"))
            n += 1
    finally:
        if writer is not None:
            writer.close()
    if not shards:
        raise ValueError(f"no readable video under {src} (skipped: {skipped[:3]})")
    BaseWebdatasetFactory.prepare_dataset(
        dst, shards, split_parts_ratio=[("train", 1.0)], shuffle_seed=None, workers=1
    )
    (dst / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    )
    summary = {"samples": n, "shards": shards, "skipped": skipped, "videos": metas}
    (dst / ".nv-meta" / "megatron_video.json").write_text(json.dumps(summary, indent=1))
    return summary


def dataset_records(path: Union[str, Path]) -> List[Dict]:
    """Per-clip metadata of a prepared dataset (``key``, ``num_frames``, ``fps``, ``width``,
    ``height``, ...) from ``.nv-meta/megatron_video.json``, e.g. for ``BucketGrid.plan_many``."""
    summary = Path(path) / ".nv-meta" / "megatron_video.json"
    if not summary.is_file():
        raise ValueError(
            f"data.path ({str(path)!r}) must be a dataset from `megatron-video prepare` "
            f"(no {summary.relative_to(path)})"
        )
    videos = json.loads(summary.read_text()).get("videos", [])
    return [dict(v, key=v.get("key", f"{i:09d}")) for i, v in enumerate(videos)]


def write_procedural_videos(
    out_dir: Union[str, Path],
    num_videos: int,
    *,
    num_frames: int = 29,
    height: int = 32,
    width: int = 32,
    seed: int = 0,
    fps: int = 8,
    gop: int = 8,
) -> List[Path]:
    """The embedded procedural clips (``data.synthetic``) as real mp4 files (H.264 via PyAV, a key
    frame every ``gop`` frames so frame-range decoding can seek) with sidecar ``.txt`` captions."""
    import av

    from .synthetic import ProceduralVideoDataset

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds = ProceduralVideoDataset(
        num_videos, num_frames=num_frames, height=height, width=width, seed=seed
    )
    paths = []
    for i in range(num_videos):
        s = ds[i]
        frames = ((s["video"].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [3, T, H, W]
        p = out / f"clip{i:06d}.mp4"
        with av.open(str(p), "w") as c:
            st = c.add_stream("libx264", rate=fps)
            st.width, st.height, st.pix_fmt = width, height, "yuv444p"
            st.options = {
                "g": str(gop),
                "keyint_min": str(gop),
                "sc_threshold": "0",
                "qp": "0",
                "bf": "0",
            }
            for t in range(frames.shape[1]):
                img = frames[:, t].permute(1, 2, 0).contiguous().numpy()
                for pkt in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(pkt)
            for pkt in st.encode():
                c.mux(pkt)
        p.with_suffix(".txt").write_text(s["caption"])
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------------------------
# Clips by key (mixed shapes): the sample ledger is the data state
# ----------------------------------------------------------------------------------------------
def _resize_crop(clip: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[T, 3, h, w]`` uint8 -> ``[3, T, H, W]`` float in [-1, 1]: short side to the target (bilinear,
    only when the size differs), centre crop."""
    x = clip.to(torch.float32)
    t, _, h, w = x.shape
    if (h, w) != (height, width):
        nh, nw, top, left = resize_crop(h, w, height, width)
        if (nh, nw) != (h, w):
            x = torch.nn.functional.interpolate(
                x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True
            )
        x = x[:, :, top : top + height, left : left + width]
    return (x / 127.5 - 1.0).permute(1, 0, 2, 3).contiguous()


class KeyedClips:
    """Random access to a prepared dataset's clips by key (energon's ``WebdatasetFileStore`` over
    its sqlite index), for the clips a ``data.ledger.StepSampler`` bins name. It keeps no order
    or state: the ``SampleLedger`` is the data state, so a resume may change the DP size."""

    def __init__(self, path: Union[str, Path]):
        from megatron.energon.cache.file_store import WebdatasetFileStore
        from megatron.energon.epathlib import EPath

        self.records = {r["key"]: r for r in dataset_records(path)}
        self.store = WebdatasetFileStore(EPath(Path(path)))

    def read(self, plan: ClipPlan, window: Optional[HaloWindow] = None) -> torch.Tensor:
        """Clip ``plan.key`` at its bucket: ``[3, plan.num_frames, H, W]`` in ``[-1, 1]`` (the
        plan's source frames, resized and centre-cropped as planned); with a ``window`` (of this
        clip's latents, ``layouts.vae_halo``) only its raw frames are decoded and returned."""
        rec = self.records.get(plan.key)
        if rec is None:
            raise ValueError(f"clip {plan.key!r} is not in the dataset")
        src = plan.source_frames()
        if window is not None:
            if window.raw_end > len(src):
                raise ValueError(
                    f"clip {plan.key!r}: window {window.window} must lie in its "
                    f"{len(src)} planned frames"
                )
            src = src[window.raw_start : window.raw_end]
        ext = rec.get("ext", "mp4")
        data, _ = self.store[f"{plan.key}.{ext}"]
        got = _decode_image(data) if ext in IMAGE_EXTENSIONS else _decode_range(data, src)
        if got.shape[0] != src[-1] - src[0] + 1 or tuple(got.shape[2:]) != (
            rec["height"],
            rec["width"],
        ):
            raise ValueError(
                f"clip {plan.key!r}: decoded {tuple(got.shape)} for frames {src[0]}..{src[-1]} of "
                f"a {rec['height']}x{rec['width']} {ext} (truncated file?)"
            )
        frames = got[torch.tensor(src) - src[0]]
        return _resize_crop(frames, plan.crop[2], plan.crop[3])


def _decode_range(data: bytes, src: Sequence[int]) -> torch.Tensor:
    """Frames ``src[0] .. src[-1]`` of an encoded video, ``[T, 3, H, W]`` uint8."""
    from megatron.energon.av import AVDecoder

    clips, _ = AVDecoder(io.BytesIO(data)).get_video_clips([(src[0], src[-1])], video_unit="frames")
    return clips[0]


def _decode_image(data: bytes) -> torch.Tensor:
    """An encoded image as one frame, ``[1, 3, H, W]`` uint8."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        rgb = np.asarray(im.convert("RGB"))
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None]


def read_image_frame(path: Union[str, Path], height: int, width: int) -> torch.Tensor:
    """An image file as one video frame ``[1, 3, 1, H, W]`` in [-1, 1], resized and centre-cropped
    as training clips are (``ValueError`` naming ``--image`` when it cannot be read)."""
    try:
        frame = _decode_image(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--image ({str(path)!r}) must be a readable image file: {exc}") from None
    return _resize_crop(frame, height, width)[None]
