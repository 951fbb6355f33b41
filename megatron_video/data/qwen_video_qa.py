"""Video QA from a megatron-energon dataset in the Qwen2.5-VL processor's conventions, each CP rank
decoding only the frames it encodes (``QwenVideoQA``).

The conventions are transformers' ``Qwen2VLVideoProcessor`` / ``Qwen2_5_VLProcessor``'s (tests
compare every output with theirs): frames sampled at ``fps`` per second (``sample_frame_indices``:
``floor(clamp(total / source_fps * fps, min_frames, max_frames, total) / temporal) * temporal``
frames at ``arange(0, total, total / n)``), resized to ``smart_resize``'s size (both sides
multiples of ``patch * merge``, pixels in ``[min_pixels, max_pixels]``, bicubic), rescaled by
1 / 255, normalised with CLIP's mean and std, patchified by temporal patch, merged row / column and
the ``merge x merge`` block; the grid ``(n / temporal, H / patch, W / patch)`` and
``second_per_grid_t = temporal / sampled_fps``; the text the tokenizer's chat template renders,
its one ``<|video_pad|>`` expanded to ``t * h * w / merge**2`` tokens.

Under context parallelism ``mmsp.qwen_vl.MMSPQwenVLModel`` encodes on each CP rank a contiguous run
of every video's temporal patches (``layouts.mmsp.frame_shards``); ``QwenVideoQA.sample(key,
cp_rank, cp_size)`` decodes only the source frames from that run's first to its last sampled frame
and returns only its pixel rows (``decoded_frames`` counts what was decoded).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import torch

from ..checks import check_int
from ..layouts.mmsp import frame_shards

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "VideoProcessing",
    "VideoPlan",
    "QwenVideoQA",
    "smart_resize",
    "sample_frame_indices",
    "plan_video",
    "pixel_rows",
    "processing_from_folder",
    "check_matches_model",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class VideoProcessing:
    """The video processor's numbers (``Qwen2VLVideoProcessor``'s defaults; ``min_pixels`` /
    ``max_pixels`` are its ``size["shortest_edge"]`` / ``size["longest_edge"]``)."""

    patch: int = 14
    temporal: int = 2
    merge: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self):
        for name in ("patch", "temporal", "merge", "min_pixels", "max_pixels", "min_frames"):
            check_int(name, getattr(self, name), 1)
        if self.max_frames < self.temporal or not self.fps > 0 or not math.isfinite(self.fps):
            raise ValueError(
                f"fps ({self.fps}) must be a finite positive number and max_frames "
                f"({self.max_frames}) >= temporal ({self.temporal})"
            )


def processing_from_folder(folder: Union[str, Path]) -> VideoProcessing:
    """``VideoProcessing`` of an HF Qwen2.5-VL folder: ``video_preprocessor_config.json``, else
    ``preprocessor_config.json`` (``patch_size``, ``temporal_patch_size``, ``merge_size``,
    ``size`` or ``min_pixels`` / ``max_pixels``, ``fps``, ``min_frames``, ``max_frames``; absent
    keys keep ``Qwen2VLVideoProcessor``'s defaults). Its mean / std must be CLIP's."""
    import json

    d = Path(folder)
    file = next((d / n for n in ("video_preprocessor_config.json", "preprocessor_config.json")
                 if (d / n).is_file()), None)  # fmt: skip
    if file is None:
        raise ValueError(f"folder ({str(folder)!r}) must hold a (video_)preprocessor_config.json")
    cfg = json.loads(file.read_text())
    for name, want in (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)):
        got = cfg.get(name, want)
        if len(got) != 3 or any(abs(a - b) > 1e-6 for a, b in zip(got, want)):
            raise ValueError(f"{file.name} {name} ({got}) must be CLIP's ({list(want)})")
    size = cfg.get("size") or {}
    base = VideoProcessing()
    kw = dict(
        patch=cfg.get("patch_size", base.patch),
        temporal=cfg.get("temporal_patch_size", base.temporal),
        merge=cfg.get("merge_size", base.merge),
        min_pixels=size.get("shortest_edge", cfg.get("min_pixels", base.min_pixels)),
        max_pixels=size.get("longest_edge", cfg.get("max_pixels", base.max_pixels)),
        fps=float(cfg.get("fps") or base.fps),
        min_frames=cfg.get("min_frames", base.min_frames),
        max_frames=cfg.get("max_frames", base.max_frames),
    )
    return VideoProcessing(**kw)


def check_matches_model(proc: VideoProcessing, hf_config, tokenizer) -> None:
    """``ValueError`` naming the field where the processing or the tokenizer disagrees with the
    model's ``Qwen2_5_VLConfig`` (patch sizes, the video / vision start / end token ids)."""
    v = hf_config.vision_config
    for field, ours, theirs in (
        ("patch", proc.patch, v.patch_size),
        ("temporal", proc.temporal, v.temporal_patch_size),
        ("merge", proc.merge, v.spatial_merge_size),
    ):
        if ours != theirs:
            raise ValueError(
                f"processor {field} ({ours}) must equal the model config's vision_config ({theirs})"
            )
    for tok, field in (
        (VIDEO_PAD, "video_token_id"),
        ("<|vision_start|>", "vision_start_token_id"),
        ("<|vision_end|>", "vision_end_token_id"),
    ):
        got = tokenizer.convert_tokens_to_ids(tok)
        if got != getattr(hf_config, field):
            raise ValueError(
                f"tokenizer's {tok} id ({got}) must equal the model config's {field} "
                f"({getattr(hf_config, field)})"
            )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """Qwen2-VL's ``(H, W)``: multiples of ``factor`` nearest ``(height, width)`` with ``H * W``
    in ``[min_pixels, max_pixels]`` (scaled down by floor, up by ceil, keeping the aspect)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video aspect ratio ({width}x{height}) must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def sample_frame_indices(total: int, source_fps: float, proc: VideoProcessing) -> List[int]:
    """The source frames sampled at ``proc.fps`` frames per second (``sample_frames``'s rule)."""
    t = proc.temporal
    top = math.floor(min(proc.max_frames, total) / t) * t
    n = min(max(total / source_fps * proc.fps, proc.min_frames), top, total)
    n = math.floor(n / t) * t
    if n < t:
        raise ValueError(
            f"video of {total} frames must give >= temporal ({t}) frames at fps ({proc.fps})"
        )
    return torch.arange(0, total, total / n).int().tolist()


@dataclass(frozen=True)
class VideoPlan:
    """One video's sampling: the source frame of each sampled frame, the resized ``(H, W)``, the
    grid ``(t, h, w)`` in patches and ``second_per_grid_t``."""

    indices: Tuple[int, ...]
    size: Tuple[int, int]
    grid: Tuple[int, int, int]
    second_per_grid_t: float

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def unit_frames(self, units: Sequence[int], temporal: int) -> List[int]:
        """Source frames of temporal patches ``units`` (the last patch repeats the last frame)."""
        last = len(self.indices) - 1
        return [self.indices[min(u * temporal + k, last)] for u in units for k in range(temporal)]


def plan_video(record: Dict, proc: VideoProcessing) -> VideoPlan:
    """The plan of a prepared clip (``record``: ``num_frames``, ``fps``, ``height``, ``width``)."""
    total, fps = int(record["num_frames"]), float(record["fps"])
    if not fps > 0:
        raise ValueError(f"video {record.get('key')!r} fps ({fps}) must be > 0 to sample by fps")
    idx = sample_frame_indices(total, fps, proc)
    f = proc.patch * proc.merge
    H, W = smart_resize(int(record["height"]), int(record["width"]), f, proc.min_pixels,
                        proc.max_pixels)  # fmt: skip
    grid = (-(-len(idx) // proc.temporal), H // proc.patch, W // proc.patch)
    sampled_fps = len(idx) / total * fps
    return VideoPlan(tuple(idx), (H, W), grid, proc.temporal / sampled_fps)


def pixel_rows(frames: torch.Tensor, plan: VideoPlan, proc: VideoProcessing) -> torch.Tensor:
    """``[T, 3, h, w]`` uint8 frames (T a multiple of ``temporal``) -> the processor's pixel rows
    ``[T / temporal * H/p * W/p, 3 * temporal * p * p]`` float32."""
    x = frames.to(torch.float32)
    if tuple(x.shape[-2:]) != plan.size:
        x = torch.nn.functional.interpolate(
            x, size=plan.size, mode="bicubic", align_corners=False, antialias=True
        )
        x = x.round().clamp(0, 255)  # torchvision's resize of uint8 images returns uint8
    mean = torch.tensor(CLIP_MEAN)[:, None, None]
    std = torch.tensor(CLIP_STD)[:, None, None]
    x = (x / 255.0 - mean) / std
    P, TP, M = proc.patch, proc.temporal, proc.merge
    T, C, H, W = x.shape
    gt, gh, gw = T // TP, H // P, W // P
    x = x.reshape(gt, TP, C, gh // M, M, P, gw // M, M, P).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * TP * P * P)


class QwenVideoQA:
    """Question / answer samples over a prepared energon dataset (``data.energon_video.
    prepare_dataset``; the clip's caption is the answer to ``question``), written as the
    Qwen2.5-VL processor writes them, each CP rank decoding only its temporal patches' frames.

    ``tokenizer``: a transformers tokenizer with a Qwen2.5-VL chat template (a user turn of one
    video and the question renders ``<|vision_start|><|video_pad|><|vision_end|>``).
    """

    def __init__(self, path: Union[str, Path], tokenizer, proc: VideoProcessing = VideoProcessing(),
                 question: str = "Describe this video."):  # fmt: skip
        from megatron.energon.cache.file_store import WebdatasetFileStore
        from megatron.energon.epathlib import EPath

        from .energon_video import dataset_records

        self.records = {r["key"]: r for r in dataset_records(path)}
        self.store = WebdatasetFileStore(EPath(Path(path)))
        self.tokenizer, self.proc, self.question = tokenizer, proc, question
        self.decoded_frames = 0  # source frames decoded so far (all calls)
        if tokenizer.convert_tokens_to_ids(VIDEO_PAD) in (None, tokenizer.unk_token_id):
            raise ValueError(f"tokenizer must know the {VIDEO_PAD} token")

    def prompt(self) -> str:
        """The chat template's text of the user turn (one video, the question), generation prompt
        added; the video is the one ``<|video_pad|>``."""
        messages = [
            {
                "role": "user",
                "content": [{"type": "video"}, {"type": "text", "text": self.question}],
            }
        ]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        if text.count(VIDEO_PAD) != 1:
            raise ValueError(
                f"tokenizer's chat_template must render one {VIDEO_PAD} for a video (got "
                f"{text.count(VIDEO_PAD)})"
            )
        return text

    def text(self, plan: VideoPlan, answer: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``: the prompt with the video expanded, then the answer and the end
        of turn; labels (HF's unshifted convention) only on the answer and its end token."""
        n = plan.num_tokens // self.proc.merge**2
        prompt = self.prompt().replace(VIDEO_PAD, VIDEO_PAD * n)
        tok = self.tokenizer
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor(p_ids + a_ids)
        labels = torch.cat([torch.full((len(p_ids),), -100), torch.tensor(a_ids)])
        return ids, labels

    def sample(self, key: str, cp_rank: int = 0, cp_size: int = 1, units=None) -> Dict:
        """Clip ``key`` as a sample: ``input_ids``, ``labels``, ``video_grid_thw [1, 3]``,
        ``second_per_grid_ts [1]``, ``local_units`` (this rank's temporal patches) and
        ``pixel_values_videos`` -- only those patches' rows (every row at ``cp_size`` 1).
        ``units``: this rank's temporal patches of the clip where it is not a micro-batch's first
        video (``frame_shards`` of several videos rotates the longer runs); default: the clip's
        own ``frame_shards``."""
        check_int("cp_size", cp_size, 1)
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank ({cp_rank}) must be in [0, cp_size ({cp_size}))")
        rec = self.records.get(key)
        if rec is None:
            raise ValueError(f"clip {key!r} is not in the dataset")
        plan = plan_video(rec, self.proc)
        if plan.grid[0] < cp_size:
            raise ValueError(
                f"cp_size ({cp_size}) must be <= clip {key!r}'s temporal patches ({plan.grid[0]} "
                f"at fps {self.proc.fps}): every CP rank encodes at least one"
            )
        if units is None:
            units = frame_shards([plan.grid[0]], cp_size).local_units(cp_rank).tolist()
        units = [int(u) for u in units]
        if not units or min(units) < 0 or max(units) >= plan.grid[0]:
            raise ValueError(f"units ({units}) must be clip {key!r}'s temporal patches")
        src = plan.unit_frames(units, self.proc.temporal)
        lo, hi = min(src), max(src)
        data, _ = self.store[f"{key}.{rec.get('ext', 'mp4')}"]
        got = _decode_range(data, lo, hi)
        if got.shape[0] != hi - lo + 1:
            raise ValueError(f"clip {key!r}: decoded {got.shape[0]} frames for {lo}..{hi}")
        self.decoded_frames += got.shape[0]
        ids, labels = self.text(plan, rec["caption"])
        return {
            "input_ids": ids,
            "labels": labels,
            "pixel_values_videos": pixel_rows(got[torch.tensor(src) - lo], plan, self.proc),
            "video_grid_thw": torch.tensor([plan.grid]),
            "second_per_grid_ts": torch.tensor([plan.second_per_grid_t]),
            "local_units": torch.tensor(units, dtype=torch.long),
        }


def _decode_range(data: bytes, lo: int, hi: int) -> torch.Tensor:
    """Frames ``lo .. hi`` of an encoded video, ``[T, 3, H, W]`` uint8."""
    from megatron.energon.av import AVDecoder

    clips, _ = AVDecoder(io.BytesIO(data)).get_video_clips([(lo, hi)], video_unit="frames")
    return clips[0]
