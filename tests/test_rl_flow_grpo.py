"""Flow-GRPO of ``wan`` (``megatron_video.rl``), float64 on a tiny random Wan.

* Each step's log-probability of a fixed rollout equals the Gaussian density written out here
  (Flow-GRPO's SDE step, transcribed below from flow_grpo's ``sd3_sde_with_logprob.py``), with
  the velocity from the full-tensor forward (``diffusers_forward``), not the sampler's shard path.
* The loss and its parameter gradients equal an oracle written here (advantages normalised in the
  group, ratio clipped to [1 - low, 1 + high], closed-form KL to the frozen start model) at CP = 1;
  the oracle without the normalisation or without the clip does not (so this test sees both).
* Rollouts, log-probabilities, the loss and the gradients (summed over CP, as the trainer's
  gradient reduction does; TP shards gathered) at U2 x R2, U4, R4 and TP2 x CP2 equal CP = 1
  (1e-10).
"""

import math
import zlib

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import tiny_wan_transformer  # noqa: E402

G, STEPS, NOISE, SHIFT, KL = 3, 3, 0.7, 3.0, 0.04
CLIP_LOW, CLIP_HIGH = 2e-3, 1e-3
SHAPE = (4, 4, 4, 6)  # latent (C, F, H, W): 24 tokens under patch (1, 2, 2)
SEED, POSITION = 7, 11
LAYOUTS = {  # name: (tp, cp, cp_comm_type, hierarchical sizes, ranks per simulated node)
    "u2xr2": (1, 4, "a2a+p2p", [2, 2], 2),
    "u4": (1, 4, "a2a", None, 4),
    "r4": (1, 4, "p2p", None, 2),
    "tp2xcp2": (2, 2, "p2p", None, 2),
}


def _text():
    gen = torch.Generator().manual_seed(5)
    return torch.randn(1, 7, 32, generator=gen, dtype=torch.float64)


def _reward(videos):
    """A deterministic reward of the sampled latents (channel 0's mean), one per rollout."""
    return videos[:, 0].mean(dim=(1, 2, 3))


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _perturb(model):
    """Move the policy off the rollout policy (the same full change at every layout: a TP shard
    takes its slice) so the ratios leave 1."""
    tp, rank = _tp()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            shape, d = list(p.shape), getattr(p, "partition_dim", -1)
            split = getattr(p, "tensor_model_parallel", False) and d >= 0
            if split:
                shape[d] *= tp
            noise = torch.randn(shape, generator=gen, dtype=p.dtype)
            p.add_(0.02 * (noise.chunk(tp, dim=d)[rank] if split else noise))


def _full_grads(model):
    """Parameter gradients summed over CP (as the gradient reduction does), TP shards gathered."""
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


def _models(comm_type):
    from megatron_video.models.wan import from_diffusers

    policy = from_diffusers(tiny_wan_transformer().double(), cp_comm_type=comm_type)
    reference = from_diffusers(tiny_wan_transformer().double(), cp_comm_type=comm_type)
    for p in reference.parameters():
        p.requires_grad_(False)
    return policy, reference


def _case(comm_type="p2p"):
    from megatron_video.generation import cp_sampling as cps
    from megatron_video.models.wan.interop import _cp_group
    from megatron_video.rl.wan import wan_grpo_backward, wan_rollout, wan_videos

    policy, reference = _models(comm_type)
    wr = wan_rollout(
        policy,
        _text(),
        SHAPE,
        group_size=G,
        num_steps=STEPS,
        noise_level=NOISE,
        shift=SHIFT,
        seed=SEED,
        position=POSITION,
        dtype=torch.float64,
    )
    videos = wan_videos(policy, wr)
    rewards = _reward(videos)
    _perturb(policy)
    stats = wan_grpo_backward(
        policy,
        reference,
        wr,
        rewards,
        list(range(STEPS)),
        noise_level=NOISE,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        kl_coef=KL,
    )
    grads = _full_grads(policy)
    group, tokens = _cp_group(policy), wr.geometry.tokens
    states = [cps.gather_tokens(s, wr.local_ids, group, tokens) for s in wr.ro.states]
    return dict(
        videos=videos,
        states=states,
        logprobs=wr.ro.logprobs,
        rewards=rewards,
        stats=stats,
        grads=grads,
    )


@pytest.fixture(scope="module")
def cp1():
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        return _case()


# ---------------------------------------------------------------------------------------------
# The oracle: Flow-GRPO's step and loss written out on full tensors
# ---------------------------------------------------------------------------------------------
def _timesteps():
    u = [1.0 - i / STEPS for i in range(STEPS + 1)]
    return [SHIFT * t / (1.0 + (SHIFT - 1.0) * t) for t in u]


def _velocity(model, x_tokens, t):
    """Full-tensor velocity of patch tokens (diffusers' forward convention), [G, s, D]."""
    from megatron_video.models.embedders import patchify, unpatchify
    from megatron_video.models.wan.interop import diffusers_forward

    grid = (SHAPE[1], SHAPE[2] // 2, SHAPE[3] // 2)
    x = unpatchify(x_tokens, (1, 2, 2), grid, SHAPE[0])
    tt = torch.full((x.shape[0],), t * 1000.0, dtype=x.dtype)
    return patchify(diffusers_forward(model, x, tt, _text().expand(G, -1, -1)), (1, 2, 2))


def _oracle_step(model, x, x_next, i):
    """(mean, per-element std, log-prob [G]) of step i, Flow-GRPO's 'sde' rule."""
    ts = _timesteps()
    sigma, sigma_prev, sigma_max = ts[i], ts[i + 1], ts[1]
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * NOISE
    v = _velocity(model, x, sigma)
    mean = (
        x * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    s = std_dev_t * math.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))
    return mean, s, lp.mean(dim=(1, 2))


def _oracle_loss(got, normalise=True, clip=True):
    from megatron_video.models.wan.convert import _one_process

    r = got["rewards"]
    adv = r - r.mean()
    if normalise:
        adv = adv / (r.std() + 1e-6)
    with _one_process():
        policy, reference = _models("p2p")
        _perturb(policy)
        total = 0.0
        for i in range(STEPS):
            x, x_next = got["states"][i], got["states"][i + 1]
            mean, s, lp = _oracle_step(policy, x, x_next, i)
            with torch.no_grad():
                ref_mean, _, _ = _oracle_step(reference, x, x_next, i)
            ratio = torch.exp(lp - got["logprobs"][:, i])
            low, high = (1 - CLIP_LOW, 1 + CLIP_HIGH) if clip else (-math.inf, math.inf)
            pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
            kl = ((mean - ref_mean) ** 2).mean(dim=(1, 2)) / (2 * s**2)
            total = total + (pg + KL * kl).sum() / (G * STEPS)
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    return float(total), grads


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_each_step_logprob_is_the_gaussian_density(cp1):
    from megatron_video.models.wan.convert import _one_process

    with _one_process(), torch.no_grad():
        model, _ = _models("p2p")
        for i in range(STEPS):
            _, _, want = _oracle_step(model, cp1["states"][i], cp1["states"][i + 1], i)
            assert _rel(cp1["logprobs"][:, i], want) <= 1e-10, i


def test_loss_and_gradients_equal_the_oracle(cp1):
    loss, grads = _oracle_loss(cp1)
    assert abs(cp1["stats"]["loss"] - loss) <= 1e-10 * abs(loss), (cp1["stats"]["loss"], loss)
    for name, g in grads.items():
        assert _rel(cp1["grads"][name], g) <= 1e-10, name
    assert 0 < cp1["stats"]["clip_frac"] < 1, cp1["stats"]  # both sides of the clip are seen


@pytest.mark.parametrize("variant", ["no_normalisation", "no_clip"])
def test_the_oracle_without_normalisation_or_clip_fails(cp1, variant):
    loss, _ = _oracle_loss(cp1, normalise=variant != "no_normalisation", clip=variant != "no_clip")
    assert abs(cp1["stats"]["loss"] - loss) > 1e-6 * abs(loss), (variant, loss)


def _rank_case(layout):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel

    tp, cp, comm_type, hier, _ = LAYOUTS[layout]
    initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=hier,
    )
    model_parallel_cuda_manual_seed(0)
    return _case(comm_type)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_cp1(pool4, cp1, layout):
    for rank, got in enumerate(pool4.run(_rank_case, layout, ranks_per_node=LAYOUTS[layout][4])):
        assert torch.equal(got["states"][0], cp1["states"][0]), rank  # the same seeded noise
        for key in ("videos", "logprobs"):
            assert _rel(got[key], cp1[key]) <= 1e-10, (rank, key)
        for key, want in cp1["stats"].items():
            assert abs(got["stats"][key] - want) <= 1e-10 * max(1.0, abs(want)), (rank, key)
        for name, g in cp1["grads"].items():
            assert _rel(got["grads"][name], g) <= 1e-10, (rank, name)
