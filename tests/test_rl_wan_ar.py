"""Flow-GRPO of ``wan_ar`` (``megatron_video.rl.ar_flow``): rollouts streamed block by block
through the KV-cache generator, float64 on a tiny random Wan (4 blocks of 2 latent frames).

* Each (block, step) log-probability of a fixed rollout equals the Gaussian density written out
  here (Flow-GRPO's SDE step), the velocity from a no-cache forward over the whole video with a
  dense mask written here from the rule (clean frames block-causal, a noisy block sees the clean
  blocks before it and itself), not the cache path that sampled it.
* The loss and its parameter gradients equal an oracle written here on that forward (advantages
  normalised in the group, per-(block, step) ratio clipped, closed-form KL to the frozen start
  model); the oracle without the normalisation or without the clip does not.
* Rollouts, log-probabilities, loss and gradients (summed over CP, TP shards gathered) at
  U2 x R2, U4, R4 and TP2 x CP2 equal CP = 1 (1e-10).
* A sink + window shorter than the video, CFG (``guidance_scale`` 2) and blocks padded to the CP
  size (a 1 x 5 grid: 10 tokens a block over 4 ranks, the last rank's share partial): the
  log-probabilities, loss and gradients equal the oracle with the windowed rule and the guided
  velocity written here, and U2 x R2 equals CP = 1; the full teacher-forcing mask (the block past
  the window) and the unguided velocity must differ (> 1e-6), the windowed stream equals the
  unwindowed one on the blocks the window covers.
* Bad input (G < 2, noise level <= 0, a rule of another block size, a NaN or wrong-shaped
  reward) is a ValueError naming the field, before any collective.
"""

import math
import zlib

import pytest
import torch

from megatron_video.testing.streaming_case import _build, _conds

G, STEPS, NOISE, SHIFT, KL = 3, 2, 0.7, 3.0, 0.04
CLIP_LOW, CLIP_HIGH = 2e-3, 1e-3
F, NB, H, W = 8, 2, 2, 2  # latent frames, frames per block, token grid
S, C = H * W, 4
SEED, POSITION = 7, 11
LAYOUTS = {"u2xr2": (2, 2, 1), "u4": (4, 1, 1), "r4": (1, 4, 1), "tp2xcp2": (1, 2, 2)}


# sink + window (block 3 sees block 0 and block 2, not 1), CFG, a 1 x 5 grid (padded at CP 4)
OPT = dict(sink=NB, window=NB, guidance=2.0, hw=(1, 5))


def _layout(P=1, R=1, tokens=S):
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    return BalancedSPLayout(F, tokens, NB, P, ring_size=R, ring_balance=F % (2 * R * NB) == 0)


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _nudge(model):
    """Move the policy off the rollout policy (the same full change at every layout)."""
    tp, rank = _tp()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
            shape, d = list(p.shape), getattr(p, "partition_dim", -1)
            split = getattr(p, "tensor_model_parallel", False) and d >= 0
            if split:
                shape[d] *= tp
            noise = torch.randn(shape, generator=gen, dtype=p.dtype)
            p.add_(0.02 * (noise.chunk(tp, dim=d)[rank] if split else noise))


def _full_grads(model):
    """Parameter gradients summed over CP (the gradient reduction's sum), TP shards gathered."""
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    tp, _ = _tp()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if ps.get_context_parallel_world_size() > 1:
            torch.distributed.all_reduce(g, group=ps.get_context_parallel_group())
        if tp > 1 and getattr(p, "tensor_model_parallel", False) and p.partition_dim >= 0:
            g = comm.all_gather_cat(g, ps.get_tensor_model_parallel_group(), dim=p.partition_dim)
        out[name] = g
    return out


def _reward(video):
    return video[:, :, 0].mean(dim=1)  # channel 0's mean of each rollout's tokens


def _models(tp=1, cp=1, family="wan_ar"):
    policy, reference = _build(family, tp, cp).train(), _build(family, tp, cp)
    for p in policy.parameters():
        p.requires_grad_(True)
    for p in reference.parameters():
        p.requires_grad_(False)
    return policy, reference


def _rollout(policy, family, layout, groups, sink=0, window=None, guidance=1.0, hw=(H, W)):
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.rl.ar_flow import ar_rollout

    cond, null = _conds(family)
    return ar_rollout(
        policy, cond, layout or _layout(tokens=hw[0] * hw[1]), grid=hw, groups=groups,
        group_size=G, num_steps=STEPS, noise_level=NOISE, shift=SHIFT, seed=SEED,
        position=POSITION, dtype=torch.float64, rule=WindowRule(NB, sink, window),
        null_cond=null if guidance != 1 else None, guidance_scale=guidance,
    )  # fmt: skip


def _case(groups=None, layout=None, tp=1, cp=1, family="wan_ar", **opt):
    from megatron_video.rl.ar_flow import ar_grpo_backward

    policy, reference = _models(tp, cp, family)
    ro = _rollout(policy, family, layout, groups, **opt)
    rewards = _reward(ro.video)
    _nudge(policy)
    stats = ar_grpo_backward(
        policy, reference, ro, rewards, list(range(STEPS)), noise_level=NOISE,
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL,
    )  # fmt: skip
    out = dict(video=ro.video, logprobs=ro.logprobs, rewards=rewards, stats=stats, family=family)
    out.update({**dict(sink=0, window=None, guidance=1.0, hw=(H, W)), **opt})
    out["grads"] = _full_grads(policy)
    if groups is None:  # CP = 1: the states are the video's tokens in frame order
        out["states"] = ro.states
    return out


@pytest.fixture(scope="module")
def cp1():
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        return _case()


# ---------------------------------------------------------------------------------------------
# The oracle: a no-cache forward over the whole video, the SDE step and the loss written out
# ---------------------------------------------------------------------------------------------
def _timesteps():
    u = [1.0 - i / STEPS for i in range(STEPS + 1)]
    return [SHIFT * t / (1.0 + (SHIFT - 1.0) * t) for t in u]


def _dense_velocity(model, clean, noisy, t, got):
    """The noisy half's velocity ``[G, F*S, C]`` of ``[clean ; noisy]`` (frame order) under the
    dense mask written from the rule, every noisy block at timestep ``t``: a block ``k`` keeps the
    earlier clean blocks ``m`` with ``m < sink / NB`` or ``m >= k - window / NB`` (all without a
    window); clean blocks attend the kept ones and themselves, a noisy block the kept ones and
    itself. CFG: ``v_null + g (v_cond - v_null)``."""
    from megatron_video.attention import masks
    from megatron_video.generation.ar_models import sequence_velocity

    (h, w), g = got["hw"], got["guidance"]
    n = h * w
    sb, wb = got["sink"] // NB, F // NB if got["window"] is None else got["window"] // NB
    frame = torch.arange(F).repeat_interleave(n)
    side = torch.cat([torch.zeros(F * n), torch.ones(F * n)]).long()
    fr, blk = torch.cat([frame, frame]), torch.cat([frame, frame]) // NB
    q_side, k_side, qb, kb = side[:, None], side[None, :], blk[:, None], blk[None, :]
    kept = (kb < qb) & ((kb < sb) | (kb >= qb - wb))
    clean_q = (q_side == 0) & (k_side == 0) & (kept | (kb == qb))
    noisy_q = (q_side == 1) & (((k_side == 0) & kept) | ((k_side == 1) & (kb == qb)))
    v = sequence_velocity(
        model, fr, torch.arange(2 * F * n) % n, h, w, masks.from_dense(clean_q | noisy_q)
    )
    tt = torch.cat([torch.zeros(G, F * n), torch.full((G, F * n), t)], dim=1).double()
    x = torch.cat([clean, noisy], dim=1)
    cond, null = (tuple(c.expand(G, *c.shape[1:]) for c in cs) for cs in _conds(got["family"]))
    out = v(x, tt, cond)[:, F * n :]
    if g != 1:
        uncond = v(x, tt, null)[:, F * n :]
        out = uncond + g * (out - uncond)
    return out


def _oracle_step(model, got, i):
    """(mean, per-element std, log-prob [G, J]) of step i of every block, Flow-GRPO's 'sde'."""
    n = got["hw"][0] * got["hw"][1]
    ts = _timesteps()
    sigma, sigma_prev, sigma_max = ts[i], ts[i + 1], ts[1]
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * NOISE
    x, x_next = got["states"][i], got["states"][i + 1]
    v = _dense_velocity(model, got["video"], x, sigma, got)
    mean = (
        x * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    s = std_dev_t * math.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))
    return mean, s, lp.reshape(G, F // NB, NB * n, C).mean(dim=(2, 3))


def _oracle_loss(got, normalise=True, clip=True):
    from megatron_video.models.wan.convert import _one_process

    r = got["rewards"]
    adv = r - r.mean()
    if normalise:
        adv = adv / (r.std() + 1e-6)
    adv = adv[:, None]
    J = F // NB
    with _one_process():
        policy, reference = _models(family=got["family"])
        _nudge(policy)
        total = 0.0
        for i in range(STEPS):
            mean, s, lp = _oracle_step(policy, got, i)
            with torch.no_grad():
                ref_mean, _, _ = _oracle_step(reference, got, i)
            ratio = torch.exp(lp - got["logprobs"][:, :, i])
            low, high = (1 - CLIP_LOW, 1 + CLIP_HIGH) if clip else (-math.inf, math.inf)
            pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
            d2 = ((mean - ref_mean) ** 2).reshape(G, J, -1, C).mean(dim=(2, 3))
            total = total + (pg + KL * d2 / (2 * s**2)).sum() / (G * J * STEPS)
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    return float(total), grads


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_each_step_logprob_is_the_gaussian_density(cp1):
    from megatron_video.models.wan.convert import _one_process

    with _one_process(), torch.no_grad():
        model, _ = _models()
        for i in range(STEPS):
            _, _, want = _oracle_step(model, cp1, i)
            assert _rel(cp1["logprobs"][:, :, i], want) <= 1e-10, i
    assert torch.equal(cp1["states"][-1], cp1["video"])  # the last state is the video


def test_loss_and_gradients_equal_the_oracle(cp1):
    loss, grads = _oracle_loss(cp1)
    assert abs(cp1["stats"]["loss"] - loss) <= 1e-10 * abs(loss), (cp1["stats"]["loss"], loss)
    for name, g in grads.items():
        assert _rel(cp1["grads"][name], g) <= 1e-10, name
    assert 0 < cp1["stats"]["clip_frac"] < 1, cp1["stats"]  # both sides of the clip are seen


def test_ar_dit_logprobs_loss_and_gradients_equal_the_oracle():
    """The same library on ``ar_dit``'s model calls (its trainer: ``ARDiTGRPOTrainer``)."""
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        got = _case(family="ar_dit")
        with torch.no_grad():
            model, _ = _models(family="ar_dit")
            want = [_oracle_step(model, got, i)[2] for i in range(STEPS)]
    for i in range(STEPS):
        assert _rel(got["logprobs"][:, :, i], want[i]) <= 1e-10, i
    loss, grads = _oracle_loss(got)
    assert abs(got["stats"]["loss"] - loss) <= 1e-10 * abs(loss), (got["stats"]["loss"], loss)
    for name, g in grads.items():
        err = float((got["grads"][name] - g).norm())
        assert err <= 1e-10 * max(float(g.norm()), 1e-3), (name, err)


@pytest.mark.parametrize("variant", ["no_normalisation", "no_clip"])
def test_the_oracle_without_normalisation_or_clip_fails(cp1, variant):
    loss, _ = _oracle_loss(cp1, normalise=variant != "no_normalisation", clip=variant != "no_clip")
    assert abs(cp1["stats"]["loss"] - loss) > 1e-6 * abs(loss), (variant, loss)


def _rank_case(name, opt=None):
    from megatron_video.testing.parallel import video_parallel

    U, R, tp = LAYOUTS[name]
    opt = opt or {}
    hw = opt.get("hw", (H, W))
    with video_parallel(U, R, tp=tp, seed=0) as groups:
        return _case(groups, _layout(U * R, R, hw[0] * hw[1]), tp, U * R, **opt)


def _check_ranks(results, cp1):
    n = cp1["hw"][0] * cp1["hw"][1]
    for rank, got in enumerate(results):
        assert got["video"].shape == (G, F * n, C), rank
        for key in ("video", "logprobs", "rewards"):
            assert _rel(got[key], cp1[key]) <= 1e-10, (rank, key)
        for key, want in cp1["stats"].items():
            assert abs(got["stats"][key] - want) <= 1e-10 * max(1.0, abs(want)), (rank, key)
        for name, g in cp1["grads"].items():
            assert _rel(got["grads"][name], g) <= 1e-10, (rank, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_cp1(pool4, cp1, layout):
    _check_ranks(pool4.run(_rank_case, layout, ranks_per_node=4), cp1)


@pytest.fixture(scope="module")
def opt_cp1():
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        return _case(**OPT)


def test_window_cfg_logprobs_are_the_gaussian_density(opt_cp1):
    """Sink + window + CFG: the oracle with the windowed rule and the guided velocity; the full
    teacher-forcing mask agrees on the blocks the window covers and not on the last one (it sees
    block 1, which the rollout's cache had evicted); the unguided velocity does not agree."""
    from megatron_video.models.wan.convert import _one_process

    got = opt_cp1
    with _one_process(), torch.no_grad():
        model, _ = _models()
        for i in range(STEPS):
            assert _rel(got["logprobs"][:, :, i], _oracle_step(model, got, i)[2]) <= 1e-10, i
        full = _oracle_step(model, {**got, "window": None}, 0)[2]
        unguided = _oracle_step(model, {**got, "guidance": 1.0}, 0)[2]
    lp = got["logprobs"][:, :, 0]
    assert _rel(lp[:, :3], full[:, :3]) <= 1e-10
    assert float((lp[:, 3] - full[:, 3]).abs().max()) > 1e-6
    assert float((lp - unguided).abs().max()) > 1e-6
    assert torch.equal(got["states"][-1], got["video"])


def test_window_cfg_loss_and_gradients_equal_the_oracle(opt_cp1):
    loss, grads = _oracle_loss(opt_cp1)
    assert abs(opt_cp1["stats"]["loss"] - loss) <= 1e-10 * abs(loss), (opt_cp1["stats"], loss)
    for name, g in grads.items():
        assert _rel(opt_cp1["grads"][name], g) <= 1e-10, name


def test_window_stream_equals_the_unwindowed_where_the_window_covers(opt_cp1):
    from megatron_video.models.wan.convert import _one_process

    with _one_process(), torch.no_grad():
        model, _ = _models()
        ro = _rollout(model, "wan_ar", None, None, **{**OPT, "window": None})
    k = 3 * NB * OPT["hw"][0] * OPT["hw"][1]  # blocks 0-2: the window covers every earlier one
    assert _rel(opt_cp1["video"][:, :k], ro.video[:, :k]) <= 1e-12
    assert float((opt_cp1["video"][:, k:] - ro.video[:, k:]).abs().max()) > 1e-6


def test_window_cfg_padded_blocks_u2xr2_equal_cp1(pool4, opt_cp1):
    """10 tokens a block over 4 ranks: padded to 12, the last rank holds 1 real token of 3."""
    _check_ranks(pool4.run(_rank_case, "u2xr2", OPT, ranks_per_node=4), opt_cp1)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(group_size=1), "rl.group_size"),
        (dict(noise_level=0.0), "rl.noise_level"),
        (dict(noise_level=-0.5), "rl.noise_level"),
        (dict(rule_nb=1), "frames_per_block"),
    ],
)
def test_bad_rollout_arguments_raise_before_any_collective(kw, field):
    """The groups and the model are tripwires: a check that ran after touching either (the first
    collective needs both) would fail with an AssertionError, not the ValueError."""
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.rl.ar_flow import ar_rollout

    class Tripwire:
        def __getattr__(self, name):
            raise AssertionError(f"touched {name} before the checks")

    args = dict(group_size=G, noise_level=NOISE, num_steps=STEPS)
    nb = kw.pop("rule_nb", None)
    args.update(kw)
    rule = None if nb is None else WindowRule(nb, 0, nb)
    with pytest.raises(ValueError, match=field):
        ar_rollout(
            Tripwire(), (None,), _layout(), grid=(H, W), groups=Tripwire(), rule=rule, **args
        )


@pytest.mark.parametrize(
    "rl, autoregressive, match",
    [
        (dict(window=3), True, r"rl.window \(3\) must be a multiple of model.frames_per_block"),
        (dict(sink=1), True, r"rl.sink \(1\) must be a multiple of model.frames_per_block"),
        (dict(window=2), False, r"rl.window \(2\) must be None for model.family"),
        (dict(window=-2), True, r"rl.window \(-2\) must be null or an integer >= 0"),
    ],
)
def test_bad_rl_sink_or_window_is_named(rl, autoregressive, match):
    from types import SimpleNamespace

    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.rules import _check_window

    with pytest.raises(ValueError, match=match):
        model = SimpleNamespace(frames_per_block=NB, family="wan_ar")
        _check_window(SimpleNamespace(rl=RLConfig(**rl), model=model), autoregressive)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda latents, **_: torch.full((G,), float("nan")), "non-finite"),
        (lambda latents, **_: torch.zeros(G + 1), "shape"),
    ],
)
def test_bad_rewards_are_named(monkeypatch, fn, match):
    from megatron_video.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "bad", fn)
    with pytest.raises(ValueError, match=f"rl.reward function bad.*{match}"):
        rewards.score("bad", G, torch.zeros(G, C, F, H, W))
