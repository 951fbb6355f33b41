"""Reliability on gloo ranks: resume under another parallel layout, corrupt / unsafe checkpoints,
atomic saves, non-finite steps, bitwise reruns, dead and hung ranks (README "Failure behaviour").

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

from test_models_parallel import tiny_config

CP4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
OTHER_LAYOUTS = {
    "dp2_cp2_u2": dict(context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2),
    "tp2_cp2_r2": dict(tensor_model_parallel_size=2, context_parallel_size=2, ulysses_size=1, ring_size=2,
                       ranks_per_node=2),
    "cp4_ring_inner": dict(CP4, placement="ring_inner", ranks_per_node=4, ring_balance=False),
    "pp2_cp2_u2": dict(pipeline_model_parallel_size=2, context_parallel_size=2, ulysses_size=2, ring_size=1,
                       ranks_per_node=2),
}


def _trainer(tmp, name, **parallel):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config("ar_dit", tmp, **parallel)
    cfg.output = f"{tmp}/{name}"
    return Trainer(cfg, progress=False)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("reliability"))
    ensure_vae(tiny_config("ar_dit", tmp), progress=False)
    return tmp


# ---------------------------------------------------------------------------------------------
# resharding resume
# ---------------------------------------------------------------------------------------------
def _reshard(tmp):
    out = {}
    t = _trainer(tmp, "reshard_src", **CP4)                       # DP1 x CP4 (U2 x R2)
    try:
        for s in range(2):
            t.train_step(s)
        t.save(2)
        out["same"] = [t.train_step(s)["loss"] for s in (2, 3)]
        out["gbs"] = t.global_batch
    finally:
        t.close()
    ckdir = f"{tmp}/reshard_src/checkpoints"
    for name, layout in OTHER_LAYOUTS.items():
        t = _trainer(tmp, f"reshard_{name}", **layout)
        try:
            assert t.load(ckdir) == 2
            out[name] = ([t.train_step(s)["loss"] for s in (2, 3)], t.global_batch, t.dp_size)
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
            t.load(f"{tmp}/reshard_src/checkpoints")
        return str(e.value)
    finally:
        t.close()


def test_resume_under_another_layout(pool4, vae_dir):
    res = pool4.run(_reshard, vae_dir)
    for r in res:
        same = r["same"]
        for name in OTHER_LAYOUTS:
            losses, gbs, dp = r[name]
            assert gbs == r["gbs"] == 4
            if losses[0] is None:        # a first pipeline stage: no loss here
                assert name.startswith("pp")
                continue
            for a, b in zip(same, losses):
                assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(a), (name, same, losses)
    assert res[0]["dp2_cp2_u2"][2] == 2
    msgs = pool4.run(_refuse_shape, vae_dir)
    for m in msgs:
        assert "different model shape" in m and "model.hidden_size: checkpoint 48 vs job 32" in m, m
