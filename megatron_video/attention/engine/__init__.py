"""The tiled local attention engine: linear memory, masks compiled to tiles on global token ids.

``planning`` cuts a block's (q ids x k ids) into tiles, classifies them EMPTY / PARTIAL / FULL and
groups them into kernel calls (pure host code); ``run`` executes them with fused kernels
(``tiles``) merged through the log-sum-exp. Plans are host data, built once and reused
(``attention.plans``). Package map: ``docs/architecture.md``.
"""

from .planning import (
    CAUSAL,
    DEBUG_ENV,
    DEFAULT_TILE,
    BlockPlan,
    Call,
    check_tile,
    choose_tile,
    debug_enabled,
    id_runs,
    increasing_spans,
    kernel_block_size,
    plan_block,
    run_tiles,
)
from .run import (
    accumulators,
    block_backward,
    block_forward,
    cached_plan,
    engine_backend,
    grad_zeros,
    local_attention,
    plan_for,
)
from .stats import EngineStats

__all__ = [
    "CAUSAL",
    "DEFAULT_TILE",
    "DEBUG_ENV",
    "EngineStats",
    "Call",
    "BlockPlan",
    "check_tile",
    "choose_tile",
    "kernel_block_size",
    "id_runs",
    "increasing_spans",
    "run_tiles",
    "plan_block",
    "plan_for",
    "cached_plan",
    "engine_backend",
    "accumulators",
    "block_forward",
    "block_backward",
    "local_attention",
    "debug_enabled",
    "grad_zeros",
]
