"""The planner (docs/planner.md): its communication bytes per rank equal what ``CommTracer``
counts on real runs (training steps of the tiny families on 4 gloo ranks, and a packed mixed
batch through ``dist_attention``); ``megatron-video plan`` on the command line; impossible
requests exit 2 naming the smallest change."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_video.planner import Layout, step_traced_bytes, traced_bytes
from megatron_video.testing.configs import tiny_config

CASES = [  # (name, family, parallel fields, ranks per node)
    ("U2xR2", "video_dit", dict(context_parallel_size=4, ulysses_size=2, ring_size=2), 2),
    ("U4", "video_dit", dict(context_parallel_size=4, ulysses_size=4), 4),
    ("R4", "video_dit", dict(context_parallel_size=4, ring_size=4), 2),
    (
        "TP2xCP2",
        "video_dit",
        dict(tensor_model_parallel_size=2, context_parallel_size=2, ulysses_size=2),
        4,
    ),
    ("ST-DiT U4", "stdit", dict(context_parallel_size=4, ulysses_size=4), 4),
]


def _measured(tmp, family, par, rpn):
    """``{(op, direction): bytes}`` of one training step (shape checks aside), micro-batches."""
    import warnings

    from megatron_video.parallel.comm import CommTracer
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(tiny_config(family, tmp, ranks_per_node=rpn, **par), progress=False)
    try:
        with CommTracer() as tr:
            t.forward_backward(0)
    finally:
        t.close()
    out = {}
    for e in tr.events:
        if e.op != "shape_check":
            out[(e.op, e.direction)] = out.get((e.op, e.direction), 0) + e.bytes_sent
    return out, t.num_microbatches


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("planner"))
    ensure_vae(tiny_config("ar_dit", tmp), progress=False)
    return tmp


@pytest.mark.parametrize("name,family,par,rpn", CASES, ids=[c[0] for c in CASES])
def test_comm_bytes_equal_tracer(pool4, vae_dir, name, family, par, rpn):
    from megatron_video.training.planning import model_shape

    per_rank = pool4.run(_measured, vae_dir, family, par, rpn, ranks_per_node=rpn)
    cfg = tiny_config(family, vae_dir, ranks_per_node=rpn, **par)
    p = cfg.parallel
    lay = Layout(
        tp=p.tensor_model_parallel_size,
        dp=4 // (p.tensor_model_parallel_size * p.context_parallel_size),
        ulysses=p.ulysses_size,
        ring=p.ring_size,
    )
    shape = model_shape(cfg)
    for rank, (got, m) in enumerate(per_rank):
        want = {k: v * m for k, v in traced_bytes(shape, lay, ring_rank=0).items() if v}
        for k, v in step_traced_bytes(lay).items():
            want[k] = want.get(k, 0) + v
        assert got == want, (name, rank, got, want)
        assert any(op != "all_reduce" for op, _ in got), "the run moved no attention data"


def _packed_case():
    """A packed mixed batch (three clips of different lengths and masks) through the 2D attention
    at U2 x R2 on its planned placement: the tracer's bytes and the ring's routes."""
    import torch.distributed as dist

    from megatron_video.attention import dist_attention, masks
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.layouts.placement import Clip, plan_placement
    from megatron_video.parallel import CommTracer, destroy_video_parallel, init_video_parallel

    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
    )
    groups = init_video_parallel(2, 2, ranks_per_node=2)
    try:
        clips = [Clip(40, "full"), Clip(12, "causal"), Clip(12, "full")]
        plan = plan_placement(clips, 2, 2, seq_len=64)
        mask = masks.packed(plan.cu_seqlens, inner=masks.full())
        cp = groups.cp_rank
        s = plan.placement.local_len
        g = torch.Generator().manual_seed(cp)
        q, k, v = (torch.randn(1, s, 4, 8, generator=g).requires_grad_() for _ in range(3))
        with CommTracer() as tr:
            dist_attention(q, k, v, groups, mask=mask, scheme=plan.placement).sum().backward()
        got = {}
        for e in tr.events:
            if e.op in ("all_to_all", "send"):
                got[(e.op, e.direction)] = got.get((e.op, e.direction), 0) + e.bytes_sent
        return dict(got=got, ring_rank=groups.ring_rank, cp=cp, rank=dist.get_rank())
    finally:
        destroy_video_parallel()
        destroy_model_parallel()


def test_packed_mixed_batch_bytes_equal_tracer(pool4):
    from megatron_video.attention import masks
    from megatron_video.attention.ring import ring_routes
    from megatron_video.layouts.placement import Clip, plan_placement, ring_members
    from megatron_video.planner import ModelShape

    clips = [Clip(40, "full"), Clip(12, "causal"), Clip(12, "full")]
    plan = plan_placement(clips, 2, 2, seq_len=64)
    mask = masks.packed(plan.cu_seqlens, inner=masks.full())
    ring_ids = [
        torch.sort(torch.cat([plan.placement.rank_ids(c) for c in members])).values
        for members in ring_members(2, 2)
    ]
    routes = ring_routes(ring_ids, mask)
    # one attention layer of 4 heads x 8 (D = 32), fp32, on a sequence of 64 tokens
    shape = ModelShape("video_dit", 1, 32, 4, 4, 64, frames=1, positions=64, dtype_bytes=4)
    lay = Layout(ulysses=2, ring=2)
    for res in pool4.run(_packed_case, ranks_per_node=2):
        want = traced_bytes(shape, lay, ring_rank=res["ring_rank"], routes=routes)
        want = {k: v for k, v in want.items() if k[0] != "all_reduce" and v}
        assert res["got"] == want, res
    full = traced_bytes(shape, lay)  # without the routes: every key travels the whole ring
    assert (
        sum(v for (op, _), v in want.items() if op == "send")
        < full[("send", "bwd")] + full[("send", "fwd")]
    )


WAN14B = "examples/configs/full/wan2.1_t2v_14b.yaml"


def test_readme_plan_table_is_what_the_command_prints(capsys):
    """The README's plan command, run as written; its output is the table the README shows."""
    import re

    from megatron_video.testing.configs import REPO_ROOT
    from megatron_video.testing.doc_blocks import launch_blocks
    from megatron_video.training.cli import main

    text = (REPO_ROOT / "README.md").read_text()
    tokens = launch_blocks(text)["plan-wan14b"]
    assert tokens[:2] == ["megatron-video", "plan"]
    shown = re.search(r"<!-- launch:plan-wan14b -->.*?```text\n(.*?)```", text, re.S).group(1)
    assert main(tokens[1:]) == 0
    assert capsys.readouterr().out == shown


def test_plan_json_every_legal_layout(capsys):
    from megatron_video.training.cli import main

    assert main(["plan", "--config", WAN14B, "--gpus", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"tp", "pp", "dp", "ulysses", "ring", "recompute", "micro_batch_size", "step_s"}
    keys |= {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "mem_gib_per_gpu", "fits"}
    assert rows and all(keys <= set(r) for r in rows)
    assert all(r["tp"] * r["pp"] * r["dp"] * r["ulysses"] * r["ring"] == 64 for r in rows)
    assert any(r["fits"] for r in rows) and any(not r["fits"] for r in rows)
    # 21 latent frames: CP sizes that do not divide them are legal too (placed by token,
    # training/batches/placed.py), e.g. Wan's own U8 x R2
    assert any(21 % (r["ulysses"] * r["ring"]) for r in rows)
    assert any((r["ulysses"], r["ring"], r["tp"]) == (8, 2, 1) for r in rows)
    # ranked: fitting layouts first, by tokens/s/GPU
    fit = [r["tokens_per_s_per_gpu"] for r in rows if r["fits"]]
    from megatron_video.planner.search import TIE

    n = sum(f >= max(fit) * (1 - TIE) for f in fit)  # ties with the best: fewer MP ranks first
    assert min(fit[:n]) >= max(fit) * (1 - TIE) and fit[n:] == sorted(fit[n:], reverse=True)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--gpus", "4"], "smallest change that fits: --gpus 8"),
        (["--gpus", "8", "--hardware", "tpu"], "hardware ('tpu') must be one of"),
    ],
)
def test_impossible_request_exits_2_naming_the_change(argv, needle, capsys):
    from megatron_video.training.cli import main

    assert main(["plan", "--config", WAN14B, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_no_layout_divides_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_video.training.cli", "plan", "--config", WAN14B]
        + ["--gpus", "131"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "smallest change: --gpus 136" in proc.stderr and "Traceback" not in proc.stderr


def _auto_step(tmp, family):
    import contextlib
    import io
    import warnings

    from megatron_video.training.config import config_to_dict
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config(family, tmp)
    cfg.parallel.auto = True
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        t = Trainer(cfg, progress=False)
    try:
        loss = t.forward_backward(0)
        p = config_to_dict(t.config)["parallel"]
    finally:
        t.close()
    return dict(printed=out.getvalue(), parallel=p, loss=loss)


@pytest.mark.parametrize("family", ["video_dit"])
def test_parallel_auto_trains_the_planned_layout(pool4, vae_dir, family):
    """``parallel: auto`` at 4 ranks: the trainer takes the planner's best layout (cpu profile)
    for its world size, prints it once (rank 0), and runs a step of it."""
    from megatron_video.training.config import config_from_dict
    from megatron_video.training.planning import plan_config

    per_rank = pool4.run(_auto_step, vae_dir, family, ranks_per_node=2)
    best = plan_config(tiny_config(family, vae_dir), 4, 2, "cpu", micro_batch_sizes=(1,))
    lay = best.fitting[0].layout
    for rank, res in enumerate(per_rank):
        p = res["parallel"]
        got = (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"])
        got += (p["ulysses_size"], p["ring_size"], p["recompute"], p["fsdp"], p["auto"])
        want = (lay.tp, lay.pp, lay.ulysses, lay.ring, lay.recompute, lay.fsdp, False)
        assert got == want, (rank, p)
        assert res["printed"].count("parallel: auto ->") == (rank == 0)
        assert res["loss"] is None or torch.isfinite(torch.tensor(res["loss"]))
    assert config_from_dict({"parallel": "auto"}).parallel.auto


def test_parallel_auto_applies_an_fsdp_plan():
    """Where the planner's best layout has FSDP (Wan 14B on 8 H100), ``parallel: auto`` trains it
    with ``parallel.fsdp`` on (the 4-rank tiny run above, whose best layout is DDP, checks the
    other side)."""
    from megatron_video.training.config import load_config
    from megatron_video.training.planning import auto_layout

    cfg, best = auto_layout(load_config(WAN14B), 8, 8, "h100")
    assert best.layout.fsdp, best.layout
    p = cfg.parallel
    got = (p.tensor_model_parallel_size, p.ulysses_size, p.ring_size, p.recompute, p.fsdp)
    lay = best.layout
    assert got == (lay.tp, lay.ulysses, lay.ring, lay.recompute, True), p


def test_megatron_lm_entry_plan_prints_the_flags(capsys):
    from megatron_video.training.planning import plan_entry

    argv = ["--plan", "--video-config", WAN14B, "--plan-gpus", "128"]
    assert plan_entry(argv, "pretrain_video_dit.py") == 0
    out = capsys.readouterr().out.splitlines()
    # 21 latent frames placed by token: CP 16 as Ulysses 2 x ring 8 (DDP: TP 2 fits the weights)
    assert out[0].startswith("# megatron-video plan: TP2xU2xR8xPP1xDP4 mb1")
    assert "--tensor-model-parallel-size 2" in out[1] and "--context-parallel-size 16" in out[1]
    assert "--hierarchical-context-parallel-sizes 2 8" in out[1]
    assert plan_entry(["--plan", "--video-config", WAN14B, "--plan-gpus", "4"], "x") == 2


def test_plan_json_at_81_frames_lists_cp_2_4_8_16_and_counts_the_padding(capsys):
    """Wan 2.1 14B at 720p x 81 frames (21 latent frames, 75,600 tokens) on 128 H100: legal
    layouts at CP 2, 4, 8 and 16 (placed by token); the cost counts the padding and imbalance
    of the placement (``parts["placement"]``): 0 where CP divides the 21 token frames, the padded
    tokens' linear work where it does not (CP 32 pads 75,600 to 75,648), and the full-attention
    balance the cost model assumes is the planner's own plan (checked on a small clip)."""
    from megatron_video.layouts.placement import Clip, plan_placement
    from megatron_video.planner.cost import Layout, placement_overhead
    from megatron_video.training.cli import main
    from megatron_video.training.config import load_config
    from megatron_video.training.planning import model_shape

    assert main(["plan", "--config", WAN14B, "--gpus", "128", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cps = {r["ulysses"] * r["ring"] for r in rows}
    assert {2, 4, 8, 16} <= cps, sorted(cps)
    for r in rows:
        cp, placed = r["ulysses"] * r["ring"], r["parts"]["placement"]
        assert placed >= 0 and (placed == 0) == (
            21 % cp == 0 or (75600 * r["micro_batch_size"]) % (2 * cp) == 0
        ), r
    best = {}  # docs/planner.md's table: the best fitting layout of each CP size
    for r in (r for r in rows if r["fits"]):  # ranked: the first of a CP size is its best
        best.setdefault(r["ulysses"] * r["ring"], r)
    from megatron_video.testing.configs import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "planner.md").read_text()
    for cp, r in best.items():
        line = f"| {cp} | {r['layout']} | {r['step_s']:.2f} | {r['tokens_per_s_per_gpu']:.0f} |"
        assert line in doc, line
    shape = model_shape(load_config(WAN14B))
    pad, balance = placement_overhead(shape, Layout(ulysses=1, ring=32))
    assert pad == 75648 / 75600 and balance == 2363 / 2362.5
    assert placement_overhead(shape, Layout(ulysses=8, ring=2)) == (75616 / 75600, 1.0)
    # the analytic full-attention balance equals plan_placement's at a clip it plans quickly
    for T, b, R in [(126, 1, 4), (126, 2, 8), (150, 1, 16)]:
        S = -(-b * T // (2 * R)) * 2 * R
        want = plan_placement([Clip(T)] * b, 1, R, seq_len=S).balance()
        assert -(-b * T // R) / (b * T / R) == pytest.approx(want, abs=1e-12), (T, b, R)


@pytest.mark.parametrize("family", ["wan_ar", "ar_dit"])
def test_plan_counts_the_teacher_forcing_imbalance_at_7_blocks_of_3(tmp_path, family):
    """LongLive's 21 latent frames in 7 blocks of 3 (Balanced SP does not divide them at CP 2 or
    4: placed by token) on a 1 x 3 token grid: the plan's padding and attention balance are the
    trainer's own placement's (``PackedVideo(...).plan``, as ``batches.placed`` plans a micro-batch
    of ``b`` teacher-forcing clips), and the cost's ``parts["placement"]`` counts them: above 0
    where the balance or padding is above 1, 0 where Balanced SP divides (24 frames at CP 2 / 4)."""
    import dataclasses

    from megatron_video.layouts.packed_video import PackedVideo, VideoClip
    from megatron_video.planner import Cluster, get_hardware, step_cost
    from megatron_video.planner.cost import placement_overhead
    from megatron_video.training.planning import model_shape

    shape = model_shape(tiny_config(family, tmp_path))
    assert shape.attention == "teacher_forcing" and shape.token_placement
    shape = dataclasses.replace(shape, frames=21, positions=3, block_frames=3)
    hw, imbalanced = get_hardware("h100"), 0
    for U, R in [(2, 1), (1, 2), (2, 2), (1, 4), (4, 1)]:
        for b in (1, 2):
            lay = Layout(ulysses=U, ring=R, micro_batch_size=b)
            clip = VideoClip(21, 1, 3, kind="teacher_forcing", frames_per_block=3)
            packed = PackedVideo((clip,) * b).padded_to(2 * U * R)
            want = (packed.seq_len / (b * 126), packed.plan(U, R).balance())
            got = placement_overhead(shape, lay)
            assert got == pytest.approx(want, abs=1e-12), (U, R, b, got, want)
            cost = step_cost(shape, lay, Cluster(gpus=U * R, gpus_per_node=8), hw)
            assert (cost.parts["placement"] > 0) == (max(want) > 1), (U, R, b, cost.parts)
            imbalanced += want[1] > 1
            even = dataclasses.replace(shape, frames=24)  # 8 blocks: Balanced SP divides
            assert placement_overhead(even, lay) == (1.0, 1.0)
            assert (
                step_cost(even, lay, Cluster(gpus=U * R, gpus_per_node=8), hw).parts["placement"]
                == 0
            )
    assert imbalanced >= 2  # at R2 and R4 the ring ranks' attention work differs
