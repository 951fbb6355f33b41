"""The planner on a training config: ``megatron-video plan``, ``parallel: auto`` and the
Megatron-LM entry's ``--plan`` (docs/planner.md). The cost model is ``megatron_video.planner``;
a layout is legal when the config's own validators accept it (``config.validate``)."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import List, Optional

from ..planner import Cluster, Layout, ModelShape, Plan, format_table, get_hardware, search
from ..planner.search import why_slower
from .config import Config, token_grid_of, validate
from .family_spec import get_family

__all__ = ["PlanError", "model_shape", "plan_config", "apply_layout", "auto_layout", "report"]

_ATTENTION = {"stdit": "stdit", "ar_dit": "teacher_forcing", "wan_ar": "teacher_forcing"}


class PlanError(ValueError):
    """No layout of the request is legal, or none fits: the message names the smallest change."""


def model_shape(config: Config) -> ModelShape:
    """The planner's ``ModelShape`` of ``config`` (sizes, token grid, masks, dtype)."""
    m, d = config.model, config.data
    fam = m.family
    T, Hp, Wp = token_grid_of(config)
    attention = _ATTENTION.get(fam, "causal" if fam == "video_llava" else "full")
    frames, positions = T, Hp * Wp
    if fam == "video_llava":  # one causal LLM sequence (visual + text tokens)
        frames, positions = 1, get_family(fam).seq_length(config)
    return ModelShape(
        family=fam,
        num_layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        kv_heads=m.num_query_groups or m.num_attention_heads,
        ffn=m.ffn_hidden_size or 4 * m.hidden_size,
        frames=frames,
        positions=positions,
        attention=attention,
        block_frames=m.frames_per_block,
        full_layers=tuple(m.stdit_full_attention_layers),
        text_len=d.caption_len if fam != "video_llava" else 0,
        text_dim=d.text_embed_dim or m.hidden_size,
        lora_rank=0 if fam.startswith("wan") else m.lora_rank,
        dtype_bytes=2 if config.train.bf16 else 4,
        per_token_timesteps=fam in ("ar_dit", "wan_ar") or m.per_token_timesteps,
        token_placement=_token_placement(get_family(fam)),
    )


def _token_placement(family) -> bool:
    """Whether the trainer places ``family``'s clips by token where CP does not divide them
    (``batches.placed.tokens_placed``: a packed family of full-attention layers)."""
    packed = getattr(family, "packed_kind", None) is not None
    return packed and getattr(family, "layer_type", None) == "full"


def apply_layout(config: Config, layout: Layout, ranks_per_node: Optional[int]) -> Config:
    """A copy of ``config`` with ``layout``'s parallel fields and micro-batch size."""
    cfg = copy.copy(config)
    cfg.parallel = dataclasses.replace(
        config.parallel,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        ulysses_size=layout.ulysses,
        ring_size=layout.ring,
        recompute=layout.recompute,
        fsdp=layout.fsdp,
        ranks_per_node=ranks_per_node,
        auto=False,
    )
    cfg.train = dataclasses.replace(config.train, micro_batch_size=layout.micro_batch_size)
    return cfg


def _legal(config: Config, gpus: int, rpn: int, has_gpu: bool):
    node_rule = {}  # the node-placement check depends on the parallel degrees only: once each

    def legal(layout: Layout) -> Optional[str]:
        key = (layout.tp, layout.pp, layout.ulysses, layout.ring, layout.fsdp)
        if key not in node_rule:
            try:
                apply_layout(config, layout, rpn).parallel.validate(gpus)
                node_rule[key] = None
            except ValueError as e:
                node_rule[key] = str(e)
        if node_rule[key]:
            return node_rule[key]
        try:  # the rest may depend on the recompute flag and micro-batch size: every layout
            validate(apply_layout(config, layout, None), gpus, has_gpu)
        except ValueError as e:
            return str(e)
        return None

    return legal


def plan_config(
    config: Config,
    gpus: int,
    gpus_per_node: int = 8,
    hardware: str = "h100",
    global_batch: Optional[int] = None,
    micro_batch_sizes=(1, 2, 4),
    fsdp=(False, True),
) -> Plan:
    """Every legal layout of ``config`` on ``gpus`` devices, costed and ranked. ``PlanError``
    (exit status 2 on the command line) when none is legal or none fits, naming the smallest
    change that would."""
    hw = get_hardware(hardware)
    for name, v in (("gpus", gpus), ("gpus_per_node", gpus_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} ({v!r}) must be a positive integer")
    rpn = min(gpus, gpus_per_node)
    if gpus % rpn:
        raise PlanError(
            f"gpus ({gpus}) must be a multiple of gpus_per_node ({gpus_per_node}); smallest "
            f"change: --gpus {-(-gpus // rpn) * rpn}"
        )
    gbs = global_batch if global_batch is not None else config.train.global_batch_size
    cfg = copy.copy(config)
    cfg.train = dataclasses.replace(config.train, global_batch_size=gbs)
    shape = model_shape(cfg)
    cluster = Cluster(gpus, rpn, gbs, distributed_optimizer=hardware != "cpu")
    legal = _legal(cfg, gpus, rpn, hardware != "cpu")
    plan = search(shape, cluster, hw, legal, micro_batch_sizes, fsdp)
    if not plan.costs:
        reason = plan.illegal[0][1] if plan.illegal else "no candidate layout"
        more = _smallest(lambda n: _any_legal(cfg, n, gpus_per_node, hardware), gpus)
        raise PlanError(
            f"no parallel layout of {gpus} GPUs is legal for this config (e.g. {reason}); "
            + (f"smallest change: --gpus {more}" if more else "change the model or clip sizes")
        )
    if not plan.fitting:
        best = min(plan.costs, key=lambda c: c.mem_bytes)
        limit = hw.hbm_gib * hw.usable_mem
        more = _smallest(lambda n: _any_fits(cfg, n, gpus_per_node, hardware), gpus, factor=64)
        frames = _shorter_clip(cfg, gpus, gpus_per_node, hardware)
        change = [
            f"--gpus {more}" if more else None,
            f"a shorter clip (--frames {frames})" if frames else None,
        ]
        change = " or ".join(c for c in change if c) or "a smaller model"
        raise PlanError(
            f"no legal layout of {gpus} {hardware} GPUs fits in memory: the smallest, "
            f"{best.layout.name()}, needs {best.mem_gib:.1f} GiB per GPU of {limit:.1f} usable "
            f"(recompute already tried); smallest change that fits: {change}"
        )
    return plan


def _any_legal(cfg, n, gpn, hardware) -> bool:
    try:
        return bool(plan_config(cfg, n, gpn, hardware, micro_batch_sizes=(1,)).costs)
    except PlanError:
        return False


def _any_fits(cfg, n, gpn, hardware) -> bool:
    try:
        plan_config(cfg, n, gpn, hardware, micro_batch_sizes=(1,))
        return True
    except PlanError:
        return False


def _smallest(ok, gpus: int, factor: int = 8) -> Optional[int]:
    """The smallest doubling of ``gpus`` (up to ``factor`` x) that is ok."""
    cands = [gpus * 2**k for k in range(1, 7)]
    for n in cands:
        if n <= gpus * factor and ok(n):
            return n
    return None


def _shorter_clip(cfg: Config, gpus: int, gpn: int, hardware: str) -> Optional[int]:
    frames = cfg.data.num_frames
    while frames > 5:
        frames = 1 + 4 * max(1, (frames - 1) // 8)
        c = copy.copy(cfg)
        c.data = dataclasses.replace(cfg.data, num_frames=frames)
        if _any_fits(c, gpus, gpn, hardware):
            return frames
    return None


def auto_layout(
    config: Config, world_size: int, ranks_per_node: Optional[int] = None, hardware=None
):
    """``(config with the planner's best layout for world_size ranks, its StepCost)``
    (``parallel: auto``; the micro-batch size stays the config's). Pure: every rank gets the same
    answer without communicating. ``hardware`` default: ``h100`` with CUDA, else ``cpu``."""
    import os

    rpn = ranks_per_node or config.parallel.ranks_per_node
    rpn = rpn or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if hardware is None:
        import torch

        hardware = "h100" if torch.cuda.is_available() else "cpu"
    plan = plan_config(
        config, world_size, rpn, hardware, micro_batch_sizes=(config.train.micro_batch_size,)
    )
    best = plan.fitting[0]
    return apply_layout(config, best.layout, min(rpn, world_size)), best


def report(plan: Plan, top: int = 5, as_json: bool = False) -> str:
    """The ``plan`` command's output: a table of the best layouts and why the runner-up loses, or
    (``as_json``) every legal layout."""
    if as_json:
        return json.dumps([c.row() for c in plan.costs], indent=1)
    fit = plan.fitting
    lines = [format_table(fit, top)]
    if len(fit) > 1:
        lines.append(f"best: {fit[0].layout.name()}; runner-up: " + why_slower(fit[0], fit[1]))
    lines.append(
        f"{len(plan.costs)} legal layouts ({len(fit)} fit in memory), {len(plan.illegal)} refused"
    )
    return "\n".join(lines)


def megatron_flags(config: Config, layout: Layout) -> List[str]:
    """The Megatron-LM flags of ``layout`` (the entry's ``--plan``)."""
    flags = [
        f"--tensor-model-parallel-size {layout.tp}",
        f"--pipeline-model-parallel-size {layout.pp}",
        f"--context-parallel-size {layout.cp}",
        f"--micro-batch-size {layout.micro_batch_size}",
    ]
    if layout.ulysses > 1 and layout.ring > 1:
        flags += [
            "--cp-comm-type a2a+p2p",
            f"--hierarchical-context-parallel-sizes {layout.ulysses} {layout.ring}",
        ]
    elif layout.ulysses > 1:
        flags.append("--cp-comm-type a2a")
    if layout.recompute:
        flags += [
            "--recompute-granularity full",
            "--recompute-method uniform",
            "--recompute-num-layers 1",
        ]
    return flags


def plan_entry(argv: List[str], script: str) -> int:
    """The Megatron-LM entry's ``--plan``: print the Megatron-LM flags of the best layout of
    ``--video-config`` on ``--plan-gpus`` GPUs (exit status 2 naming the problem otherwise)."""
    import argparse
    import sys

    from .config import load_config

    ap = argparse.ArgumentParser(prog=f"{script} --plan")
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--video-config", required=True)
    ap.add_argument("--video-override", nargs="*", default=[])
    ap.add_argument("--plan-gpus", type=int, default=None, help="default: $WORLD_SIZE")
    ap.add_argument("--plan-gpus-per-node", type=int, default=8)
    ap.add_argument("--plan-hardware", default="h100")
    args, _ = ap.parse_known_args(argv)
    try:
        import os

        gpus = args.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or None
        if gpus is None:
            raise PlanError("--plan-gpus (None) must be given (or WORLD_SIZE set)")
        cfg = load_config(args.video_config, args.video_override)
        # the entry wraps the model in Megatron's DDP: FSDP layouts are megatron-video train's
        plan = plan_config(cfg, gpus, args.plan_gpus_per_node, args.plan_hardware, fsdp=(False,))
    except ValueError as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 2
    best = plan.fitting[0]
    print(
        f"# megatron-video plan: {best.layout.name()} on {gpus} {args.plan_hardware}: step "
        f"{best.step_s:.3g} s, {best.tokens_per_s_per_gpu:.4g} tokens/s/GPU, MFU {best.mfu:.1%}, "
        f"{best.mem_gib:.1f} GiB/GPU"
    )
    print(" ".join(megatron_flags(cfg, best.layout)))
    return 0


def add_plan_arguments(p) -> None:
    """The ``plan`` subcommand's arguments."""
    p.add_argument("--config", required=True, help="YAML config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--hardware", default="h100", help="h100 | h200 | b200 | cpu")
    p.add_argument(
        "--frames", type=int, default=None, help="raw frames of a clip (data.num_frames)"
    )
    p.add_argument("--height", type=int, default=None, help="pixels (data.height)")
    p.add_argument("--width", type=int, default=None, help="pixels (data.width)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step")
    p.add_argument("--top", type=int, default=5, help="rows of the table")
    p.add_argument("--json", action="store_true", help="every legal layout, as JSON")


def plan_command(args) -> int:
    """``megatron-video plan``: the table (or ``--json``); an impossible request raises
    ``PlanError`` (a ``ValueError``: exit status 2 with the message, no traceback)."""
    from .config import load_config

    extra = [
        f"data.{k}={v}"
        for k, v in (("num_frames", args.frames), ("height", args.height), ("width", args.width))
        if v is not None
    ]
    config = load_config(args.config, list(args.overrides) + extra)
    plan = plan_config(config, args.gpus, args.gpus_per_node, args.hardware, args.global_batch)
    print(report(plan, args.top, args.json))
    return 0
