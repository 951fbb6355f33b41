"""The Megatron-LM entries under Megatron-LM's real ``megatron.training.pretrain()`` (env 2 only).

The launch lines are read from docs/launch.md (its ``<!-- launch:NAME -->`` blocks) and run as
written under torchrun (4 gloo ranks), with only the documented "CPU" and "Scaled down" flags
appended; ``megatron_video/testing/megatron_training_cpu.py`` fakes megatron.training's CUDA
assumptions. Asserted: the loss falls, iteration 1 equals our trainer's first step (same batches,
same weights), save at 4 -> resume equals the uninterrupted run, TP2 x CP2 equals CP 4,
evaluation runs. The documented lines' required flags and the model's ``pg_collection`` are
checked in every environment.
"""

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_video.testing.doc_blocks import launch_blocks

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "launch.md"
SHIM = ROOT / "megatron_video" / "testing" / "megatron_training_cpu.py"
HAVE_TRAINING = importlib.util.find_spec("megatron.training") is not None
real = pytest.mark.skipif(
    not HAVE_TRAINING,
    reason="megatron.training not available (megatron-core 0.16.1 wheel ships no megatron/training/)",
)
# what megatron-core 0.19's pretrain() needs on every launch line (docs/launch.md)
REQUIRED_FLAGS = (
    "--eval-interval",
    "--tokenizer-type",
    "--vocab-size",
    "--seq-length",
    "--micro-batch-size",
    "--train-iters",
)
REQUIRED_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
MEGATRON_SEED = 1234  # Megatron-LM's --seed default (the documented lines do not set it)


def check_launch_line(tokens) -> None:
    """``ValueError`` naming what a documented launch line lacks."""
    env = dict(t.split("=", 1) for t in tokens if re.match(r"^[A-Z_]+=", t))
    for k, v in REQUIRED_ENV.items():
        if env.get(k) != v:
            raise ValueError(f"launch line: {k}={v} is required (got {env.get(k)!r})")
    for flag in REQUIRED_FLAGS:
        if flag not in tokens:
            raise ValueError(f"launch line: {flag} is required by megatron-core 0.19's pretrain()")


BLOCKS = launch_blocks(DOC.read_text())


@pytest.mark.parametrize("name", ["dit", "llava"])
def test_documented_lines_carry_what_pretrain_requires(name):
    tokens = BLOCKS[name]
    check_launch_line(tokens)
    for flag in REQUIRED_FLAGS:  # the check bites: each flag dropped is named
        i = tokens.index(flag)
        with pytest.raises(ValueError, match=re.escape(flag)):
            check_launch_line(tokens[:i] + tokens[i + 2 :])
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        check_launch_line(tokens[1:])
    assert {"cpu", "scaled", "tp2cp2", "stdit", "ar_dit", "wan", "wan_ar", "mixed"} <= set(BLOCKS)


def _provider_model():
    import warnings

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel.topology import destroy_video_parallel
    from megatron_video.training.config import load_config
    from megatron_video.training.megatron_lm import MegatronLMEntry

    warnings.filterwarnings("ignore")
    cfg = load_config(str(ROOT / "examples/configs/video_dit_cp.yaml"))
    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
    )
    try:
        m = cfg.model
        base = TransformerConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            context_parallel_size=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
        )
        entry = MegatronLMEntry("examples/pretrain_video_dit.py", ("video_dit",))
        model = entry.model_provider(True, True, config=base, video_config=cfg)
        pgc = getattr(model, "pg_collection", "missing")
        has_pgc = importlib.util.find_spec("megatron.core.process_groups_config") is not None
        ok_pgc = (
            (
                pgc.cp is ps.get_context_parallel_group()
                and pgc.tp is ps.get_tensor_model_parallel_group()
            )
            if has_pgc
            else True
        )
        on_cpu = model.cuda() is model and next(model.parameters()).device == torch.device("cpu")
        return has_pgc, ok_pgc, on_cpu
    finally:
        destroy_video_parallel()
        destroy_model_parallel()


def test_dit_provider_model_carries_pg_collection(pool4):
    """train_step reads model.pg_collection (an fp32 launch crashed without it); get_model's
    model.cuda() must leave a CPU-mode model on the CPU."""
    for has_pgc, ok_pgc, on_cpu in pool4.run(_provider_model):
        assert ok_pgc and on_cpu
        if HAVE_TRAINING:
            assert has_pgc  # megatron-core 0.19 has ProcessGroupCollection


# ------------------------------------------------------------------------------------------------
# the real pretrain() runs
# ------------------------------------------------------------------------------------------------
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| loss: ([0-9.Ee+-]+) \|")
_EVAL = re.compile(
    r"validation loss at iteration (\d+)( on (?:validation|test) set)? \| "
    r"loss value: ([0-9.Ee+-]+)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_port() -> int:
    """A free port below the kernel's ephemeral range: a run's store binds it minutes after the
    plan is written, and a port from the ephemeral range (``_free_port``) can be taken by then by
    any outgoing connection (gloo opens many)."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range ({low})")


def _command(name: str, out: Path, *extra: str):
    """The documented line ``name`` + the CPU flags + the scaled-down flags (+ ``extra``)."""
    tokens = list(BLOCKS[name if name in ("dit", "llava") else "dit"])
    env = {}
    while re.match(r"^[A-Z_]+=", tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    assert tokens[0] == "torchrun"
    script = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *tokens[1:script],
        str(SHIM),
        *tokens[script:],
    ]
    if name not in ("dit", "llava"):
        cmd += BLOCKS[name]
    scaled = [str(out) if t == "OUT" else t for t in BLOCKS["scaled"]]
    return cmd + BLOCKS["cpu"] + scaled + list(extra), env


def _runs(logs: Path, *runs) -> list:
    """Each ``(name, out, extra, may_fail)`` of ``runs``, one after another in one torchrun (the
    shim's ``--runs``: each rank imports once and forks a fresh child per run; their logs and
    plan under ``logs``); each run's result."""
    cmds = [_command(name, out, *extra) for name, out, extra, _ in runs]
    shim = cmds[0][0].index(str(SHIM))
    prefix, env = cmds[0][0][: shim + 1], cmds[0][1]
    assert all(c[: shim + 1] == prefix and e == env for c, e in cmds), "one torchrun line"
    logs.mkdir(parents=True)
    plan = [
        {"argv": c[shim + 1 :], "log": str(logs / f"{i}_{r[0]}"), "may_fail": r[3]}
        for i, ((c, _), r) in enumerate(zip(cmds, runs))
    ]
    for run in plan:  # each run's own TCP store (the shim forks a fresh child per run)
        run["port"] = _store_port()
    (logs / "runs.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        **env,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TORCH_GLOO_LAZY_INIT": "1",
        "PET_MASTER_PORT": str(_free_port()),
    }
    t0 = time.time()
    cmd = prefix + ["--runs", str(logs / "runs.json")]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240 * len(runs)
    )
    results = []
    for run, (name, _, extra, may_fail) in zip(plan, runs):
        parts = sorted(logs.glob(Path(run["log"]).name + ".rank*"))
        text = "".join(p.read_text() for p in parts)
        status = [int(v) for v in re.findall(r"^exit status (-?\d+)", text, re.M)]
        if len(status) != 4 or (any(status) and not may_fail):
            raise AssertionError(
                f"{name} {' '.join(extra)}: exit statuses {status} (torchrun exited "
                f"{proc.returncode}):\n{text[-6000:]}\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        losses = {int(i): float(v) for i, v in _ITER.findall(text)}
        evals = [(int(i), bool(final), float(v)) for i, final, v in _EVAL.findall(text)]
        print(f"{name} {' '.join(extra)}: losses {losses}")
        results.append({"losses": losses, "evals": evals, "text": text, "status": max(status)})
    if proc.returncode:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    print(f"{len(runs)} runs in one torchrun: {time.time() - t0:.0f} s")
    return results


@pytest.fixture(scope="module")
def launches(wan_shards, tmp_path_factory) -> dict:
    """All the documented launches in one torchrun (each a fresh process, forked after the
    imports): the ``dit`` line's runs (:func:`_dit_plan`), each family's line
    (:func:`_family_plan`) and the ``mixed`` line's runs (:func:`_mixed_plan`)."""
    root = tmp_path_factory.mktemp("mlm")
    plans = [_dit_plan(root / "dit"), _family_plan(root / "families", wan_shards)]
    plans.append(_mixed_plan(root / "mixed"))
    results = iter(_runs(root / "logs", *[run for _, runs, _ in plans for run in runs]))
    return {name: shape([next(results) for _ in runs]) for name, runs, shape in plans}


def _dit_plan(root: Path):
    """The ``dit`` line: 8 iterations (saved at 4 and 8), then resumed from its iteration-4
    checkpoint, at TP 2 x CP 2, and resumed at DP 2 x CP 2."""
    out = root / "run"
    load = ("--load", str(out), "--ckpt-step", "4")
    dp2 = ("--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1")
    runs = [
        ("dit", out, (), False),
        ("dit", root / "resumed", load, False),
        ("tp2cp2", root / "tp2cp2", (), False),
        ("dit", root / "dp2", (*load, "--micro-batch-size", "1", *dp2), False),
    ]

    def shape(r):
        return {"first": {**r[0], "out": out}, "resumed": r[1], "tp2cp2": r[2], "dp2": r[3]}

    return "dit", runs, shape


@pytest.fixture(scope="module")
def dit_runs(launches):
    return launches["dit"]


@pytest.fixture(scope="module")
def dit_cp4(dit_runs):
    return dit_runs["first"]


def _falls(losses: dict, n: int) -> None:
    """All ``n`` iterations logged, and the mean loss of the last half below the first half's
    (the diffusion loss varies step to step with the drawn noise level)."""
    assert sorted(losses) == list(range(1, n + 1)), sorted(losses)
    first = [losses[i] for i in range(1, n // 2 + 1)]
    last = [losses[i] for i in range(n - n // 2 + 1, n + 1)]
    assert sum(last) / len(last) < sum(first) / len(first), losses


@real
def test_dit_cp4_trains_and_evaluates(dit_cp4):
    """Every iteration logged; the validation loss at 8 is below the one at 4: every
    evaluation draws the same held-out micro-batches (its ledger restarts), so the two measure
    the same clips and noise (the training losses vary step to step with the drawn noise level)."""
    assert sorted(dit_cp4["losses"]) == list(range(1, 9))
    evals = dit_cp4["evals"]
    assert [i for i, final, _ in evals if not final] == [4, 8]  # --eval-interval 4
    at = {i: v for i, final, v in evals if not final}
    assert at[8] < at[4], evals
    assert sum(final for _, final, _ in evals) == 2  # validation and test sets


def _our_first_step(config_path, overrides):
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(load_config(config_path, overrides), progress=False)
    try:
        return t.train_step(0)["loss"]
    finally:
        t.close()


@real
def test_dit_first_loss_equals_our_trainer(dit_cp4, pool4, tmp_path):
    """Same seed -> same initial weights and the same batches: Megatron's iteration 1 is the
    first step of ``megatron-video train`` on the YAML (micro-batch 2, CP 4 as U2 x R2)."""
    overrides = [f"train.seed={MEGATRON_SEED}", "train.micro_batch_size=2", f"output={tmp_path}"]
    ours = pool4.run(_our_first_step, str(ROOT / "examples/configs/video_dit_cp.yaml"), overrides)
    assert len(set(ours)) == 1
    assert ours[0] == pytest.approx(dit_cp4["losses"][1], rel=2e-6)


@real
def test_dit_resume_equals_uninterrupted(dit_runs):
    """Megatron's checkpoint of iteration 4, resumed in a fresh job to 8: every iteration's loss
    and the final validation / test losses equal the uninterrupted run's. Megatron's first log
    after a resume (iteration 6 here) averages iterations 5 and 6; that is what it prints."""
    dit_cp4, run = dit_runs["first"], dit_runs["resumed"]
    ref, got = dit_cp4["losses"], run["losses"]
    assert sorted(got) == list(range(5, 9))
    for i in [5, 7, 8]:
        assert got[i] == ref[i], i
    assert got[6] == pytest.approx((ref[5] + ref[6]) / 2, rel=2e-6)
    assert run["evals"] == [e for e in dit_cp4["evals"] if e[0] == 8]


@real
def test_dit_tp2cp2_equals_cp4(dit_runs):
    dit_cp4, tp = dit_runs["first"], dit_runs["tp2cp2"]
    assert sorted(tp["losses"]) == list(range(1, 9))
    for i, loss in dit_cp4["losses"].items():
        # Megatron-LM prints 7 significant digits; measured: equal, or one unit of the last digit
        # apart (rel 9.9e-7); the bound is 10x that
        assert tp["losses"][i] == pytest.approx(loss, rel=1e-5), i


@pytest.fixture(scope="module")
def wan_shards(tmp_path_factory):
    from megatron_video.testing.wan import write_random_latent_shards
    from megatron_video.training.config import load_config

    out = tmp_path_factory.mktemp("wan_shards")
    cfg = load_config(str(ROOT / "examples/configs/wan_tiny.yaml"))
    return write_random_latent_shards(cfg, str(out), num_samples=8)


FOUR = ("--train-iters", "4", "--save-interval", "4", "--eval-interval", "2")


def _family_plan(root: Path, wan_shards: str):
    """The ``llava`` line (8 iterations) and the ST-DiT, AR DiT, Wan and Wan AR lines (4 each,
    evaluated after 2 and 4)."""
    wan = ("--video-override", f"data.shards={wan_shards}")
    extra = {"llava": (), "stdit": FOUR, "ar_dit": FOUR, "wan": FOUR + wan, "wan_ar": FOUR + wan}
    runs = [(name, root / name, e, False) for name, e in extra.items()]
    return "families", runs, lambda r: dict(zip(extra, r))


@pytest.fixture(scope="module")
def family_runs(launches):
    return launches["families"]


@real
def test_llava_cp4_trains_and_evaluates(family_runs):
    run = family_runs["llava"]
    _falls(run["losses"], 8)
    assert sum(final for _, final, _ in run["evals"]) == 2


@real
@pytest.mark.parametrize("family", ["stdit", "ar_dit", "wan", "wan_ar"])
def test_other_families_train_and_evaluate(family, family_runs):
    """The family's documented line, 4 iterations, evaluated after 2 and 4: the validation loss
    after 4 is below the one after 2 (every evaluation draws the same held-out micro-batches; the
    training losses vary step to step with the drawn noise level); validation and test run. The
    Wan lines read random latent shards in precompute's format."""
    run = family_runs[family]
    assert sorted(run["losses"]) == list(range(1, 5))
    at = {i: v for i, final, v in run["evals"] if not final}
    assert sorted(at) == [2, 4] and at[4] < at[2], run["evals"]
    assert sum(final for _, final, _ in run["evals"]) == 2


def _mixed_plan(root: Path):
    """The ``mixed`` line (data.buckets) on mixed-shape latent shards with images: 6 iterations,
    a checkpoint at 3, evaluation at 3 and 6; then resumed from 3, at PP 2 x CP 2, resumed at DP 2
    x CP 2, and resumed with another global batch (refused)."""
    from megatron_video.testing.mixed import write_tiny_mixed_shards

    shards = write_tiny_mixed_shards("wan", root / "shards", num_samples=12)
    six = ("--train-iters", "6", "--save-interval", "3", "--eval-interval", "3")
    base = (*six, "--video-override", f"data.shards={shards}")
    load = ("--load", str(root / "run"), "--ckpt-step", "3")
    pp = ("--pipeline-model-parallel-size", "2", "--context-parallel-size", "2")
    pp += ("--hierarchical-context-parallel-sizes", "2", "1")
    dp2 = ("--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1")
    # --override-opt_param-scheduler: else Megatron's own warmup check stops the last one first
    gbs4 = (*load, "--global-batch-size", "4", "--override-opt_param-scheduler")
    runs = [
        ("mixed", root / "run", base, False),
        ("mixed", root / "resumed", (*base, *load), False),
        ("mixed", root / "pp2", (*base, *pp), False),
        ("mixed", root / "dp2", (*base, *load, *dp2), False),
        ("mixed", root / "gbs4", (*base, *gbs4), True),
    ]

    def shape(r):
        first = {**r[0], "out": root / "run", "shards": shards}
        return {"first": first, "resumed": r[1], "pp2": r[2], "dp2": r[3], "gbs4": r[4]}

    return "mixed", runs, shape


@pytest.fixture(scope="module")
def mixed_runs(launches):
    return launches["mixed"]


@pytest.fixture(scope="module")
def mixed_run(mixed_runs):
    return mixed_runs["first"]


@real
def test_mixed_first_loss_equals_our_trainer(mixed_run, pool4, tmp_path):
    """Packed micro-batches under the real ``pretrain()``: every iteration logged, finite,
    evaluation run; iteration 1 is ``megatron-video train``'s first step (same seed, ledger,
    placement plans and weights)."""
    losses = mixed_run["losses"]
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    assert [i for i, final, _ in mixed_run["evals"] if not final] == [3, 6]
    assert "mixed data (data.buckets)" in mixed_run["text"]  # the plan, printed once
    overrides = [
        f"train.seed={MEGATRON_SEED}",
        f"data.shards={mixed_run['shards']}",
        f"output={tmp_path}",
    ]
    path = str(ROOT / "examples/configs/mixed_tiny.yaml")
    ours = pool4.run(_our_first_step, path, overrides, ranks_per_node=2)
    assert len(set(ours)) == 1
    assert ours[0] == pytest.approx(losses[1], rel=2e-6)


@real
def test_mixed_resume_replays_the_ledger(mixed_runs):
    """Resumed from iteration 3's checkpoint, iterations 4-6 see the clips of the uninterrupted
    run (the ledger replayed): the same losses (Megatron's first log after a resume averages
    iterations 4 and 5) and the same evaluation at 6."""
    mixed_run, run = mixed_runs["first"], mixed_runs["resumed"]
    ref, got = mixed_run["losses"], run["losses"]
    assert sorted(got) == [4, 5, 6], got
    assert got[4] == ref[4] and got[6] == ref[6]
    assert got[5] == pytest.approx((ref[4] + ref[5]) / 2, rel=2e-6)
    assert run["evals"] == [e for e in mixed_run["evals"] if e[0] == 6]


@real
def test_mixed_pipeline_parallel_runs(mixed_runs):
    """The mixed line at PP 2 x CP 2 (Ulysses 2): Megatron's schedule with
    ``variable_seq_lengths`` (set by the entry) passes each packed micro-batch's shape between the
    stages; every iteration and evaluation runs (a load-status all-reduce over the world inside
    ``forward_step`` would deadlock here: stage 1 waits in its pipeline receive). The stages
    initialise their layers from other RNG states than PP 1, so losses are compared in
    ``tests/test_train_mixed.py::test_trainer_pp2_equals_pp1`` (same weights), not here."""
    run = mixed_runs["pp2"]
    assert sorted(run["losses"]) == list(range(1, 7))
    assert all(math.isfinite(v) for v in run["losses"].values())
    assert [i for i, final, _ in run["evals"] if not final] == [3, 6]


@real
def test_mixed_resume_at_another_dp_size(mixed_runs):
    """Saved at DP 1 x CP 4 (U2 x R2), resumed at DP 2 x CP 2 (Ulysses 2) with the same global
    batch after "losing" half the context-parallel group: the ledger replayed to iteration 3 picks
    the same clips (which clips a step takes depends on the global batch, not the DP size), split
    over two DP ranks; the logged losses (the mean over the step's micro-batches, summed by
    Megatron over DP x CP) equal the uninterrupted DP 1 run's to float32 summation order."""
    mixed_run, run = mixed_runs["first"], mixed_runs["dp2"]
    ref, got = mixed_run["losses"], run["losses"]
    assert sorted(got) == [4, 5, 6], got
    assert got[4] == pytest.approx(ref[4], rel=1e-5)
    assert got[5] == pytest.approx((ref[4] + ref[5]) / 2, rel=1e-5)
    assert got[6] == pytest.approx(ref[6], rel=1e-5)
    (i, final, value), *_ = [e for e in run["evals"] if e[0] == 6]
    assert value == pytest.approx([e for e in mixed_run["evals"] if e[0] == 6][0][2], rel=1e-5)


@real
def test_dit_resume_at_another_dp_size(dit_runs):
    """The fixed-shape line (a grid of one bucket, the same ledger) saved at DP 1 x CP 4 with
    micro-batches of 2 clips, resumed at DP 2 x CP 2 with micro-batches of 1 (the same global
    batch): iterations 5-8 log the uninterrupted run's losses (Megatron's first log after the
    resume averages iterations 5 and 6) and the final evaluation."""
    dit_cp4, run = dit_runs["first"], dit_runs["dp2"]
    ref, got = dit_cp4["losses"], run["losses"]
    assert sorted(got) == list(range(5, 9)), got
    assert got[6] == pytest.approx((ref[5] + ref[6]) / 2, rel=1e-5)
    for i in [5, 7, 8]:
        assert got[i] == pytest.approx(ref[i], rel=1e-5), (i, got[i], ref[i])
    final = [e for e in dit_cp4["evals"] if e[0] == 8]
    assert [e[:2] for e in run["evals"]] == [e[:2] for e in final]
    assert [e[2] for e in run["evals"]] == pytest.approx([e[2] for e in final], rel=1e-5)


@real
def test_mixed_resume_with_another_global_batch_is_refused(mixed_runs):
    """The ledger replays with one global batch: a checkpoint that consumed 3 x 2 samples,
    resumed with --global-batch-size 4, stops with the reason before its first step."""
    run = mixed_runs["gbs4"]
    assert run["status"] != 0 and not run["losses"]
    assert re.search(r"consumed 6 samples, not 3 x 4", run["text"]), run["text"][-3000:]


def test_entry_refuses_rampup_batch_size():
    from types import SimpleNamespace

    from megatron_video.training.megatron_lm import MegatronLMEntry

    path = str(ROOT / "examples/configs/mixed_tiny.yaml")
    args = SimpleNamespace(
        video_config=path,
        video_override=[],
        context_parallel_size=1,
        hierarchical_context_parallel_sizes=None,
        ulysses_size=None,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ranks_per_node=1,
        micro_batch_size=1,
        global_batch_size=2,
        rampup_batch_size=[1, 1, 8],
    )
    with pytest.raises(ValueError, match=r"--rampup-batch-size \(\[1, 1, 8\]\)"):
        MegatronLMEntry("pretrain_video_dit.py", ("wan",)).video_config_from_args(args)
