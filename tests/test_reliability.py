"""Reliability on gloo ranks: resume under another parallel layout, corrupt / unsafe checkpoints,
atomic saves, non-finite steps, bitwise reruns, dead and hung ranks (docs/reliability.md).

Oracle for resharding: the same-layout continuation of the run that wrote the checkpoint (its
next two losses; the second one depends on the restored Adam moments and LR schedule).
"""

import math
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from megatron_video.testing.configs import tiny_config

CP4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
OTHER_LAYOUTS = {
    "dp2_cp2_u2": dict(context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2),
    "tp2_cp2_r2": dict(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        ulysses_size=1,
        ring_size=2,
        ranks_per_node=2,
    ),
    "cp4_ring_inner": dict(CP4, placement="ring_inner", ranks_per_node=4, ring_balance=False),
    "pp2_cp2_u2": dict(
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        ulysses_size=2,
        ring_size=1,
        ranks_per_node=2,
    ),
}


# the demo's other data source (energon clips, VAE in the SP partition) resumes on these
ENERGON_LAYOUTS = {
    "dp2_cp2_u2": OTHER_LAYOUTS["dp2_cp2_u2"],
    "dp4_cp1": dict(ranks_per_node=2),
    "tp2_cp2_r2": OTHER_LAYOUTS["tp2_cp2_r2"],
}


def _trainer(tmp, name, source="synthetic", **parallel):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    if source == "buckets":  # data.buckets: packed mixed-shape clips from precomputed shards
        from megatron_video.testing.mixed import tiny_mixed_config

        cfg = tiny_mixed_config("ar_dit", tmp, f"{tmp}/mixed", budget=96, **parallel)
        cfg.train.global_batch_size = 4
    else:
        cfg = tiny_config("ar_dit", tmp, **parallel)
    cfg.output = f"{tmp}/{name}"
    cfg.train.steps = 4  # steps 0-3 in all: a resumed job follows its config's LR schedule
    if source == "energon":
        cfg.data.source, cfg.data.path = "energon", f"{tmp}/ds"
    if source == "shards":  # latents precomputed from the energon clips
        cfg.data.source, cfg.data.shards = "shards", f"{tmp}/latents"
    return Trainer(cfg, progress=False)


def _ledger_steps(t):
    import json

    return [tuple(ids) for _, ids in json.loads(t.batches.data_state())["steps"]]


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("reliability"))
    ensure_vae(tiny_config("ar_dit", tmp), progress=False)
    return tmp


# ---------------------------------------------------------------------------------------------
# resharding resume
# ---------------------------------------------------------------------------------------------
def _reshard(tmp, source="synthetic"):
    out = {}
    t = _trainer(tmp, f"reshard_src_{source}", source, **CP4)  # DP1 x CP4 (U2 x R2)
    try:
        for s in range(2):
            t.train_step(s)
        t.save(2)
        out["same"] = [t.train_step(s)["loss"] for s in (2, 3)]
        out["gbs"], out["ledger"] = t.global_batch, _ledger_steps(t)
    finally:
        t.close()
    ckdir = f"{tmp}/reshard_src_{source}/checkpoints"
    layouts = OTHER_LAYOUTS if source == "synthetic" else ENERGON_LAYOUTS
    for name, layout in layouts.items():
        t = _trainer(tmp, f"reshard_{name}_{source}", source, **layout)
        try:
            assert t.load(ckdir) == 2
            losses = [t.train_step(s)["loss"] for s in (2, 3)]
            out[name] = (losses, t.global_batch, t.dp_size, _ledger_steps(t))
        finally:
            t.close()
    if source != "synthetic":
        return out
    # the user's path: a job under DP2 x CP2 pointed at the same output resumes by itself (run())
    import megatron_video.training.trainer as trainer_mod

    cfg = tiny_config("ar_dit", tmp, **OTHER_LAYOUTS["dp2_cp2_u2"])
    cfg.output, cfg.train.steps, cfg.train.resume = f"{tmp}/reshard_src_synthetic", 4, True
    t = trainer_mod.Trainer(cfg, progress=False)
    try:
        metrics = t.run()
        out["run"] = [(h["step"], h["loss"]) for h in metrics["history"]] if t.is_logger else None
    finally:
        t.close()
    return out


def _refuse_shape(tmp):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config("ar_dit", tmp, **CP4)
    cfg.model.hidden_size = 32
    t = Trainer(cfg, progress=False)
    try:
        with pytest.raises(ValueError) as e:
            t.load(f"{tmp}/reshard_src_synthetic/checkpoints")
        return str(e.value)
    finally:
        t.close()


def assert_each_clip_once(uninterrupted, resumed):
    """The resumed run's ledger (steps before and after the interruption) names every clip of
    the uninterrupted run's steps exactly once, step by step."""
    clips = [c for ids in resumed for c in ids]
    assert len(clips) == len(set(clips)), "a clip repeated across the interruption"
    assert [sorted(ids) for ids in resumed] == [sorted(ids) for ids in uninterrupted], (
        "a clip skipped or moved across the interruption"
    )


def _check_reshard(res, layouts):
    for r in res:
        same = r["same"]
        for name in layouts:
            losses, gbs, dp, ledger = r[name]
            assert gbs == r["gbs"] == 4
            assert_each_clip_once(r["ledger"], ledger)
            # every rank has the step's loss, a first pipeline stage too (the console is rank 0)
            for a, b in zip(same, losses):
                assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(a), (name, same, losses)


def test_each_clip_once_check_fails_on_a_skip_or_repeat():
    full = [(3, 1), (0, 7), (5, 2), (4, 6)]
    assert_each_clip_once(full, list(full))
    for bad in ([(3, 1), (0, 7), (5, 2), (4, 1)], [(3, 1), (0, 7), (5, 2), (4, 8)]):
        with pytest.raises(AssertionError):
            assert_each_clip_once(full, bad)


def _prepare(vae_dir, source):
    """The data of ``source`` under ``vae_dir`` (once): 16 energon clips, their precomputed
    latents, or 32 mixed-shape latent clips for data.buckets."""
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    root = Path(vae_dir)
    if not (root / "ds").is_dir():
        write_procedural_videos(root / "src", 16, num_frames=13, height=16, width=16, seed=9)
        prepare_dataset(root / "src", root / "ds")
    if source == "shards" and not (root / "latents").is_dir():
        from megatron_video.training.precompute import precompute_latents

        cfg = tiny_config("ar_dit", vae_dir)
        cfg.data.source, cfg.data.path = "energon", str(root / "ds")
        precompute_latents(cfg, root / "latents")
    if source == "buckets" and not (root / "mixed").is_dir():
        from megatron_video.testing.mixed import write_tiny_mixed_shards

        write_tiny_mixed_shards("ar_dit", root / "mixed", num_samples=32)


@pytest.mark.parametrize("source", ["energon", "shards", "buckets"])
def test_data_sources_resume_under_another_layout(pool4, vae_dir, source):
    """Saved at DP1 x CP4, resumed at DP2 x CP2, DP4 x CP1 and TP2 x CP2: energon clips with the
    VAE inside the SP partition (the demo's data), latents precomputed from them, and mixed
    shapes (data.buckets, packed): the sample ledger names every clip once across the
    interruption and the next two losses are the uninterrupted run's."""
    _prepare(vae_dir, source)
    res = pool4.run(_reshard, vae_dir, source)
    _check_reshard(res, ENERGON_LAYOUTS)
    assert [res[0][n][2] for n in ENERGON_LAYOUTS] == [2, 4, 1]


def test_resume_under_another_layout(pool4, vae_dir):
    res = pool4.run(_reshard, vae_dir)
    _check_reshard(res, OTHER_LAYOUTS)
    assert res[0]["dp2_cp2_u2"][2] == 2
    steps, losses = zip(*res[0]["run"])  # the logging rank's metrics of the resumed job
    assert steps == (2, 3) and all(
        abs(a - b) <= 1e-5 * abs(a) for a, b in zip(res[0]["same"], losses)
    )
    msgs = pool4.run(_refuse_shape, vae_dir)
    for m in msgs:
        assert "different model shape" in m and "model.hidden_size: checkpoint 48 vs job 32" in m, m


# ---------------------------------------------------------------------------------------------
# crash while saving, corrupt and unsafe checkpoints
# ---------------------------------------------------------------------------------------------
class _Payload:
    """Unpickling this runs ``touch <sentinel>``: what a malicious checkpoint would do."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _raises(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def _checkpoint_failures(tmp):
    import json

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_video.training import checkpoint as ckpt

    out = {}
    t = _trainer(tmp, "ckfail")  # DP4
    d = t.checkpoint_dir
    rank0 = dist.get_rank() == 0
    try:
        t.train_step(0)
        t.save(1)
        before = {k: v.clone() for k, v in t.model.state_dict().items() if v is not None}
        t.train_step(1)
        # a crash in the middle of saving step 2 (files half written, then the job dies)
        real_save = dist_checkpointing.save

        def crashing_save(state, path, *a, **k):
            Path(path, "__partial_0.distcp").write_bytes(b"half")
            raise RuntimeError("simulated crash while saving")

        dist_checkpointing.save = crashing_save
        try:
            with pytest.raises(RuntimeError, match="simulated crash"):
                t.save(2)
        finally:
            dist_checkpointing.save = real_save
        dist.barrier()
        out["after_crash"] = (
            ckpt.latest_step(d),
            (d / "iter_0000002").exists(),
            (d / "iter_0000002.partial").exists(),
        )
        out["resumed_step"] = t.load()
        out["restored"] = all(
            torch.equal(before[k], v) for k, v in t.model.state_dict().items() if k in before
        )
        t.train_step(1)  # the step the crash lost (the sample ledger is the data state)
        t.save(2)  # the next save clears the partial one
        out["after_save"] = (ckpt.latest_step(d), (d / "iter_0000002.partial").exists())
        # a truncated tensor file
        p2 = d / "iter_0000002"
        if rank0:
            victim = sorted(p2.glob("*.distcp"))[0]
            victim.write_bytes(victim.read_bytes()[:-7])
        dist.barrier()
        out["truncated"] = _raises(lambda: t.load())
        # crafted pickles, with a manifest that matches them (what an attacker would write)
        sentinel = Path(tmp) / "pwned"
        t.train_step(2)
        for name in (".metadata", "common.pt"):
            t.save(3)
            p3 = d / "iter_0000003"
            if rank0:
                if name == ".metadata":
                    (p3 / name).write_bytes(pickle.dumps(_Payload(str(sentinel))))
                else:
                    torch.save({"step": _Payload(str(sentinel))}, p3 / name)
                m = json.loads((p3 / "manifest.json").read_text())
                m["files"][name] = {
                    "bytes": (p3 / name).stat().st_size,
                    "sha256": ckpt._sha256(p3 / name),
                }
                (p3 / "manifest.json").write_text(json.dumps(m))
            dist.barrier()
            out[name] = _raises(lambda: t.load())
            out[name + "_executed"] = sentinel.exists()
        # a tracker that does not hold a step
        dist.barrier()
        if rank0:
            (d / ckpt.TRACKER_FILE).write_text("release")
        dist.barrier()
        out["tracker"] = _raises(lambda: t.load())
    finally:
        t.close()
    return out


def test_atomic_save_corrupt_and_unsafe_checkpoints(pool4, vae_dir):
    for r in pool4.run(_checkpoint_failures, vae_dir):
        assert r["after_crash"] == (1, False, True)  # the tracker still names the complete one
        assert r["resumed_step"] == 1 and r["restored"]
        assert r["after_save"] == (2, False)
        assert (
            "is corrupt" in r["truncated"]
            and "does not match the manifest" in r["truncated"]
            or "refused on another rank" in r["truncated"]
        ), r["truncated"]
        assert "not a valid tensor index" in r[".metadata"] and "posix.system" in r[".metadata"], r[
            ".metadata"
        ]
        assert "not weights-only" in r["common.pt"], r["common.pt"]
        assert not r[".metadata_executed"] and not r["common.pt_executed"]
        assert "latest_checkpointed_iteration.txt" in r["tracker"] and "'release'" in r["tracker"]


# ---------------------------------------------------------------------------------------------
# non-finite loss / gradients
# ---------------------------------------------------------------------------------------------
def _nonfinite(tmp, policy):
    import json

    import torch.distributed as dist

    from megatron_video.training.trainer import NonFiniteError

    t = _trainer(tmp, f"nan_{policy}")  # DP4: rank 2 alone sees the NaN
    # a checkpoint only where the test reads one (the state a stop leaves)
    t.config.train.steps, t.config.train.save = 4, policy != "skip"
    t.config.train.nonfinite_policy = "skip" if policy.startswith("skip") else policy
    t.config.train.max_skipped_steps = 1 if policy == "skip1" else 10
    t.config.train.save_interval = 0
    rank, state = dist.get_rank(), {"step": -1}
    train_step, loss = t.train_step, t.objective.loss

    def tracking_step(step):
        state["step"] = step
        return train_step(step)

    def poisoned_loss(out, mb):
        value = loss(out, mb)
        return value * float("nan") if rank == 2 and state["step"] == 1 else value

    forward_backward = t.forward_backward

    def poisoned_grad(step):  # step 2: a finite loss, one infinite gradient on rank 1 only
        loss = forward_backward(step)
        if rank == 1 and step == 2:
            next(iter(t.model.parameters())).main_grad.view(-1)[0] = float("inf")
        return loss

    t.train_step, t.objective.loss, t.forward_backward = tracking_step, poisoned_loss, poisoned_grad
    try:
        if policy in ("stop", "skip1"):
            with pytest.raises(NonFiniteError) as e:
                t.run()
            metrics = (
                json.loads((Path(t.config.output) / "metrics.json").read_text())
                if t.is_logger
                else None
            )
            from megatron_video.training import checkpoint as ckpt

            return str(e.value), metrics, ckpt.latest_step(t.checkpoint_dir)
        metrics = t.run()
        return metrics.get("nonfinite_steps"), [
            (h["loss"], h["nonfinite"], h["skipped_total"]) for h in metrics.get("history", [])
        ]
    finally:
        t.close()


def test_nonfinite_skip_and_stop(pool4, vae_dir):
    for r, (count, history) in enumerate(pool4.run(_nonfinite, vae_dir, "skip")):
        if r != 0:  # the logging rank writes the metrics
            continue
        assert count == 2
        assert [h[1] for h in history] == [False, True, True, False]
        assert [h[2] for h in history] == [0, 1, 2, 2]
        assert math.isnan(history[1][0]) and all(
            math.isfinite(h[0]) for h in (history[0], *history[2:])
        )
    for r, (msg, metrics, latest) in enumerate(pool4.run(_nonfinite, vae_dir, "stop")):
        assert (
            msg.startswith("step 1: non-finite loss or gradient")
            and "nonfinite_policy is 'stop'" in msg
        )
        assert "iter_0000001" in msg and latest == 1  # the state before the bad step
        if r == 0:
            assert metrics["nonfinite_steps"] == 1 and metrics["steps"] == 2
    # skip with max_skipped_steps=1: the first bad step passes, the second in a row stops the job
    for _r, (msg, _metrics, latest) in enumerate(pool4.run(_nonfinite, vae_dir, "skip1")):
        assert msg.startswith("step 2: non-finite") and "2 steps in a row were skipped" in msg, msg
        assert "train.max_skipped_steps=1" in msg and latest == 2


# ---------------------------------------------------------------------------------------------
# a rank that dies or hangs ends the job (the launcher, 4 spawned ranks)
# ---------------------------------------------------------------------------------------------
def _faulty_train(config, heartbeat):
    """``trainer.train`` whose rank 2 dies (``fault: die``) or hangs (``hang``) as step 1 starts."""
    import subprocess

    from megatron_video.training.trainer import train

    rank = int(os.environ["RANK"])
    Path(config.output).mkdir(parents=True, exist_ok=True)
    helper = subprocess.Popen(["sleep", "600"])  # like the checkpoint writer's helpers
    Path(config.output, f"pid{rank}").write_text(f"{os.getpid()} {helper.pid}")
    fault = Path(config.output, "fault").read_text()

    def beat(step):
        heartbeat(step)
        if rank == 2 and step == 1:
            if fault == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)

    train(config, heartbeat=beat)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state


@pytest.mark.process_launch
@pytest.mark.parametrize("fault", ["die", "hang"])
def test_dead_or_hung_rank_ends_the_job(fault, vae_dir, tmp_path, capsys):
    from megatron_video.training.launch import launch

    cfg = tiny_config("ar_dit", vae_dir, ranks_per_node=2)  # DP4
    cfg.output = str(tmp_path / fault)
    cfg.train.steps, cfg.train.rank_timeout_s = 4, 15.0
    Path(cfg.output).mkdir()
    Path(cfg.output, "fault").write_text(fault)
    t0 = time.time()
    code = launch(cfg, 4, 2, target=_faulty_train, cpu=True)
    took = time.time() - t0
    err = capsys.readouterr().err
    assert code != 0
    if fault == "die":
        # Racy under load: a peer may raise on the broken gloo connection (exit 1) before the
        # launcher sees rank 2's SIGKILL; either way the job ends, non-zero, naming a rank.
        assert (code == 128 + signal.SIGKILL and "rank 2 exited with code -9 at step 1" in err) or (
            code == 1 and "exited with code 1" in err
        ), err[-2000:]
    else:
        assert (
            code == 1 and "rank(s) [2] made no progress for 15 s" in err and "at step 1" in err
        ), err[-2000:]
        assert took < 240
    time.sleep(0.5)
    pids = [int(p) for r in range(4) for p in Path(cfg.output, f"pid{r}").read_text().split()]
    assert len(pids) == 8 and all(_gone(p) for p in pids), (
        "no rank or helper may outlive the launcher"
    )


def test_torchrun_process_group_timeout_is_the_rank_timeout(monkeypatch):
    """Without the launcher's watchdog (torchrun) the process group's timeout is
    ``train.rank_timeout_s``; under the launcher it is a looser backstop."""
    from megatron_video.training import trainer

    seen = []

    def fake_init(timeout_s):
        seen.append(timeout_s)
        raise RuntimeError("stop here")

    monkeypatch.setattr(trainer, "init_distributed", fake_init)
    cfg = tiny_config("ar_dit", "/nonexistent")
    cfg.train.rank_timeout_s = 42.0
    for heartbeat in (None, lambda step: None):
        with pytest.raises(RuntimeError, match="stop here"):
            trainer.train(cfg, heartbeat=heartbeat)
    assert seen == [42.0, 2 * 42.0 + 60]
