"""The diffusion GRPO's rewards and step choice (``rl.rewards``, ``rl.flow_grpo``), no model: the
shipped rewards rank the right colour first; a reward returning NaN, the wrong shape or not
numbers, or raising, is a ``ValueError`` naming the function; ``rl.reward`` resolves registered
names and module:function; the trained steps (all / random / window) are deterministic."""

import pytest
import torch

from megatron_video.data.synthetic import ShapeAttributes, render_video
from megatron_video.rl import rewards
from megatron_video.rl.flow_grpo import sde_std, select_steps
from megatron_video.rl.grpo import group_advantages


def _clip(colour):
    attrs = ShapeAttributes("circle", "large", colour, colour, "left to right", 4.0, 8.0, 8.0, 1.0)
    return render_video(attrs, num_frames=3, height=16, width=16)


def test_dominant_colour_prefers_the_captioned_colour():
    videos = torch.stack([_clip(c) for c in ("red", "blue", "green")])
    r = rewards.dominant_colour(None, "a large blue circle", videos=videos)
    assert r.shape == (3,) and int(r.argmax()) == 1, r
    assert float(r[1]) > -0.05, r  # the rendered blue is the vocabulary's blue
    with pytest.raises(ValueError, match=r"dominant_colour scores decoded videos"):
        rewards.dominant_colour(videos, "a large blue circle")


def test_latent_colour_is_highest_for_the_clean_latents():
    gen = torch.Generator().manual_seed(0)
    clean = (
        torch.randn(4, 2, 3, 3, generator=gen) + torch.tensor([1.0, -1, 0, 2])[:, None, None, None]
    )
    latents = torch.stack([clean, clean + 0.5, -clean])
    r = rewards.latent_colour(latents, clean=clean)
    assert r[0] == 0 and r[0] > r[1] > r[2], r


def _nan(latents, **_):
    return torch.full((latents.shape[0],), float("nan"))


def _short(latents, **_):
    return torch.zeros(latents.shape[0] - 1)


def _text(latents, **_):
    return ["good"] * latents.shape[0]


def _raises(latents, **_):
    raise KeyError("caption")


@pytest.mark.parametrize(
    "fn, match",
    [
        ("_nan", r"returned a non-finite reward"),
        ("_short", r"returned shape \(1,\); it must return one reward per rollout \(2,\)"),
        ("_text", r"not numbers"),
        ("_raises", r"raised KeyError"),
    ],
)
def test_bad_rewards_are_value_errors_naming_the_function(fn, match):
    spec = f"test_rl_rewards:{fn}"
    with pytest.raises(ValueError, match=match) as e:
        rewards.score(spec, 2, torch.zeros(2, 4, 1, 2, 2))
    assert spec in str(e.value)


def test_reward_specs_resolve():
    assert rewards.resolve_reward("latent_colour") is rewards.latent_colour
    assert (
        rewards.resolve_reward("megatron_video.rl.rewards:latent_colour") is rewards.latent_colour
    )
    with pytest.raises(ValueError, match=r"rl.reward \('nowhere:fn'\) must be one of"):
        rewards.resolve_reward("nowhere:fn")
    with pytest.raises(ValueError, match=r"names no colour"):
        rewards.caption_colour("a large circle")


def test_trained_steps():
    assert select_steps(5, "all", 1) == [0, 1, 2, 3, 4]
    assert [select_steps(5, "window", 2, s) for s in range(5)] == [
        [0, 1], [1, 2], [2, 3], [3, 4], [0, 1]
    ]  # fmt: skip
    a = select_steps(10, "random", 3, train_step=4, seed=1)
    assert a == select_steps(10, "random", 3, train_step=4, seed=1) and len(set(a)) == 3
    assert a != select_steps(10, "random", 3, train_step=5, seed=1)
    with pytest.raises(ValueError, match=r"rl.train_steps \('x'\)"):
        select_steps(5, "x", 1)
    with pytest.raises(ValueError, match=r"rl.train_step_count \(6\)"):
        select_steps(5, "window", 6)


def test_group_and_noise_rules():
    with pytest.raises(ValueError, match=r"rl.group_size"):
        group_advantages(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"rl.noise_level \(0.0\) must be > 0"):
        sde_std(0.5, 0.9, 0.0)
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64))
