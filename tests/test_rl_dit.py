"""Flow-GRPO of ``video_dit`` (``diffusion.objective: flow``; ``rl.video_dit``), float64 on a tiny
DiT: rollouts (the same seeded noise), log-probabilities, the GRPO loss and its gradients (summed
over CP, as the gradient reduction does) at U2 x R2 and U4 equal CP = 1 (1e-10), with the policy
moved off the rollout policy so the clip acts. The step's formulas against an explicit oracle:
tests/test_rl_flow_grpo.py (shared ``rl.flow_grpo``)."""

import zlib

import pytest
import torch

G, STEPS, NOISE, SHIFT, KL = 3, 3, 0.7, 3.0, 0.04
LAYOUTS = {"reference": (1, 1, 4), "u2xr2": (2, 2, 2), "u4": (4, 1, 4)}  # U, R, ranks per node


def _config(layout):
    from megatron_video.testing.configs import tiny_config

    U, R, rpn = LAYOUTS[layout]
    cfg = tiny_config(
        "video_dit",
        "/tmp/unused",
        context_parallel_size=U * R,
        ulysses_size=U,
        ring_size=R,
        ranks_per_node=rpn,
    )
    cfg.diffusion.objective = "flow"
    return cfg


def _set_weights(model, extra: float = 0.0):
    """Deterministic full weights by name (any layout); ``extra``: a further change (the policy)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                full += 1.0
            full += extra * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(full)


def _case(layout):
    from megatron_video.generation import cp_sampling as cps
    from megatron_video.parallel import comm
    from megatron_video.rl.video_dit import dit_grpo_backward, dit_rollout, dit_tokens
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.batches.fixed import rank_token_ids
    from megatron_video.training.families import get_family

    U, R, rpn = LAYOUTS[layout]
    cfg, fam = _config(layout), get_family("video_dit")
    with video_parallel(U, R, ranks_per_node=rpn, seed=0) as groups:
        policy, reference = (
            fam.build_model(fam.transformer_config(cfg), config=cfg).double() for _ in range(2)
        )
        _set_weights(policy)
        _set_weights(reference)
        reference.requires_grad_(False)
        geo = fam.sample_layout(cfg, groups.cp_size).geometry
        ids = rank_token_ids((geo.frames, geo.height, geo.width), groups.cp_rank, groups.cp_size)
        caption = torch.tensor([[3, 5, 7, 2] + [0] * 12])  # data.caption_len 16
        dr = dit_rollout(
            policy,
            caption,
            caption != 0,
            geo,
            ids,
            groups.cp_group,
            group_size=G,
            num_steps=STEPS,
            noise_level=NOISE,
            shift=SHIFT,
            seed=1,
            position="0:5",
            dtype=torch.float64,
        )
        tokens = dit_tokens(dr)
        rewards = tokens[..., 0].mean(dim=1)
        _set_weights(policy, extra=0.02)
        stats = dit_grpo_backward(
            policy,
            reference,
            dr,
            rewards,
            list(range(STEPS)),
            noise_level=NOISE,
            clip_low=2e-3,
            clip_high=1e-3,
            kl_coef=KL,
        )
        grads = {}
        for name, p in policy.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            if groups.cp_size > 1:
                comm.all_reduce(g, groups.cp_group, tag="test.grad")
            grads[name] = g
        first = cps.gather_tokens(dr.ro.states[0], ids, groups.cp_group, geo.tokens)
        return dict(first=first, tokens=tokens, logprobs=dr.ro.logprobs, stats=stats, grads=grads)


def _rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.fixture(scope="module")
def reference(pool4):
    return pool4.run(_case, "reference")[0]


def test_reference_sees_the_clip(reference):
    assert 0 < reference["stats"]["clip_frac"] < 1, reference["stats"]
    assert reference["stats"]["kl"] > 0


@pytest.mark.parametrize("layout", ["u2xr2", "u4"])
def test_layouts_equal_cp1(pool4, reference, layout):
    for rank, got in enumerate(pool4.run(_case, layout, ranks_per_node=LAYOUTS[layout][2])):
        assert torch.equal(got["first"], reference["first"]), rank
        for key in ("tokens", "logprobs"):
            assert _rel(got[key], reference[key]) <= 1e-10, (rank, key)
        for key, want in reference["stats"].items():
            assert abs(got["stats"][key] - want) <= 1e-10 * max(1.0, abs(want)), (rank, key)
        for name, g in reference["grads"].items():  # (the null caption's: 0, no CFG here)
            err = float((got["grads"][name] - g).norm())
            assert err <= 1e-10 * max(float(g.norm()), 1e-3), (rank, name, err)


def _train(tmp):
    import warnings
    from pathlib import Path

    from megatron_video.rl.config import RLConfig
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config(
        "video_dit",
        tmp,
        context_parallel_size=4,
        ulysses_size=2,
        ring_size=2,
        ranks_per_node=2,
    )
    cfg.diffusion.objective = "flow"
    cfg.train.objective = "grpo"
    cfg.train.global_batch_size = 2
    cfg.rl = RLConfig(
        group_size=2, sampling_steps=2, reward="megatron_video.rl.rewards:dominant_colour"
    )
    t = Trainer(cfg, progress=False)
    try:
        metrics = t.run()
        keys = ("step", "loss", "reward_mean", "kl", "grad_norm")
        hist = [{k: h.get(k) for k in keys} for h in metrics.get("history", [])]
        files = sorted(p.name for p in Path(cfg.output).iterdir()) if metrics else []
        return dict(history=hist, logger=t.is_logger, files=files)
    finally:
        t.close()


def test_grpo_trains_video_dit_on_procedural_clips_with_the_colour_reward(pool4, tmp_path):
    """The trainer (``training.grpo_dit``): rollouts decoded by the project VAE, scored by the
    dominant colour against the caption's, two steps at U2 x R2."""
    got = next(r for r in pool4.run(_train, str(tmp_path), ranks_per_node=2) if r["logger"])
    first, second = got["history"]
    assert -2 < first["reward_mean"] < 0, first  # an RGB distance, negated
    assert first["kl"] == 0 and second["kl"] > 0 and first["grad_norm"] > 0, got["history"]
    assert "reward.png" in got["files"]
