"""The planner: a cost model of one training step and the search over parallel layouts
(``megatron-video plan``, ``parallel: auto``; docs/planner.md)."""

from .cost import (
    Cluster,
    Layout,
    ModelShape,
    StepCost,
    ring_bytes,
    step_cost,
    step_traced_bytes,
    traced_bytes,
)
from .hardware import ASSUMPTIONS, PROFILES, Hardware, get_hardware
from .search import Plan, candidate_layouts, format_table, search, why_slower

__all__ = [
    "ASSUMPTIONS",
    "PROFILES",
    "Cluster",
    "Hardware",
    "Layout",
    "ModelShape",
    "Plan",
    "StepCost",
    "candidate_layouts",
    "format_table",
    "get_hardware",
    "ring_bytes",
    "search",
    "step_cost",
    "step_traced_bytes",
    "traced_bytes",
    "why_slower",
]
