"""``parallel.fsdp`` (ZeRO-3 with FSDP2) in the trainer, on 4 ranks.

* The oracle is Megatron's DDP at the same layout: FSDP's losses and gradient norms equal it for
  2 steps (fp32; the gradients are the same sums, reduce-scattered instead of all-reduced), at
  DP 4, with CP (U 2 x DP 2, the shard group is DP x CP) and with TP 2. PP is refused.
* Each rank holds a quarter of the weights (DTensor shards of the DP x CP group). Parameters whose
  first dimension the group does not split (Wan's modulation tables) stay replicated; the
  gradient norm counts them once (``wan_ar`` at U 2 x DP 2 equals DDP).
* A checkpoint saved under FSDP resumes under DDP at another layout and the reverse: the next
  step's loss equals the uninterrupted run's.
"""

import pytest

from megatron_video.testing.configs import tiny_config

LAYOUTS = {
    "dp4": {},
    "u2_dp2": dict(context_parallel_size=2, ulysses_size=2),
    "tp2_dp2": dict(tensor_model_parallel_size=2),
}


def _config(tmp, name, fsdp, layout, steps=3):
    cfg = tiny_config("video_dit", tmp, fsdp=fsdp, **LAYOUTS[layout])
    cfg.output = f"{tmp}/{name}"
    cfg.train.steps = steps
    return cfg


def _steps(tmp, layout):
    import warnings

    from megatron_video.parallel.fsdp import local_tensor
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = {}
    for fsdp in (False, True):
        t = Trainer(_config(tmp, f"{layout}_{fsdp}", fsdp, layout), progress=False)
        try:
            recs = [t.train_step(s) for s in range(2)]
            out[fsdp] = [(r["loss"], r["grad_norm"]) for r in recs]
            local = sum(local_tensor(p).numel() for p in t.model.parameters())
            full = sum(p.numel() for p in t.model.parameters())
            out[f"share_{fsdp}"] = local / full
        finally:
            t.close()
    return out


def _wan_steps(root):
    import warnings
    from pathlib import Path

    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = {}
    for fsdp in (False, True):
        cfg = tiny_wan_config(
            "wan_ar",
            root,
            Path(root) / "shards",
            context_parallel_size=2,
            ulysses_size=2,
            fsdp=fsdp,
        )
        cfg.model.init_from, cfg.output = f"{root}/transformer", f"{root}/run_{fsdp}"
        t = Trainer(cfg, progress=False)
        try:
            out[fsdp] = [(r["loss"], r["grad_norm"]) for r in (t.train_step(s) for s in range(2))]
            out[f"replicated_{fsdp}"] = len(getattr(t.ddp, "replicated", []))
        finally:
            t.close()
    return out


def test_fsdp_wan_with_replicated_parameters(pool4, tmp_path):
    """Wan's modulation tables ([1, 6, D]) stay replicated: their gradients count once in the
    gradient norm (Megatron sums the norm over the shard group once a gradient is a DTensor)."""
    from megatron_video.testing.wan import (
        save_tiny_wan_transformer,
        tiny_wan_config,
        write_random_latent_shards,
    )

    cfg = tiny_wan_config("wan", tmp_path, tmp_path / "shards")
    write_random_latent_shards(cfg, tmp_path / "shards")
    save_tiny_wan_transformer(tmp_path / "transformer", cfg)
    r = pool4.run(_wan_steps, str(tmp_path))[0]
    assert r["replicated_True"] > 0
    for (l0, g0), (l1, g1) in zip(r[False], r[True]):
        assert abs(l1 - l0) <= 1e-5 * abs(l0) and abs(g1 - g0) <= 1e-5 * abs(g0), r


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp_equals_ddp(pool4, vae_dir, layout):
    per_rank = pool4.run(_steps, vae_dir, layout)
    for r in per_rank:
        ddp, fsdp = r[False], r[True]
        for (l0, g0), (l1, g1) in zip(ddp, fsdp):
            assert abs(l1 - l0) <= 1e-5 * abs(l0), (layout, ddp, fsdp)
            assert abs(g1 - g0) <= 1e-5 * abs(g0), (layout, ddp, fsdp)
        assert r["share_False"] == 1.0
        tp = LAYOUTS[layout].get("tensor_model_parallel_size", 1)
        assert r["share_True"] == pytest.approx(tp / 4, rel=0.05)  # 1 / (DP x CP)


def _resume_across(tmp):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = {}
    for fsdp, other in ((True, "u2_dp2"), (False, "dp4")):
        t = Trainer(_config(tmp, f"save_{fsdp}", fsdp, "dp4", steps=4), progress=False)
        try:
            run = [t.train_step(s)["loss"] for s in range(2)]
            t.save(2)  # the state step index 2 starts from
            out[("run", fsdp)] = run + [t.train_step(s)["loss"] for s in (2, 3)]
        finally:
            t.close()
        t = Trainer(_config(tmp, f"load_{fsdp}", not fsdp, other, steps=4), progress=False)
        try:
            step = t.load(f"{tmp}/save_{fsdp}/checkpoints", step=2)
            out[("resumed", fsdp)] = (step, [t.train_step(s)["loss"] for s in (step, step + 1)])
        finally:
            t.close()
    return out


def test_checkpoint_moves_between_fsdp_and_ddp(pool4, vae_dir):
    """Two steps after the resume equal the uninterrupted run's (the first is taken before any
    update; the second needs the restored Adam moments: dropped, it moves by ~4e-3)."""
    r = pool4.run(_resume_across, vae_dir)[0]
    for fsdp in (True, False):
        run, (step, losses) = r[("run", fsdp)], r[("resumed", fsdp)]
        assert step == 2 and losses == pytest.approx(run[2:], rel=1e-5), (fsdp, run, losses)
        print("fsdp" if fsdp else "ddp", "saved; uninterrupted", run[2:], "resumed", losses)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("fsdp"))
    ensure_vae(tiny_config("video_dit", tmp), progress=False)
    return tmp


@pytest.mark.parametrize(
    "parallel, match",
    [
        (dict(fsdp="yes"), r"parallel.fsdp \('yes'\) must be true or false"),
        (
            dict(fsdp=True, pipeline_model_parallel_size=2),
            r"parallel.fsdp \(True\) needs parallel.pipeline_model_parallel_size 1 \(got 2\)",
        ),
    ],
)
def test_fsdp_bad_config(tmp_path, parallel, match):
    from megatron_video.training.config import validate

    cfg = tiny_config("video_dit", str(tmp_path))
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    with pytest.raises(ValueError, match=match):
        validate(cfg, 4)
