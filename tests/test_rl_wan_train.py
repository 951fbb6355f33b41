"""``train.objective: grpo`` for ``wan`` (``rl.trainer.WanGRPOTrainer``) in the trainer, on latent
shards of the tiny random Wan: two steps at U2 x R2 and at DP 4 give the same rewards, loss, KL
and gradient norm (DP ranks own whole groups; the loss is the mean over the global batch's
groups; rollouts are seeded by the sample's position); the outputs include ``reward.png``. Bad
``rl`` input and the families without GRPO are ``ValueError``s naming the field or the reason
(``rl.rules``), raised by ``validate`` before any collective. The Flow-GRPO math itself (log-
probabilities, loss, gradients, layouts) is tests/test_rl_flow_grpo.py."""

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import (  # noqa: E402
    tiny_wan_config,
    write_random_latent_shards,
)

LAYOUTS = {  # the same global batch of 2 samples: one CP group of 4, or two DP ranks of CP 2
    "u2xr2": (dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2), 2),
    "u2_dp2": (dict(context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2), 2),
}
RL = dict(
    group_size=2,
    sampling_steps=2,
    reward="megatron_video.rl.rewards:latent_colour",
    kl_coef=0.04,
    noise_level=0.7,
)


def _config(root, layout: str, **rl):
    from megatron_video.rl.config import RLConfig

    parallel, world = LAYOUTS[layout]
    cfg = tiny_wan_config("wan", root, root / "shards", **parallel)
    cfg.train.objective = "grpo"
    cfg.train.micro_batch_size = 1
    cfg.train.global_batch_size = 2
    cfg.train.save = False
    cfg.rl = RLConfig(**{**RL, **rl})
    cfg.output = str(root / f"run_{layout}")
    return cfg


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_wan")
    write_random_latent_shards(tiny_wan_config("wan", root, root / "shards"), root / "shards")
    return root


def _train(root, layout):
    import warnings
    from pathlib import Path

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(_config(root, layout), progress=False)
    try:
        metrics = t.run()
        keys = ("step", "loss", "reward_mean", "kl", "clip_frac", "grad_norm")
        hist = [{k: h.get(k) for k in keys} for h in metrics.get("history", [])]
        files = sorted(p.name for p in Path(t.config.output).iterdir()) if metrics else []
        return dict(history=hist, logger=t.is_logger, files=files)
    finally:
        t.close()


@pytest.fixture(scope="module")
def trained(pool4, root):
    out = {}
    for layout in LAYOUTS:
        per_rank = pool4.run(_train, root, layout, ranks_per_node=2)
        out[layout] = next(r for r in per_rank if r["logger"])
    return out


def test_grpo_trains_wan_and_writes_the_reward_curve(trained):
    got = trained["u2xr2"]
    assert [h["step"] for h in got["history"]] == [0, 1]
    assert {"reward.png", "metrics.json"} <= set(got["files"])
    first, second = got["history"]
    assert first["kl"] == 0 and abs(first["loss"]) < 1e-6  # on-policy, advantages sum to 0
    assert second["kl"] > 0 and first["grad_norm"] > 0  # the update moved the policy


def test_layouts_and_dp_give_the_same_steps(trained):
    a, b = trained["u2xr2"]["history"], trained["u2_dp2"]["history"]
    for x, y in zip(a, b):
        for k in ("loss", "reward_mean", "kl", "clip_frac", "grad_norm"):
            # measured: rel 3.7e-7 (kl), 1.6e-8 (reward), 0 for the rest (fp32 reductions in
            # another order); the bound is under 10x the largest
            assert x[k] == pytest.approx(y[k], rel=3.5e-6, abs=1e-9), (k, x, y)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rl=dict(group_size=1)), r"rl.group_size \(1\) must be >= 2"),
        (dict(rl=dict(noise_level=0.0)), r"rl.noise_level \(0.0\) must be a finite number > 0"),
        (dict(rl=dict(clip_high=-0.5)), r"rl.clip_high \(-0.5\) must be null or a finite"),
        (dict(rl=dict(dual_clip=3.0)), r"rl.dual_clip \(3.0\) must be None with a diffusion"),
        (dict(rl=dict(mini_batches=2)), r"rl.mini_batches \(2\) must be 1 with a diffusion"),
        (dict(rl=dict(train_steps="some")), r"rl.train_steps \('some'\) must be"),
        (dict(rl=dict(train_step_count=3)), r"rl.train_step_count \(3\) must be in \[1,"),
        (dict(rl=dict(reward="megatron_video.mmsp.rl:exact_match_reward")), r"rl.reward .* VLM"),
        (dict(data=dict(i2v_probability=0.5)), r"data.i2v_probability \(0.5\) must be null"),
        (dict(data=dict(num_frames=9)), r"data.num_frames \(9\) must give latent token frames"),
        (dict(family="video_dit"), r"'video_dit' has no GRPO: diffusion.objective 'edm' has no"),
        (dict(family="wan_ar", rl=dict(group_size=1)), r"rl.group_size \(1\) must be >= 2"),
        (dict(rl=dict(window=2)), r"rl.window \(2\) must be None for model.family 'wan'"),
        (dict(family="wan_ar", rl=dict(sink=-1)), r"rl.sink \(-1\) must be >= 0"),
        (dict(train=dict(objective="supervised"), rl=dict()), r"read with train.objective 'grpo'"),
    ],
)
def test_bad_rl_config_names_the_field(tmp_path, change, match):
    from megatron_video.training.config import config_from_dict, validate

    def build():
        cfg = _config(tmp_path, "u2xr2")
        d = __import__("dataclasses").asdict(cfg)
        d["rl"].update(change.get("rl", {}))
        d["train"].update(change.get("train", {}))
        d["data"].update(change.get("data", {}))
        if "family" in change:
            d["model"]["family"] = change["family"]
            d["diffusion"]["objective"] = None
            if change["family"] == "wan_ar":
                d["model"]["frames_per_block"] = 1
        return config_from_dict(d)

    with pytest.raises(ValueError, match=match):
        validate(build(), 4)


def _nan_on_one_rank(latents, **_):
    """NaN on DP rank 0 of u2_dp2 only (a reward failing on some DP ranks)."""
    from megatron.core import parallel_state as ps

    bad = ps.get_data_parallel_rank() == 0
    return torch.full((latents.shape[0],), float("nan") if bad else 0.0)


def _train_bad_reward(root):
    from megatron_video.training.trainer import Trainer

    cfg = _config(root, "u2_dp2", reward="test_rl_wan_train:_nan_on_one_rank")
    cfg.train.steps = 1
    t = Trainer(cfg, progress=False)
    try:
        t.run()
    except ValueError as e:
        return str(e)
    finally:
        t.close()
    return None


def test_a_bad_reward_on_one_dp_rank_stops_every_rank(pool4, root):
    for msg in pool4.run(_train_bad_reward, root, ranks_per_node=2):
        assert msg is not None and "GRPO step 0" in msg, msg
