"""Cost model of one training step: FLOPs, traced communication bytes, memory and time per rank.

Input is plain numbers (``ModelShape``, ``Layout``, ``Cluster``); ``training/planning.py`` reads
them from a config. Attention pairs come from the mask rules of ``layouts.placement``
(``clip_pairs``), ring traffic from the ring's own routes (``attention.ring.ring_routes``) and the
Ulysses K/V head count from ``attention.ulysses``: the bytes are the ones ``CommTracer`` counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from ..attention.ring import ring_routes
from ..attention.ulysses import kv_heads_for_a2a
from ..layouts.placement import Clip, clip_pairs, plan_placement
from .hardware import ASSUMPTIONS, Hardware

__all__ = [
    "ModelShape",
    "Layout",
    "Cluster",
    "StepCost",
    "traced_bytes",
    "ring_bytes",
    "step_cost",
    "placed_by_token",
    "placement_overhead",
]

# Activation elements per token and layer kept for the backward: ``D`` + (``D_tp`` + ``F_tp``
# (per FFN width)) / TP, and ``backward_D`` in flight during a layer's backward; fitted on the tiny
# video DiT at DP 4 with and without recompute and TP 2 (benchmarks/planner.py reports the rest).
# Per-token timesteps (AR DiT's blocks) add ``mod_D`` per token and layer (each token's modulation
# table and modulated activations) and, once, the timestep embedding (``embed`` + 2 D per token);
# measured on the tiny AR DiT at DP 2.
ACT_PER_TOKEN = dict(D=4, D_tp=9, F_tp=5, backward_D=8, mod_D=12, embed=256)
# Element-wise traffic per token and layer, in hidden-size elements: ``layer`` for a layer's
# norms, modulation, activations and residuals, ``per_token_timesteps`` more where each token has
# its own modulation table (fitted with ``hardware.elementwise_s_per_byte``: benchmarks/planner.py).
ELEMENTWISE_PER_TOKEN = dict(layer=30, per_token_timesteps=12)
ATTENTION_KINDS = ("full", "causal", "teacher_forcing", "stdit")


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a step depends on: the transformer's sizes and one sample's token grid."""

    family: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    frames: int  # token frames T of a sample (per half for teacher forcing)
    positions: int  # tokens per frame
    attention: str = "full"  # full | teacher_forcing | stdit
    block_frames: int = 1  # teacher forcing: token frames per block
    full_layers: Tuple[int, ...] = ()  # stdit: 1-based layers with a full attention too
    text_len: int = 0  # cross-attention keys per sample (0: none)
    text_dim: int = 0
    lora_rank: int = 0  # AdaLN-LoRA rank (0: a full modulation table)
    in_channels: int = 16
    dtype_bytes: int = 2
    extra_params: int = 0  # embedders, heads, vision tower (not in the layers)
    per_token_timesteps: bool = False  # a timestep per token: a modulation table per token
    token_placement: bool = False  # the trainer places clips by token where CP does not divide

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention ({self.attention!r}) must be one of {ATTENTION_KINDS}")

    @property
    def seq(self) -> int:
        """Tokens of one sample in the transformer (``[clean ; noisy]`` for teacher forcing)."""
        return (2 if self.attention == "teacher_forcing" else 1) * self.frames * self.positions

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def self_attentions(self, layer: int) -> Dict[str, int]:
        """``{pattern: attention pairs of one sample}`` of layer ``layer`` (1-based)."""
        T, n, S = self.frames, self.positions, self.seq
        if self.attention == "stdit":
            out = {"spatial": T * n * n, "temporal": n * T * T}
            if layer in self.full_layers:
                out["full"] = S * S
            return out
        if self.attention == "teacher_forcing":
            clip = Clip(S, "teacher_forcing", self.block_frames * n)
            return {"full": clip_pairs(clip)}
        return {"full": clip_pairs(Clip(S, "causal" if self.attention == "causal" else "full"))}

    def layer_params(self) -> int:
        """Parameters of one transformer layer."""
        D, F, r = self.hidden, self.ffn, self.lora_rank
        kv = self.kv_heads * self.head_dim
        attn = D * (D + 2 * kv) + D * D + 4 * D  # qkv, out, biases / QK norms (approx.)
        n_self = 2 if self.attention == "stdit" else 1
        cross = (2 * D * D + 2 * D * D + 4 * D) if self.text_len else 0
        mlp = 2 * D * F + F + D
        mod = (D * r + r * 9 * D) if r else 6 * D
        return n_self * attn + cross + mlp + mod

    def params_per_rank(self, tp: int, pp: int) -> float:
        """Parameters on one rank: the layers' column / row-parallel matrices split by ``tp``, the
        rest (modulation, norms, biases of the row-parallel outputs, embedders) replicated; the
        whole split by the pipeline stages."""
        D, F = self.hidden, self.ffn
        kv = self.kv_heads * self.head_dim
        n_self = 2 if self.attention == "stdit" else 1
        split = n_self * (D * (D + 2 * kv) + D * D) + (4 * D * D if self.text_len else 0)
        split = self.num_layers * (split + 2 * D * F + F)
        return (split / tp + self.params - split) / pp

    @property
    def params(self) -> int:
        """All parameters: the layers, the embedders (timestep MLP, caption projection, patch
        embedding and final projection) and ``extra_params``."""
        D, c = self.hidden, self.in_channels
        embed = 2 * D * D + 256 * D + (self.text_dim or D) * D + 2 * D * c
        return self.num_layers * self.layer_params() + embed + self.extra_params


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ulysses: int = 1
    ring: int = 1
    recompute: bool = False
    micro_batch_size: int = 1
    fsdp: bool = False  # ZeRO-3 over DP x CP (parallel.fsdp)

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def name(self) -> str:
        parts = [
            f"TP{self.tp}",
            f"U{self.ulysses}",
            f"R{self.ring}",
            f"PP{self.pp}",
            f"DP{self.dp}",
        ]
        flags = (" rc" if self.recompute else "") + (" fsdp" if self.fsdp else "")
        return "x".join(parts) + flags + f" mb{self.micro_batch_size}"


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    global_batch: Optional[int] = None  # samples per step (None: one micro-batch per DP rank)
    distributed_optimizer: bool = True


def ring_bytes(routes, ring_rank: int, ring_size: int, tokens: int, kv_row: int, acc_row: int):
    """``(fwd, bwd)`` bytes ring rank ``ring_rank`` sends in one ring attention (``attention.ring``):
    K and V at each hop a later hop needs them (``kv_leaves``), and in the backward the dK / dV
    partial sums (accumulation dtype) from the first hop that needs them, home after the last."""
    R, r = ring_size, ring_rank

    def kept(j):
        return tokens if routes.keep[j] is None else int(routes.keep[j].numel())

    fwd = sum(
        2 * kept((r - i) % R) * kv_row for i in range(R - 1) if routes.kv_leaves((r - i) % R, i, R)
    )
    grads = sum(
        2 * kept((r - i) % R) * acc_row for i in range(1, R) if routes.first[(r - i) % R] <= i
    )
    return fwd, fwd + grads


@functools.lru_cache(maxsize=256)
def _full_routes(ring_size: int, tokens: int):
    return ring_routes([torch.empty(tokens)] * ring_size, None)


def traced_bytes(
    shape: ModelShape,
    layout: Layout,
    ring_rank: int = 0,
    routes=None,
) -> Dict[Tuple[str, str], int]:
    """``{(op, direction): bytes}`` this rank sends (as ``CommTracer`` counts them; shape checks
    aside) in the forward and backward of ONE micro-batch over its pipeline stage's layers.
    ``routes``: the ring's ``RingRoutes`` (None: every key reaches every ring rank)."""
    e, b, D = shape.dtype_bytes, layout.micro_batch_size, shape.hidden
    U, R, N, tp = layout.ulysses, layout.ring, layout.cp, layout.tp
    hd, ht = shape.head_dim, shape.heads // tp
    hkv = kv_heads_for_a2a(shape.kv_heads // tp, U)
    s = shape.seq // N
    out: Dict[Tuple[str, str], int] = {}

    def add(key, v):
        out[key] = out.get(key, 0) + v

    acc_e = 8 if e == 8 else 4
    routes = routes if routes is not None or R == 1 else _full_routes(R, U * s)
    layers = range(1, shape.num_layers // layout.pp + 1)  # stage 0's layers (all stages equal)
    for layer in layers:
        pats = shape.self_attentions(layer)
        cp_attn = ["full"] if "full" in pats else []
        if shape.attention == "stdit" and N > 1 and shape.frames > 1:
            xa = b * (shape.frames // N) * shape.positions * D * e
            xb = b * -(-shape.positions // N) * shape.frames * D * e
            for d in ("fwd", "bwd"):
                add(("all_to_all", d), xa * (N - 1) // N + xb * (N - 1) // N)
        for _ in cp_attn:
            for d in ("fwd", "bwd"):
                if U > 1:
                    for heads in (ht, hkv, hkv, ht):  # q, k, v, out
                        add(("all_to_all", d), b * s * heads * hd * e * (U - 1) // U)
            if R > 1:
                f, bw = ring_bytes(
                    routes,
                    ring_rank,
                    R,
                    U * s,
                    b * (hkv // U) * hd * e,
                    b * (hkv // U) * hd * acc_e,
                )
                add(("send", "fwd"), f)
                add(("send", "bwd"), bw)
    if N > 1:  # the loss value, summed over the CP group (one float32 per micro-batch)
        add(("all_reduce", "fwd"), 4 * (N - 1) // N)
    return out


def step_traced_bytes(layout: Layout) -> Dict[Tuple[str, str], int]:
    """``{(op, direction): bytes}`` a rank sends once per step outside the micro-batches: the data
    path's load-status flag (one float32 summed over the world before the step's first model
    collective, ``training.batches.checked_step_batches``)."""
    W = layout.world
    return {("all_reduce", "fwd"): 4 * (W - 1) // W} if W > 1 else {}


@dataclass
class StepCost:
    """Predicted cost of one training step of ``layout`` (per rank; seconds, bytes, FLOPs)."""

    layout: Layout
    step_s: float
    # seconds of the step by cost: compute, placement (padding and imbalance of a token-placed
    # micro-batch), a2a, ring, tp, dp, pp, bubble
    parts: Dict[str, float]
    model_flops: float  # per GPU per step, without recompute (MFU's numerator)
    tokens_per_step: int
    mem_bytes: float
    mem_parts: Dict[str, float] = field(default_factory=dict)
    fits: bool = True
    gpus: int = 1
    peak_flops: float = 1.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.peak_flops

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / 2**30

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)

    def row(self) -> dict:
        lay = self.layout
        return dict(
            layout=lay.name(),
            tp=lay.tp,
            pp=lay.pp,
            dp=lay.dp,
            ulysses=lay.ulysses,
            ring=lay.ring,
            recompute=lay.recompute,
            fsdp=lay.fsdp,
            micro_batch_size=lay.micro_batch_size,
            step_s=self.step_s,
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
            tflops_per_gpu=self.tflops_per_gpu,
            mfu=self.mfu,
            mem_gib_per_gpu=self.mem_gib,
            fits=self.fits,
            dominant=self.dominant,
            parts={k: round(v, 6) for k, v in self.parts.items()},
        )


def placed_by_token(shape: ModelShape, cp: int) -> bool:
    """Whether the trainer places a micro-batch of ``shape``'s clips by token at CP ``cp``
    (``training/batches/placed.py``, ``tokens_placed``): full attention whose token frames ``cp``
    does not divide, or teacher forcing whose frames are not a multiple of ``cp`` x block frames
    (Balanced SP does not divide), for a shape whose family places by token
    (``token_placement``: not ST-DiT, not the VLMs)."""
    if cp == 1 or not shape.token_placement:
        return False
    if shape.attention == "full":
        return shape.frames % cp != 0
    if shape.attention == "teacher_forcing":
        return shape.frames % (cp * shape.block_frames) != 0
    return False


# tokens per frame at which the planner plans a teacher-forcing micro-batch (a full-size plan
# costs seconds per layout): the trainer's own plan up to it; above it within 1e-3 of the
# full-size plan (measured at 21 frames in blocks of 3, 880 and 3600 tokens a frame, CP 2-16)
TF_PLAN_POSITIONS = 64


@functools.lru_cache(maxsize=4096)
def _tf_balance(frames: int, block_frames: int, positions: int, b: int, U: int, R: int) -> float:
    """Attention pairs max / mean over the ring ranks of ``b`` teacher-forcing clips of ``frames``
    frames of ``positions`` tokens (capped at ``TF_PLAN_POSITIONS``) placed by ``plan_placement``
    and padded to a multiple of 2 CP, as the trainer places them (``batches.placed``). Where a
    block's clean and noisy copies cannot be dealt evenly the ring ranks' attention work differs:
    LongLive's 7 blocks of 3 frames at CP 2 / 4 on a small grid (``tests/test_planner.py``)."""
    N, n = U * R, min(positions, TF_PLAN_POSITIONS)
    clips = [Clip(2 * frames * n, "teacher_forcing", block_frames * n)] * b
    return plan_placement(clips, U, R, seq_len=-(-frames * n * b // N) * 2 * N).balance()


def placement_overhead(shape: ModelShape, lay: Layout) -> Tuple[float, float]:
    """``(padded / real tokens, attention pairs max / mean over the ring ranks)`` of one
    micro-batch placed by token (``placed_by_token``), as the trainer places it
    (``training/batches/placed.py``): the micro-batch's ``b`` clips packed and padded to a multiple
    of 2 CP (exact), then placed by ``layouts.placement.plan_placement``. Full attention: every real
    query attends its clip's ``T`` tokens and the planner cuts anywhere, so the busiest ring rank
    holds ``ceil(b T / R)`` real tokens (max / mean ``ceil(b T / R) / (b T / R)``; equal to the
    planner's own plan, ``tests/test_planner.py``). Teacher forcing: the planner's plan at the
    tokens of a frame up to ``TF_PLAN_POSITIONS`` (``_tf_balance``). ``(1.0, 1.0)`` where the
    clips are not placed by token."""
    if not placed_by_token(shape, lay.cp):
        return 1.0, 1.0
    b, N, R, T = lay.micro_batch_size, lay.cp, lay.ring, shape.seq
    pad = (-(-b * T // (2 * N)) * 2 * N) / (b * T)
    if shape.attention == "teacher_forcing":
        frames, block, n = shape.frames, shape.block_frames, shape.positions
        return pad, _tf_balance(frames, block, n, b, lay.ulysses, R)
    return pad, -(-b * T // R) / (b * T / R)


def layer_flops(shape: ModelShape, layer: int) -> Tuple[float, float]:
    """``(linear, attention)`` forward FLOPs of layer ``layer`` for one sample."""
    S, D, F, hd = shape.seq, shape.hidden, shape.ffn, shape.head_dim
    kv = shape.kv_heads * hd
    pats = shape.self_attentions(layer)
    lin = len(pats) * 2 * S * D * (2 * D + 2 * kv) + 4 * S * D * F
    attn = sum(4 * pairs * D for pairs in pats.values())
    if shape.text_len:
        lin += 4 * S * D * D + 4 * shape.text_len * D * D
        attn += 4 * S * shape.text_len * D
    if shape.per_token_timesteps:  # each token's modulation table (AdaLN-LoRA or full)
        r = shape.lora_rank
        lin += 2 * S * (D * r + r * 9 * D if r else 6 * D)
    return float(lin), float(attn)


def _link(layout: Layout, stride: int, size: int, cluster: Cluster, hw: Hardware):
    """``(bandwidth, latency)`` of a group of ``size`` ranks ``stride`` apart (rank order TP, CP
    (Ulysses inner), DP, PP, as Megatron builds them)."""
    return hw.link(stride * size <= cluster.gpus_per_node)


def _collective_link(layout: Layout, stride: int, size: int, cluster: Cluster, hw: Hardware):
    """``_link`` for a ring all-gather / reduce-scatter (DP, FSDP): across nodes NCCL runs one
    ring per rail, so a group with ``k`` ranks on each node moves its inter-node bytes over ``k``
    NICs — ``k`` times a NIC's bandwidth, up to NVLink's."""
    bw, lat = _link(layout, stride, size, cluster, hw)
    if stride * size > cluster.gpus_per_node:
        k = max(1, min(size, cluster.gpus_per_node // stride))
        bw = min(k * hw.ib_bw, hw.nvlink_bw)
    return bw, lat


def memory(
    shape: ModelShape, layout: Layout, cluster: Cluster, microbatches: int, prefetch: bool = True
):
    """``{part: bytes}`` per rank of the first pipeline stage (the one holding most in flight);
    ``prefetch``: FSDP gathers the next layer during this one (where communication overlaps)."""
    e, D, F = shape.dtype_bytes, shape.hidden, shape.ffn
    p_rank = shape.params_per_rank(layout.tp, layout.pp)
    g = layout.dp * layout.cp
    shard = g if cluster.distributed_optimizer or layout.fsdp else 1
    weights = p_rank * e
    grads = p_rank * ASSUMPTIONS["grad_bytes_per_param"]
    gathered = 0.0
    if layout.fsdp:  # every state sharded; gathered layers transient
        weights, grads = weights / g, grads / g
        # in a layer's backward: it (and the next, prefetched) gathered, its unsharded gradients
        # and, when they are not fp32, their fp32 copy for the reduce-scatter
        layer, f = shape.layer_params() / layout.tp, ASSUMPTIONS["grad_bytes_per_param"]
        gathered = layer * ((2 if prefetch else 1) * e + e + (f if e != f else 0))
    opt_bytes = ASSUMPTIONS["optimizer_bytes_per_param"] - (4 if e == 4 else 0)
    optim = p_rank * opt_bytes / shard
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    layers = shape.num_layers // layout.pp
    # elements per token and layer the backward keeps (ACT_PER_TOKEN, measured on our DiT layers
    # with testing.LiveTensors: benchmarks/planner.py), the part inside TP split by it; with
    # recompute only the layer input, plus the recomputed layer while its backward runs
    a = ACT_PER_TOKEN
    per_layer = a["D"] * D + (a["D_tp"] * D + a["F_tp"] * F) / layout.tp
    per_layer += a["mod_D"] * D if shape.per_token_timesteps else 0
    back = a["backward_D"] * D  # gradients in flight through one layer
    stored = (D if layout.recompute else per_layer) * tokens * e * layers
    if shape.per_token_timesteps:  # the timestep embedding, once (the first stage)
        stored += (a["embed"] + 2 * D) * tokens * e
    transient = ((per_layer if layout.recompute else 0) + back) * tokens * e + gathered
    in_flight = min(microbatches, layout.pp)
    return dict(
        weights=weights,
        grads=grads,
        optimizer=optim,
        activations=stored * in_flight,
        transient=transient,
    )


def _microbatch_times(shape: ModelShape, lay: Layout, cluster: Cluster, hw: Hardware) -> dict:
    """Seconds of one micro-batch on one pipeline stage, by cost (compute, a2a, ring, tp, pp),
    and its forward FLOPs (``fwd_flops``) and the attention part of the compute (``attn``)."""
    A, e, b, N = ASSUMPTIONS, shape.dtype_bytes, lay.micro_batch_size, lay.cp
    layers = range(1, shape.num_layers // lay.pp + 1)
    lin = attn = 0.0
    for layer in layers:
        a, c = layer_flops(shape, layer)
        lin, attn = lin + a, attn + c
    fwd_lin, fwd_attn = b * lin / (lay.tp * N), b * attn / (lay.tp * N)
    rc = A["recompute_factor"] * hw.recompute_cost if lay.recompute else 0
    mult = 1 + A["backward_factor"] + rc
    t_attn = mult * fwd_attn / (hw.peak_flops * hw.attn_eff)
    tokens_rank = b * shape.seq / N
    w = ELEMENTWISE_PER_TOKEN
    per_token = w["layer"] + (w["per_token_timesteps"] if shape.per_token_timesteps else 0)
    elem = per_token * tokens_rank * shape.hidden * e * len(layers) * mult / lay.tp
    compute = mult * fwd_lin / (hw.peak_flops * hw.matmul_eff) + t_attn
    over = (1 + hw.backward_overhead + rc) * len(layers) * hw.layer_overhead_s
    # attention kernel calls: one per pattern, one per ring step where the pattern spans the CP
    # group; the backward as many, a recomputed forward again
    calls = sum(
        lay.ring if pat == "full" else 1 for x in layers for pat in shape.self_attentions(x)
    )
    over += (2 + rc) * calls * hw.attn_call_overhead_s
    if shape.attention in ("causal", "teacher_forcing"):  # a mask and bias over each call's
        # query x key block, built forward and backward: S x S / R elements a rank (Ulysses gathers
        # the sequence, heads share the mask)
        over += (2 + rc) * len(layers) * shape.seq**2 / lay.ring * hw.mask_s_per_element
    compute += elem * hw.elementwise_s_per_byte + over
    # placed by token: the padding's linear and element-wise work, and the slowest ring rank's
    # attention above the mean (placement_overhead; 0 where CP divides the clip)
    pad, balance = placement_overhead(shape, lay)
    linear = mult * fwd_lin / (hw.peak_flops * hw.matmul_eff) + elem * hw.elementwise_s_per_byte
    placed = (pad - 1) * linear + (balance - 1) * t_attn
    # traced communication: Ulysses all-to-alls, ST-DiT transitions, ring P2P
    tb = traced_bytes(shape, lay)
    n_a2a = sum(
        (8 if lay.ulysses > 1 and "full" in shape.self_attentions(x) else 0)
        + (4 if shape.attention == "stdit" and N > 1 else 0)
        for x in layers
    )
    size = N if shape.attention == "stdit" else lay.ulysses
    bw_a, lat_a = _link(lay, lay.tp, size, cluster, hw)
    # latency per call and peer (pairwise exchanges); a recomputed forward repeats the forward's
    # calls and bytes (half the calls: as many backward as forward)
    a2a_f = tb.get(("all_to_all", "fwd"), 0)
    a2a = a2a_f + tb.get(("all_to_all", "bwd"), 0) + rc * a2a_f
    t_a2a = a2a / bw_a + n_a2a * (1 + rc / 2) * lat_a * (size - 1)
    bw_r, lat_r = _link(lay, lay.tp * lay.ulysses, lay.ring, cluster, hw)
    ring_f = tb.get(("send", "fwd"), 0)  # hops: R - 1 forward, 2 (R - 1) backward (K / V, dK / dV)
    ring_b = ring_f + tb.get(("send", "bwd"), 0) + rc * ring_f
    t_ring = ring_b / bw_r + (3 + rc) * (lay.ring - 1) * len(layers) * lat_r
    t_ring = max(0.0, t_ring - A["ring_overlap"] * t_attn * hw.overlaps)
    # tensor parallel: a reduction per sub-layer (attention, cross-attention, MLP) of the
    # [s, b, D] activations forward, as many backward (the column-parallel inputs' gradients) plus
    # the text keys / values' input gradient [text, b, D], again forward in a recomputed forward
    t_tp = 0.0
    if lay.tp > 1:
        bw_t, lat_t = _link(lay, 1, lay.tp, cluster, hw)
        ring_v = 2 * shape.hidden * e * (lay.tp - 1) / lay.tp / bw_t  # per reduced token
        n = (3 if shape.text_len else 2) * (2 + rc)
        t_tp = n * (tokens_rank * ring_v + lat_t)
        if shape.text_len:
            t_tp += b * shape.text_len * ring_v + lat_t
        t_tp *= len(layers)
    t_pp = 0.0
    if lay.pp > 1:  # activations forward, their gradients backward
        bw_p, lat_p = _link(lay, lay.tp * N * lay.dp, lay.pp, cluster, hw)
        t_pp = 2 * (tokens_rank * shape.hidden * e / lay.tp / bw_p + lat_p)
    return dict(
        compute=compute,
        placement=placed,
        a2a=t_a2a,
        ring=t_ring,
        tp=t_tp,
        pp=t_pp,
        fwd_flops=fwd_lin + fwd_attn,
        bwd=(compute * A["backward_factor"] / mult),
    )


def step_cost(shape: ModelShape, layout: Layout, cluster: Cluster, hw: Hardware) -> StepCost:
    """Predicted step time, memory and FLOPs of ``layout`` on ``cluster`` of ``hw``: ``m``
    micro-batches through a 1F1B pipeline (bubble ``(pp - 1)`` micro-batch times), then the
    DP x CP gradient reduce-scatter / parameter all-gather behind the last backward (with FSDP:
    the gathers and reductions of every micro-batch, behind its compute)."""
    lay = layout
    gbs = cluster.global_batch or lay.micro_batch_size * lay.dp
    m = max(1, gbs // (lay.micro_batch_size * lay.dp))  # micro-batches per DP rank
    t = _microbatch_times(shape, lay, cluster, hw)
    keys = ("compute", "placement", "a2a", "ring", "tp", "pp")
    t_mb = sum(t[k] for k in keys)
    t_dp, g = 0.0, lay.dp * lay.cp
    if g > 1:
        bw_d, lat_d = _collective_link(lay, lay.tp, g, cluster, hw)
        p_rank = shape.params_per_rank(lay.tp, lay.pp)
        n_layers = shape.num_layers // lay.pp
        if lay.fsdp:  # per micro-batch: weights gathered forward and backward, fp32 gradients
            # reduce-scattered, each layer's prefetched behind the previous layer's compute
            e, f = shape.dtype_bytes, ASSUMPTIONS["grad_bytes_per_param"]
            total = p_rank * (2 * e + f) * (g - 1) / g / bw_d
            total += 3 * (n_layers + 1) * (lat_d + hw.fsdp_call_overhead_s)  # units: + the root
            hidden = ASSUMPTIONS["fsdp_overlap"] * t["compute"] * hw.overlaps
            t_dp = m * max(0.0, total - hidden)
        else:  # gradient reduce-scatter / weight all-gather behind the last backward
            total = 2 * p_rank * shape.dtype_bytes * (g - 1) / g / bw_d + 2 * lat_d * n_layers
            t_dp = max(0.0, total - ASSUMPTIONS["dp_overlap"] * t["bwd"] * hw.overlaps)
    parts = {k: m * t[k] for k in keys}
    parts.update(bubble=(lay.pp - 1) * t_mb, dp=t_dp)
    mem = memory(shape, lay, cluster, m, prefetch=hw.overlaps)
    total = sum(mem.values())
    return StepCost(
        layout=lay,
        step_s=sum(parts.values()),
        parts=parts,
        model_flops=3 * m * t["fwd_flops"],  # per GPU (its stage, its share of the tokens)
        tokens_per_step=gbs * shape.seq,
        mem_bytes=total,
        mem_parts=mem,
        fits=total <= hw.hbm_gib * 2**30 * hw.usable_mem,
        gpus=lay.world,
        peak_flops=hw.peak_flops,
    )
