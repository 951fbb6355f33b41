"""Topology (U x R groups from Megatron's CP group) and communication (traced, autograd-aware)."""

from .comm import (
    CommEvent,
    CommTracer,
    RingExchange,
    all_gather_cat,
    all_reduce,
    all_to_all,
    check_same_shape,
    ring_shift,
    shape_check_scope,
)
from .topology import (
    PLACEMENTS,
    VideoParallelGroups,
    destroy_video_parallel,
    get_video_parallel_groups,
    init_video_parallel,
)

__all__ = [
    "CommEvent",
    "CommTracer",
    "RingExchange",
    "all_gather_cat",
    "all_reduce",
    "all_to_all",
    "check_same_shape",
    "ring_shift",
    "shape_check_scope",
    "PLACEMENTS",
    "VideoParallelGroups",
    "destroy_video_parallel",
    "get_video_parallel_groups",
    "init_video_parallel",
]
