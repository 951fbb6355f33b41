"""``train.objective: grpo`` (training/grpo.py): GRPO of video_llava in ``megatron-video train``,
on the 4-rank pool, from examples/configs/video_llava_grpo.yaml at 2 steps (2 responses a prompt).

The GRPO math itself (rollouts, log-probs, loss and gradients at U2xR2, U4, R4 and TP2xCP2 against
Megatron's own CP = 1 forward and explicit float64 formulas) is tests/test_mrsp.py. Here: the
trainer around it. The same global batch gives the same rollouts, rewards and gradient at U2xR2
and DP4 (DP ranks own whole groups; the loss is normalised over the global batch); a resumed run
repeats the uninterrupted one (the rollout seeds are the samples' positions); the encoder runs
once per prompt on each rank with its share of the frames and stays frozen, or, with
``rl.train_encoder``, twice (the reference encodes with its own) and trains; ``model.init_from``
starts policy and reference from a supervised checkpoint (KL 0 at the first step); a reward that
fails on some DP ranks stops every rank; bad input names the field."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "examples" / "configs" / "video_llava_grpo.yaml")
SFT = str(ROOT / "examples" / "configs" / "video_llava.yaml")
LAYOUTS = {
    "u2xr2": [],
    "dp4": ["parallel.context_parallel_size=1", "parallel.ulysses_size=1",
            "parallel.ring_size=1", "train.micro_batch_size=1"],
}  # fmt: skip
BASE = [
    "model.init_from=null",
    "train.global_batch_size=4",
    "train.tensorboard=false",
    "rl.group_size=2",
]


def _run(path, overrides, steps=(2,)):
    """Train to each of ``steps`` in turn (resuming); per step the records, the encoder calls
    (frames each) and whether the encoder's weights moved."""
    import warnings

    import torch

    from megatron_video.testing.mrsp_case import llm_weight_sum
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = []
    for n in steps:
        t = Trainer(load_config(path, list(overrides) + [f"train.steps={n}"]), progress=False)
        calls, enc = [], t.model.vision_model
        inner = enc.forward
        enc.forward = lambda x: calls.append(x.shape[0]) or inner(x)
        before = [p.detach().clone() for p in enc.parameters()]
        start = llm_weight_sum(t.model)  # the policy as built (model.init_from loaded)
        try:
            metrics = t.run()
            history = [
                {
                    k: h.get(k)
                    for k in ("step", "loss", "reward_mean", "kl", "clip_frac", "grad_norm")
                }
                for h in metrics.get("history", [])
            ]
            moved = any(not torch.equal(a, p) for a, p in zip(before, enc.parameters()))
            out.append(
                dict(history=history, calls=calls, moved=moved, logger=t.is_logger, start=start)
            )
            if metrics:
                out[-1]["files"] = sorted(p.name for p in Path(t.config.output).iterdir())
        finally:
            t.close()
    return out


def _logged(per_rank):
    return next(r for r in per_rank if r[-1]["logger"])


def _close(a, b, rel=1e-5):
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for k in ("loss", "reward_mean", "kl", "clip_frac", "grad_norm"):
            assert x[k] == pytest.approx(y[k], rel=rel, abs=1e-7), (k, x, y)


def _same_step0(a, b):
    """The first step of two layouts: the same rollouts and rewards, KL 0, the same gradient
    norm (the GRPO gradient of the global batch). Later steps are not compared this tightly:
    Adam's first update turns fp32 noise in near-zero gradients (output rows of tokens nobody
    sampled) into differences of a fraction of the learning rate."""
    x, y = a[0], b[0]
    assert x["reward_mean"] == y["reward_mean"] and x["kl"] == y["kl"] == 0, (x, y)
    assert x["clip_frac"] == y["clip_frac"] and abs(x["loss"] - y["loss"]) < 1e-6, (x, y)
    assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x, y)
    assert a[1]["reward_mean"] == b[1]["reward_mean"], (a[1], b[1])
    # measured: 4.5e-4 relative (fp32 noise through Adam's first update); 10x that
    assert a[1]["loss"] == pytest.approx(b[1]["loss"], rel=4.5e-3), (a[1], b[1])
    print("step 1 loss", a[1]["loss"], b[1]["loss"], abs(a[1]["loss"] / b[1]["loss"] - 1))


def test_grpo_layouts_resume_and_embedding_cache(pool4, tmp_path):
    runs = {}
    for name, extra in LAYOUTS.items():
        over = BASE + extra + [f"output={tmp_path / name}"]
        runs[name] = pool4.run(_run, GRPO, over, (2,) if name != "u2xr2" else (1, 2))
    over = BASE + [f"output={tmp_path / 'whole'}"]
    whole = _logged(pool4.run(_run, GRPO, over, (2,)))[-1]["history"]
    ref = _logged(runs["u2xr2"])[-1]  # resumed at step 1 (the first run saved it)
    _close(ref["history"], whole, rel=1e-6)  # = the uninterrupted run
    assert ref["files"] == ["checkpoints", "loss.png", "metrics.json", "reward.png"]
    assert [h["step"] for h in ref["history"]] == [0, 1]
    for name in ("dp4",):
        _same_step0(_logged(runs[name])[-1]["history"], ref["history"])
    # the first step's reference is the policy (KL 0), the second's is not; some reward
    assert ref["history"][0]["kl"] == 0 and ref["history"][1]["kl"] > 0
    assert ref["history"][0]["clip_frac"] == 0  # one update per rollout batch: ratio 1
    assert 0 < max(h["reward_mean"] for h in ref["history"])
    # the embedding cache: one encoder call per prompt and step on every rank, on its share of
    # the 9 frames (CP 4: 2 or 3 frames; DP 4: its own prompt, all 9); the encoder stays frozen
    for rank, res in enumerate(runs["u2xr2"]):
        assert len(res[-1]["calls"]) == 4 and set(res[-1]["calls"]) <= {2, 3}, (rank, res)
        assert not res[-1]["moved"]
    for res in runs["dp4"]:
        assert res[-1]["calls"] == [9, 9] and not res[-1]["moved"]


def test_train_encoder_and_init_from(pool4, video_llava_sft, tmp_path):
    """``rl.train_encoder``: the policy re-encodes with gradients (2 calls of its encoder per
    prompt; the reference encodes with its own), and the encoder trains. ``model.init_from``: policy and
    reference start from the supervised checkpoint (KL 0 at the first step, the SFT weights)."""
    over = BASE[1:] + LAYOUTS["dp4"]
    over += [f"model.init_from={video_llava_sft}", "rl.train_encoder=true"]
    res = pool4.run(_run, GRPO, over + [f"output={tmp_path / 'enc'}"], (1,))
    for r in res:
        assert r[-1]["calls"] == [9, 9] and r[-1]["moved"], r  # the reference: its own encoder
    assert _logged(res)[-1]["history"][0]["kl"] == 0
    # the policy starts from the supervised weights (the SFT run's own sum at its end), not the
    # seed's
    sft = json.loads((Path(video_llava_sft).parent / "llm_weight_sum.json").read_text())
    assert abs(sft["trained"] / sft["seed"] - 1) > 1e-6, sft  # the supervised step moved them
    assert all(r[-1]["start"] == pytest.approx(sft["trained"], rel=1e-12) for r in res), (res, sft)


def test_mini_batches_update_several_times_so_the_clip_acts(pool4, tmp_path):
    """``rl.mini_batches: 2`` (2 micro-batches per DP rank): two optimizer updates per rollout
    batch. The second mini-batch's ratios differ from 1 (the policy moved), so a tight clip acts;
    with one update per rollout batch the ratio is 1 up to rounding and it never does
    (``test_grpo_layouts_resume_and_embedding_cache``'s first step: KL 0 and no clip)."""
    over = BASE[:1] + LAYOUTS["dp4"] + ["train.global_batch_size=8", "rl.clip=0.001"]
    over += ["rl.mini_batches=2", "rl.loss_agg=micro_token_mean", f"output={tmp_path}"]
    rec = _logged(pool4.run(_run, GRPO, over, (1,)))[-1]["history"][0]
    assert rec["clip_frac"] > 0 and rec["kl"] > 0, rec


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["model.family=video_dit", *LAYOUTS["dp4"]],
            r"train.objective \('grpo'\) and the rl section are for model.family in "
            r"\['ar_dit', 'qwen_vl', 'video_dit', 'video_llava', 'wan', 'wan_ar'\]",
        ),
        (["train.objective=supervised"], r"the rl section is read with train.objective 'grpo'"),
        (["train.objective=ppo"], r"train.objective \('ppo'\) must be 'supervised' or 'grpo'"),
        (["parallel.fsdp=true"], r"parallel.fsdp \(True\) must be false with train.objective"),
        (["rl.group_size=1"], r"rl.group_size \(1\) must be >= 2"),
        (
            ["parallel.pipeline_model_parallel_size=2", *LAYOUTS["dp4"]],
            r"must be 1 with train.objective 'grpo'",
        ),
        (["model.init_from=/nowhere"], r"model.init_from \('/nowhere'\) must be a megatron-video"),
        (
            ["rl.mini_batches=3"],
            r"rl.mini_batches \(3\) must divide the micro-batches per DP rank \(1 ",
        ),
    ],
)
def test_bad_grpo_config_names_the_field(overrides, match):
    from megatron_video.training.config import load_config, validate

    with pytest.raises(ValueError, match=match):
        validate(load_config(GRPO, ["model.init_from=null"] + overrides), 4)


@pytest.mark.parametrize(
    "override, match",
    [
        ("rl.clip=1.5", r"rl.clip \(1.5\) must be a finite number in \(0, 1\)"),
        ("rl.clip=inf", r"rl.clip \(inf\) must be a finite number in \(0, 1\)"),
        ("rl.eps=inf", r"rl.eps \(inf\) must be a finite number > 0"),
        ("rl.seed=abc", r"rl.seed \('abc'\) must be an integer"),
        ("rl.dual_clip=1", r"rl.dual_clip \(1\) must be null or a finite number > 1"),
        ("rl.clip_high=inf", r"rl.clip_high \(inf\) must be null or a finite number > 0"),
        ("rl.loss_agg=seq", r"rl.loss_agg \('seq'\) must be one of global_token_mean, micro"),
    ],
)
def test_rl_section_refuses_bad_values(override, match):
    """The ``rl:`` section as the command line passes it (YAML scalars; ``inf`` is a string that
    the loader reads as a float for float fields): refused where it is declared."""
    from megatron_video.training.config import load_config

    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def half_nan_reward(tokens, lengths, answer_id, format_ids):
    """Non-finite for odd answer ids only: some DP ranks' prompts fail, the others' do not."""
    import torch

    return torch.full((tokens.shape[0],), float("nan") if answer_id % 2 else 0.0)


def half_raising_reward(tokens, lengths, answer_id, format_ids):
    """Raises a ``RuntimeError`` (not a ``ValueError``) for odd answer ids only."""
    if answer_id % 2:
        raise RuntimeError("reward server unreachable")
    return tokens.new_zeros(tokens.shape[0], dtype=float)


def _bad_reward_steps(overrides, rewards):
    """Step ``i`` with ``rl.reward`` ``rewards[i]`` in one trainer: each step's error (or None)."""
    import dataclasses
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(load_config(GRPO, overrides), progress=False)
    out = []
    try:
        for step, reward in enumerate(rewards):
            t.config.rl = dataclasses.replace(t.config.rl, reward=reward)
            try:
                t.train_step(step)
                out.append(None)
            except ValueError as e:
                out.append(str(e))
        return out
    finally:
        t.close()


def test_a_bad_reward_on_some_dp_ranks_stops_every_rank(pool4, tmp_path):
    """A reward function failing on some DP ranks' prompts (a non-finite reward, or any
    exception): every rank raises, each naming the function and the failure, and none waits in
    a later collective."""
    over = BASE + LAYOUTS["dp4"] + [f"output={tmp_path}"]
    rewards = ["test_grpo_train:half_nan_reward", "test_grpo_train:half_raising_reward"]
    res = pool4.run(_bad_reward_steps, over, rewards)
    for step, what in enumerate(
        ["returned a non-finite", "raised RuntimeError: reward server unreachable"]
    ):
        errors = [r[step] for r in res]
        assert all(e and e.startswith(f"GRPO step {step}") for e in errors), errors
        assert all(f"{rewards[step]} {what}" in e for e in errors), errors
        assert any("refused on another rank (rank " in e for e in errors), errors
