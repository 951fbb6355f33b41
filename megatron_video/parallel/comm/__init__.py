"""All communication of megatron_video, in one traced place: autograd all-to-all(-v) (``a2a``),
ring P2P (``ring``), collectives (``collectives``), cross-rank agreement checks (``cross_rank``),
group helpers (``groups``), and ``CommTracer`` (``tracer``), which sees every call (tests and
benchmarks assert exact call and byte counts; the byte convention is on ``CommTracer``). Design:
docs/architecture.md, "Capabilities" 1.
"""

from .a2a import all_to_all, all_to_all_single, all_to_all_v, exchange_counts
from .collectives import (
    all_gather_cat,
    all_reduce,
    broadcast,
    copy_to_group,
    gather_from_group,
    scatter,
)
from .cross_rank import agree_or_raise, check_same_shape, check_same_values, shape_check_scope
from .groups import drop_host_groups, group_rank, group_ranks, group_size, host_group
from .ring import RingExchange, ring_shift
from .tracer import CommEvent, CommTracer, record_skipped

__all__ = [
    "CommEvent",
    "CommTracer",
    "all_to_all",
    "all_to_all_single",
    "ring_shift",
    "RingExchange",
    "record_skipped",
    "check_same_shape",
    "shape_check_scope",
    "group_ranks",
    "group_size",
    "group_rank",
    "host_group",
    "drop_host_groups",
    "all_reduce",
    "all_gather_cat",
    "copy_to_group",
    "gather_from_group",
    "broadcast",
    "scatter",
    "all_to_all_v",
    "exchange_counts",
    "check_same_values",
    "agree_or_raise",
]
