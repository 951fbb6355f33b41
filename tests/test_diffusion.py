"""EDM, flow matching, samplers and CFG against analytic oracles (Gaussian data, exact ODE solutions)."""

import math

import pytest
import torch

from megatron_video.diffusion import (
    EDMConfig,
    EDMPrecond,
    classifier_free_guidance,
    drop_condition,
    edm_euler_sampler,
    edm_heun_sampler,
    edm_loss,
    edm_loss_weight,
    edm_scalings,
    expand_block_timesteps,
    expand_like,
    flow_euler_sampler,
    fm_interpolate,
    fm_loss,
    fm_target,
    guided_denoise,
    karras_sigmas,
    sample_sigma,
    sample_timesteps,
    shift_timesteps,
)

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

S_DATA = 0.5  # data ~ N(0, S_DATA^2) elementwise; equals EDM's default sigma_data
F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def gaussian_denoiser(s=S_DATA):
    """Optimal denoiser for N(0, s^2) data: E[x0 | x0 + sigma n = x] = x s^2 / (s^2 + sigma^2)."""
    return lambda x, sigma, cond: x * s**2 / (s**2 + expand_like(sigma, x, "sigma") ** 2)


def gaussian_velocity(s=S_DATA):
    """Optimal flow velocity E[eps - x0 | x_t = x] = x (t - (1-t) s^2) / ((1-t)^2 s^2 + t^2)."""

    def v(x, t, cond):
        t = expand_like(t, x, "t")
        return x * (t - (1 - t) * s**2) / ((1 - t) ** 2 * s**2 + t**2)

    return v


def var_tolerance(n, z=5.0):
    """z standard errors of a sample variance of n Gaussian draws, relative: z * sqrt(2 / (n - 1))."""
    return z * math.sqrt(2.0 / (n - 1))


# ---------------------------------------------------------------------------------------------- EDM


def test_edm_identities():
    sigma = torch.logspace(-4, 3, 200, dtype=F64)
    for sd in (0.5, 1.0, 0.1):
        c_skip, c_out, c_in, c_noise = edm_scalings(sigma, sd)
        torch.testing.assert_close(c_in**2 * (sigma**2 + sd**2), torch.ones_like(sigma))
        torch.testing.assert_close(edm_loss_weight(sigma, sd) * c_out**2, torch.ones_like(sigma))
        torch.testing.assert_close(c_noise, torch.log(sigma) / 4)
        # sd^2/(sigma^2+sd^2) + sigma^2/(sigma^2+sd^2) = 1: skip and network shares add up.
        torch.testing.assert_close(c_skip + (c_out / sd) ** 2, torch.ones_like(sigma))
        assert (
            abs(c_skip[0].item() - 1) < 1e-6 and c_out[0].item() < 1e-3 * sd
        )  # sigma -> 0: D -> x
        assert (
            c_skip[-1].item() < 1e-6 and abs(c_out[-1].item() - sd) < 1e-6
        )  # sigma -> inf: D -> F
    with pytest.raises(ValueError, match="sigma_data"):
        edm_scalings(sigma, 0.0)


def test_edm_network_target_has_unit_variance():
    """EDM's point: input c_in x and the raw-network target (x0 - c_skip x)/c_out both have unit variance."""
    n = 200_000
    g = gen(0)
    for sigma in (0.01, 0.5, 5.0, 80.0):
        x0 = S_DATA * torch.randn(n, generator=g, dtype=F64)
        x = x0 + sigma * torch.randn(n, generator=g, dtype=F64)
        c_skip, c_out, c_in, _ = edm_scalings(torch.tensor(sigma, dtype=F64), S_DATA)
        for v in ((c_in * x).var(), ((x0 - c_skip * x) / c_out).var()):
            assert abs(v.item() - 1) < var_tolerance(n)


def test_sample_sigma_is_log_normal():
    cfg = EDMConfig(p_mean=-1.2, p_std=1.2)
    n = 100_000
    log_s = torch.log(sample_sigma((n,), cfg, generator=gen(1), dtype=F64))
    se = cfg.p_std / math.sqrt(n)
    assert abs(log_s.mean().item() - cfg.p_mean) < 5 * se
    assert abs(log_s.std().item() / cfg.p_std - 1) < var_tolerance(n) / 2
    torch.testing.assert_close(
        sample_sigma((4,), cfg, generator=gen(2)), sample_sigma((4,), cfg, generator=gen(2))
    )
    with pytest.raises(ValueError, match=r"sigma_max \(0.001\) must be > sigma_min"):
        EDMConfig(sigma_max=0.001)


class RecordingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x_in, c_noise, cond):
        self.calls.append((x_in.clone(), c_noise.clone(), cond))
        return torch.tanh(x_in) + c_noise.reshape(
            c_noise.shape + (1,) * (x_in.dim() - c_noise.dim())
        )


def test_precond_composes_scalings():
    net = RecordingNet()
    d = EDMPrecond(net, sigma_data=S_DATA)
    x = torch.randn(3, 5, 4, generator=gen(3), dtype=F64)
    sigma = torch.tensor([0.1, 1.0, 30.0], dtype=F64)
    out = d(x, sigma, "caption")
    c_skip, c_out, c_in, c_noise = (c.reshape(3, 1, 1) for c in edm_scalings(sigma, S_DATA))
    expected = c_skip * x + c_out * (torch.tanh(c_in * x) + c_noise)
    torch.testing.assert_close(out, expected)
    x_in, cn, cond = net.calls[-1]
    assert cn.shape == (3,) and cond == "caption"
    d(x, 2.0)  # a scalar sigma reaches the net as one per sample
    assert net.calls[-1][1].shape == (3,)
    d(x, torch.full((3, 5), 2.0, dtype=F64))  # per-token sigma
    assert net.calls[-1][1].shape == (3, 5)
    with pytest.raises(ValueError, match="sigma shape"):
        d(x, torch.ones(4, dtype=F64))


def test_edm_loss_of_optimal_denoiser_is_one():
    """With lambda = 1/c_out^2 the optimal Gaussian denoiser has expected loss exactly 1 at every sigma."""
    b, s, dim = 4, 512, 16
    g = gen(4)
    x0 = S_DATA * torch.randn(b, s, dim, generator=g, dtype=F64)
    sigma = torch.tensor([0.01, 0.3, 3.0, 60.0], dtype=F64)
    for i in range(b):
        loss = edm_loss(
            gaussian_denoiser(),
            x0[i : i + 1],
            sigma=sigma[i : i + 1],
            generator=g,
            num_loss_tokens=s,
        )
        n = s * dim  # chi-square-like: relative std sqrt(2/n) of a mean of squared Gaussians
        assert abs(loss.item() - 1) < var_tolerance(n)
    # A worse denoiser has a larger loss.
    worse = lambda x, sg, c: 0.8 * gaussian_denoiser()(x, sg, c)  # noqa: E731
    assert (
        edm_loss(worse, x0, sigma=sigma, generator=gen(5), num_loss_tokens=b * s)
        > edm_loss(gaussian_denoiser(), x0, sigma=sigma, generator=gen(5), num_loss_tokens=b * s)
        + 0.01
    )


def test_edm_loss_mask_and_global_normaliser_match_unsharded():
    """Two sequence shards, each normalised by the GLOBAL loss-token count, sum to the unsharded loss."""
    b, s, dim = 2, 12, 3
    g = gen(6)
    x0 = torch.randn(b, s, dim, generator=g, dtype=F64)
    noise = torch.randn(b, s, dim, generator=g, dtype=F64)
    sigma = sample_sigma((b, s), generator=g, dtype=F64)  # per-token sigma, as teacher forcing uses
    mask = torch.rand(b, s, generator=g) < 0.6
    d = gaussian_denoiser(0.7)
    full = edm_loss(
        d, x0, sigma=sigma, noise=noise, loss_mask=mask, num_loss_tokens=int(mask.sum())
    )
    # Oracle written out: mean over tokens of lambda * mean_d (D - x0)^2.
    xs = x0 + sigma[..., None] * noise
    per_tok = (edm_loss_weight(sigma)[..., None] * (d(xs, sigma, None) - x0) ** 2).mean(-1)
    torch.testing.assert_close(full, per_tok[mask].mean())
    n_global = int(mask.sum())
    halves = [
        edm_loss(
            d,
            x0[:, sl],
            sigma=sigma[:, sl],
            noise=noise[:, sl],
            loss_mask=mask[:, sl],
            num_loss_tokens=n_global,
        )
        for sl in (slice(0, 5), slice(5, s))
    ]
    torch.testing.assert_close(sum(halves), full)
    # Injected draws make the loss deterministic; generator draws reproduce with the same seed.
    a = edm_loss(d, x0, generator=gen(7), num_loss_tokens=b * s)
    assert a == edm_loss(d, x0, generator=gen(7), num_loss_tokens=b * s)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        edm_loss(d, x0, generator=gen(7), num_loss_tokens=b * s - 1)
    with pytest.raises(ValueError, match="loss_mask shape"):
        edm_loss(d, x0, loss_mask=mask[:, :5], generator=gen(7), num_loss_tokens=5)


# ------------------------------------------------------------------------------------------ samplers


SIGMA_MAX = 80.0


def exact_edm_ode(noise, s=S_DATA):
    """Exact probability-flow ODE for N(0, s^2) data, x(sigma) = x(sigma_max) sqrt((s^2 + sigma^2) /
    (s^2 + sigma_max^2)), at sigma = 0."""
    return noise * SIGMA_MAX * s / math.sqrt(s**2 + SIGMA_MAX**2)


def wrong_heun(denoise, noise, num_steps):
    """The bug this project avoids: Heun's second slope evaluated at (x_cur, t_next)."""
    sig = karras_sigmas(num_steps, sigma_max=SIGMA_MAX).tolist()
    x, b = noise * sig[0], noise.shape[0]
    for t, tn in zip(sig[:-1], sig[1:]):
        d = (x - denoise(x, torch.full((b,), t, dtype=x.dtype), None)) / t
        x_next = x + (tn - t) * d
        if tn > 0:
            d2 = (x - denoise(x, torch.full((b,), tn, dtype=x.dtype), None)) / tn
            x_next = x + (tn - t) * 0.5 * (d + d2)
        x = x_next
    return x


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def edm_noise():
    return torch.randn(8, 4096, generator=gen(8), dtype=F64)


def test_karras_schedule():
    sig = karras_sigmas(18, 0.002, 80.0, 7.0)
    assert sig.shape == (19,)
    assert sig[0].item() == pytest.approx(80.0) and sig[-2].item() == pytest.approx(0.002)
    assert sig[-1].item() == 0 and bool((sig[1:] < sig[:-1]).all())
    with pytest.raises(ValueError, match=r"num_steps \(0\) must be >= 1"):
        karras_sigmas(0)


def test_heun_matches_exact_ode_and_has_right_variance(edm_noise):
    d = gaussian_denoiser()
    exact = exact_edm_ode(edm_noise)
    heun64 = edm_heun_sampler(d, edm_noise, num_steps=64, sigma_max=SIGMA_MAX)
    ode_err = rel_err(heun64, exact)
    assert ode_err < 5e-3
    # Variance: population value s^2 sigma_max^2/(s^2+sigma_max^2); tolerance from the sample count plus
    # the (bounded above) discretisation error, which scales every sample by at most (1 +- ode_err).
    target = S_DATA**2 * SIGMA_MAX**2 / (S_DATA**2 + SIGMA_MAX**2)
    n = edm_noise.numel()
    tol = var_tolerance(n) + 2 * ode_err + ode_err**2
    assert abs(heun64.var().item() / target - 1) < tol
    # Second order: doubling the steps divides the error by ~4 (Euler: by ~2).
    heun32 = edm_heun_sampler(d, edm_noise, num_steps=32, sigma_max=SIGMA_MAX)
    assert rel_err(heun32, exact) / ode_err > 3.0
    eul32 = edm_euler_sampler(d, edm_noise, num_steps=32, sigma_max=SIGMA_MAX)
    eul64 = edm_euler_sampler(d, edm_noise, num_steps=64, sigma_max=SIGMA_MAX)
    assert 1.5 < rel_err(eul32, exact) / rel_err(eul64, exact) < 2.5
    # Euler is clearly worse than Heun at equal steps, and the wrong Heun is detectably wrong.
    assert rel_err(eul64, exact) > 5 * ode_err
    bad = wrong_heun(d, edm_noise, 64)
    assert rel_err(bad, exact) > 20 * ode_err
    assert abs(bad.var().item() / target - 1) > tol  # the variance test above would have failed


def test_heun_calls_and_churn(edm_noise):
    calls = []

    def d(x, sigma, cond):
        calls.append(sigma)
        assert sigma.shape == (x.shape[0],) and cond == "c"
        return gaussian_denoiser()(x, sigma, cond)

    x = edm_noise[:, :2048]
    edm_heun_sampler(d, x, "c", num_steps=10, sigma_max=SIGMA_MAX)
    assert len(calls) == 2 * 10 - 1  # the last step (to sigma = 0) is a plain Euler step
    calls.clear()
    edm_euler_sampler(d, x, "c", num_steps=10, sigma_max=SIGMA_MAX)
    assert len(calls) == 10
    # Churn is random only through the injected generator, and keeps the marginal roughly right.
    kw = dict(num_steps=64, sigma_max=SIGMA_MAX, churn=20.0)
    a = edm_heun_sampler(gaussian_denoiser(), edm_noise, generator=gen(9), **kw)
    assert torch.equal(a, edm_heun_sampler(gaussian_denoiser(), edm_noise, generator=gen(9), **kw))
    assert not torch.equal(
        a, edm_heun_sampler(gaussian_denoiser(), edm_noise, generator=gen(10), **kw)
    )
    target = S_DATA**2 * SIGMA_MAX**2 / (S_DATA**2 + SIGMA_MAX**2)
    assert abs(a.var().item() / target - 1) < 0.05


def test_sampler_runs_on_shards_unchanged(edm_noise):
    """Context-parallel sampling: elementwise sampler + shard-local model == the unsharded run."""
    d = gaussian_denoiser()
    full = edm_heun_sampler(d, edm_noise, num_steps=12, sigma_max=SIGMA_MAX)
    shards = [
        edm_heun_sampler(d, part, num_steps=12, sigma_max=SIGMA_MAX)
        for part in edm_noise.chunk(4, dim=1)
    ]
    torch.testing.assert_close(torch.cat(shards, dim=1), full, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ flow matching


def test_flow_matching_identities():
    g = gen(11)
    x0, eps = (
        torch.randn(3, 7, 2, generator=g, dtype=F64),
        torch.randn(3, 7, 2, generator=g, dtype=F64),
    )
    zeros, ones = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    torch.testing.assert_close(fm_interpolate(x0, eps, zeros), x0)
    torch.testing.assert_close(fm_interpolate(x0, eps, ones), eps)
    t1, t2 = torch.full((3,), 0.2, dtype=F64), torch.full((3,), 0.7, dtype=F64)
    # x_t is linear in t with slope = the velocity target.
    torch.testing.assert_close(
        fm_interpolate(x0, eps, t2) - fm_interpolate(x0, eps, t1), 0.5 * fm_target(x0, eps)
    )
    t = torch.rand(3, 7, generator=g, dtype=F64)  # per-token t
    torch.testing.assert_close(
        fm_interpolate(x0, eps, t), (1 - t[..., None]) * x0 + t[..., None] * eps
    )


def test_timestep_sampling():
    n = 100_000
    u = sample_timesteps((n,), distribution="uniform", generator=gen(12), dtype=F64)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    ln = sample_timesteps(
        (n,), distribution="logit_normal", mean=0.3, std=0.8, generator=gen(13), dtype=F64
    )
    logit = torch.log(ln / (1 - ln))
    assert abs(logit.mean().item() - 0.3) < 5 * 0.8 / math.sqrt(n)
    assert abs(logit.std().item() / 0.8 - 1) < var_tolerance(n) / 2
    grid = torch.linspace(0, 1, 11, dtype=F64)
    sh = shift_timesteps(grid, 3.0)
    assert sh[0] == 0 and sh[-1] == 1 and bool((sh[1:-1] > grid[1:-1]).all())
    torch.testing.assert_close(shift_timesteps(shift_timesteps(grid, 3.0), 1 / 3.0), grid)
    with pytest.raises(ValueError, match="distribution"):
        sample_timesteps((2,), distribution="beta")
    with pytest.raises(ValueError, match=r"shift \(0.0\) must be > 0"):
        shift_timesteps(grid, 0.0)


def test_flow_matching_analytic_velocity():
    """For N(0, s^2) data the loss minimiser is the analytic velocity: its residual is orthogonal to
    x_t, scaled versions of it have larger loss, and integrating it maps N(0,1) to N(0, s^2)."""
    n = 100_000
    g = gen(14)
    x0 = S_DATA * torch.randn(n, 1, generator=g, dtype=F64)
    eps = torch.randn(n, 1, generator=g, dtype=F64)
    v = gaussian_velocity()
    for tv in (0.1, 0.5, 0.9):
        t = torch.full((n,), tv, dtype=F64)
        xt = fm_interpolate(x0, eps, t)
        resid = fm_target(x0, eps) - v(xt, t, None)
        corr = (resid * xt).mean() / (resid.std() * xt.std())
        assert abs(corr.item()) < 5 / math.sqrt(n)
        best = fm_loss(v, x0, t=t, noise=eps, num_loss_tokens=n)
        for scale in (0.9, 1.1):
            worse = fm_loss(
                lambda x, tt, c: scale * v(x, tt, c), x0, t=t, noise=eps, num_loss_tokens=n
            )
            assert worse > best
    # The flow ODE's exact solution is x(0) = s * x(1); Euler converges to it at first order.
    noise = torch.randn(4, 4096, generator=gen(15), dtype=F64)
    errs = [
        rel_err(flow_euler_sampler(v, noise, num_steps=k), S_DATA * noise) for k in (16, 32, 64)
    ]
    assert errs[2] < 0.03 and 1.6 < errs[0] / errs[1] < 2.4 and 1.6 < errs[1] / errs[2] < 2.4


def test_flow_matching_block_timesteps_and_sharded_loss():
    b, s, dim, blocks = 2, 12, 3, 3
    g = gen(16)
    block_t = sample_timesteps((b, blocks), generator=g, dtype=F64)
    block_index = torch.arange(s) // (s // blocks)
    t = expand_block_timesteps(block_t, block_index)
    assert t.shape == (b, s)
    torch.testing.assert_close(t, block_t.repeat_interleave(s // blocks, dim=1))
    with pytest.raises(ValueError, match="block_index values"):
        expand_block_timesteps(block_t, block_index + 1)
    x0, eps = (
        torch.randn(b, s, dim, generator=g, dtype=F64),
        torch.randn(b, s, dim, generator=g, dtype=F64),
    )
    mask = torch.rand(b, s, generator=g) < 0.5
    v = lambda x, tt, c: 0.3 * x  # noqa: E731 - any model; the oracle is the formula
    full = fm_loss(v, x0, t=t, noise=eps, loss_mask=mask, num_loss_tokens=int(mask.sum()))
    xt = (1 - t[..., None]) * x0 + t[..., None] * eps
    torch.testing.assert_close(full, ((0.3 * xt - (eps - x0)) ** 2).mean(-1)[mask].mean())
    halves = [
        fm_loss(
            v,
            x0[:, sl],
            t=t[:, sl],
            noise=eps[:, sl],
            loss_mask=mask[:, sl],
            num_loss_tokens=int(mask.sum()),
        )
        for sl in (slice(0, 4), slice(4, s))
    ]
    torch.testing.assert_close(sum(halves), full)


# ---------------------------------------------------------------------------------------------- CFG


class CountingModel:
    """Conditional toy model: out = x * (1 + mean of the valid caption embedding) + sigma; counts calls."""

    def __init__(self):
        self.batches = []

    def __call__(self, x, sigma, cond):
        emb, mask = cond
        self.batches.append(x.shape[0])
        m = mask[..., None].to(emb.dtype)
        c = (emb * m).sum((1, 2)) / m.sum((1, 2))
        return x * (1 + c.reshape(-1, 1, 1)) + expand_like(sigma, x, "sigma")


def test_cfg_batched_and_scale_one_is_conditional():
    g = gen(17)
    b, L, d = 3, 5, 4
    x = torch.randn(b, 6, 2, generator=g, dtype=F64)
    sigma = torch.rand(b, generator=g, dtype=F64) + 0.1
    cond = (torch.randn(b, L, d, generator=g, dtype=F64), torch.rand(b, L, generator=g) < 0.7)
    cond[1][:, 0] = True
    null = (torch.randn(1, L, d, generator=g, dtype=F64), torch.ones(1, L, dtype=torch.bool))
    model = CountingModel()
    c_out = model(x, sigma, cond)
    u_out = model(x, sigma, (null[0].expand(b, -1, -1), null[1].expand(b, -1)))
    model.batches.clear()
    assert torch.equal(guided_denoise(model, x, sigma, cond, null, 1.0), c_out)
    assert model.batches == [2 * b]  # one call, conditional and unconditional batched
    for w in (0.0, 3.0, 7.5):
        torch.testing.assert_close(
            guided_denoise(model, x, sigma, cond, null, w), u_out + w * (c_out - u_out)
        )
    # Through a sampler: one batched model call per denoiser evaluation.
    model.batches.clear()
    edm_heun_sampler(classifier_free_guidance(model, null, 4.0), x, cond, num_steps=5)
    assert model.batches == [2 * b] * (2 * 5 - 1)
    with pytest.raises(ValueError, match="null_cond has 1 tensors"):
        guided_denoise(model, x, sigma, cond, null[0], 2.0)


def test_condition_dropout_rate_and_replacement():
    n, L, d = 20_000, 3, 2
    emb = torch.randn(n, L, d, generator=gen(18))
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[:, -1] = False
    null = (torch.full((L, d), 9.0), torch.ones(L, dtype=torch.bool))
    for p in (0.0, 0.1, 0.5, 1.0):
        (e2, m2), drop = drop_condition((emb, mask), null, p, generator=gen(19))
        rate = drop.float().mean().item()
        assert abs(rate - p) <= 5 * math.sqrt(p * (1 - p) / n)
        assert bool((e2[drop] == 9.0).all()) and bool(m2[drop].all())
        assert torch.equal(e2[~drop], emb[~drop]) and torch.equal(m2[~drop], mask[~drop])
    # Injected decisions (same on every model-parallel rank) and same-seed reproducibility.
    forced = torch.zeros(n, dtype=torch.bool)
    forced[:3] = True
    out, drop = drop_condition(emb, null[0], 0.5, drop=forced)
    assert (
        torch.equal(drop, forced) and bool((out[:3] == 9).all()) and torch.equal(out[3:], emb[3:])
    )
    assert torch.equal(
        drop_condition(emb, null[0], 0.3, generator=gen(20))[1],
        drop_condition(emb, null[0], 0.3, generator=gen(20))[1],
    )
    with pytest.raises(ValueError, match=r"p \(1.5\) must be in \[0, 1\]"):
        drop_condition(emb, null[0], 1.5)
