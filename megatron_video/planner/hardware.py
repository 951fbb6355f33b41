"""Named hardware profiles of the planner, and every efficiency / overlap assumption in one place.

Peak numbers are vendor dense-bf16 figures (no sparsity) for SXM parts; the achievable fractions
are what well-tuned Megatron / flash-attention kernels reach on them (the planner's assumptions,
printed by ``megatron-video plan`` next to its table). ``cpu`` is fitted on the 2-core machine of
this project's CI (``benchmarks/planner.py`` fits and checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict

__all__ = ["Hardware", "PROFILES", "ASSUMPTIONS", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Rates in FLOP/s and bytes/s, latencies in seconds."""

    name: str
    peak_flops: float  # dense bf16 (fp32 for ``cpu``) FLOP/s
    matmul_eff: float  # achievable fraction of peak for the linear layers
    attn_eff: float  # achievable fraction of peak for attention (flash kernels)
    hbm_gib: float  # memory per device
    nvlink_bw: float  # per-GPU bandwidth inside a node (one direction), bytes/s
    nvlink_lat: float
    ib_bw: float  # per-GPU bandwidth across nodes (one NIC per GPU), bytes/s
    ib_lat: float
    usable_mem: float = 0.9  # fraction of HBM the planner lets a layout use (allocator, NCCL)
    elementwise_s_per_byte: float = 0.0  # norms / modulation / activations: time per byte moved
    layer_overhead_s: float = (
        0.0  # fixed time per layer and micro-batch, forward (launches, Python)
    )
    backward_overhead: float = 2.0  # a layer's fixed backward time, as a multiple of its forward's
    attn_call_overhead_s: float = 0.0  # fixed time per attention kernel call (a ring step each)
    mask_s_per_element: float = 0.0  # a masked attention's mask and bias, per query-key element
    recompute_cost: float = 1.0  # a recomputed forward's time, as a multiple of a forward's
    fsdp_call_overhead_s: float = 0.0  # fixed time per FSDP gather / reduction of a unit (hooks)
    overlaps: bool = True  # communication hides behind compute (ASSUMPTIONS' *_overlap shares)

    def link(self, intra: bool):
        """``(bandwidth, latency)`` of an intra- or inter-node link."""
        return (self.nvlink_bw, self.nvlink_lat) if intra else (self.ib_bw, self.ib_lat)


GB = 1e9
PROFILES: Dict[str, Hardware] = {
    # matmul / attention fractions: kernel-level 0.62 / 0.50 (h100) times 0.719, fitted end to end
    # on the NeMo paper's ST-DiT-12B 35k row by benchmarks/planner.py (b) (its other rows held
    # out); h200 and b200 take the same factor
    "h100": Hardware(
        "h100",
        989e12,
        0.446,
        0.360,
        80,
        450 * GB,
        8e-6,
        50 * GB,
        15e-6,
        elementwise_s_per_byte=1 / (2.4e12),
    ),
    "h200": Hardware(
        "h200",
        989e12,
        0.460,
        0.374,
        141,
        450 * GB,
        8e-6,
        50 * GB,
        15e-6,
        elementwise_s_per_byte=1 / (3.4e12),
    ),
    "b200": Hardware(
        "b200",
        2250e12,
        0.431,
        0.345,
        180,
        900 * GB,
        8e-6,
        100 * GB,
        15e-6,
        elementwise_s_per_byte=1 / (5.6e12),
    ),
    # fitted on this project's 2-core CI machine by benchmarks/planner.py (fp32, gloo loopback, a
    # rank per core; docs/benchmarks.md#planner): compute rate, fixed costs, latency, recompute,
    # FSDP's per-unit gather / reduction (hooks and copies)
    "cpu": Hardware(
        "cpu",
        8.01e10,
        1.0,
        0.35,
        24,
        1.5 * GB,
        1.19e-3,
        1.5 * GB,
        1.19e-3,
        usable_mem=0.5,
        elementwise_s_per_byte=1 / (4e9),
        layer_overhead_s=0.715e-3,
        backward_overhead=1.20,
        attn_call_overhead_s=2.49e-3,
        recompute_cost=0.90,
        fsdp_call_overhead_s=2.62e-3,
        mask_s_per_element=25.5e-9,  # fitted on the AR DiT (teacher forcing) at DP 2
        overlaps=False,  # gloo runs on the cores that compute: nothing hides behind compute
    ),
}

# Overlap and schedule assumptions (the only ones the planner makes).
ASSUMPTIONS = dict(
    ring_overlap=1.0,  # ring P2P hidden behind the attention of the block in flight, up to its time
    dp_overlap=0.8,  # share of the backward that the DP gradient reduce-scatter can hide behind
    fsdp_overlap=0.8,  # share of a micro-batch's compute that FSDP's gathers / reductions hide behind
    a2a_overlap=0.0,  # Ulysses all-to-alls are on the critical path
    tp_overlap=0.0,  # TP all-reduces / reduce-scatters are on the critical path
    backward_factor=2.0,  # backward FLOPs = 2 x forward
    recompute_factor=1.0,  # recompute = one more forward of each layer
    optimizer_bytes_per_param=12,  # fp32 master + Adam m, v (sharded by the distributed optimizer)
    grad_bytes_per_param=4,  # fp32 main gradients
)


def get_hardware(name: str, **override) -> Hardware:
    """The profile ``name`` (``ValueError`` naming it otherwise), fields overridden by ``override``."""
    if name not in PROFILES:
        raise ValueError(f"hardware ({name!r}) must be one of {sorted(PROFILES)}")
    return replace(PROFILES[name], **override) if override else PROFILES[name]
