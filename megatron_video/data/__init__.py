"""Data: procedural videos (the embedded default), captions, WebDataset shards, buckets, balance and
the sample ledger of mixed-shape training."""

from .shards import ShardReader, list_shards, write_shards
from .synthetic import (
    CaptionTokenizer,
    ProceduralVideoDataset,
    ShapeAttributes,
    caption_for,
    render_video,
    sample_attributes,
    shard_indices,
)

__all__ = [
    "ShardReader",
    "list_shards",
    "write_shards",
    "CaptionTokenizer",
    "ProceduralVideoDataset",
    "ShapeAttributes",
    "caption_for",
    "render_video",
    "sample_attributes",
    "shard_indices",
]
from .video_windows import (  # noqa: E402
    TensorFrameSource,
    encode_rank_latents,
    encode_with_halo,
    rank_windows,
    read_window,
    scatter_windows,
)

__all__ += [
    "TensorFrameSource",
    "encode_rank_latents",
    "encode_with_halo",
    "rank_windows",
    "read_window",
    "scatter_windows",
]
from .balance import Assignment, balance_clips, clip_costs  # noqa: E402
from .buckets import BucketConfig, BucketGrid, ClipPlan, aspect_ratio, resize_crop  # noqa: E402
from .ledger import SampleLedger, StepBatch, StepSampler  # noqa: E402

__all__ += [
    "Assignment",
    "balance_clips",
    "clip_costs",
    "BucketConfig",
    "BucketGrid",
    "ClipPlan",
    "aspect_ratio",
    "resize_crop",
    "SampleLedger",
    "StepBatch",
    "StepSampler",
]
