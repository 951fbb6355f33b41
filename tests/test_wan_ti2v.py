"""TI2V / I2V first-frame conditioning of ``wan`` / ``wan_ar`` (Wan 2.2's ``expand_timesteps``
convention, diffusion/ti2v.py), float64.

* ``wan`` at CP = 1: the loss equals an explicit flow-matching loss on diffusers' own
  ``WanTransformer3DModel`` with the I2V samples' first latent frame clean, timestep 0 (per-token
  timesteps ``[b, seq]``) and excluded from the loss (1e-6); the same step with the loss on the
  first frame, or with t != 0 for it, does NOT match.
* Under CP (U2xR2, TP2xCP2 for ``wan``; U2xR2 and U4 Balanced SP for ``wan_ar``, whose noisy copy
  of frame 0 is the clean latent with timestep 0) loss and gradients equal CP = 1.
* ``sample_wan(..., image=latent)`` keeps the first latent frame equal to the image's latent, equals
  diffusers' ``WanImageToVideoPipeline(expand_timesteps=True)`` denoising loop on diffusers' model
  (1e-5: its fp32 islands) and, under U2xR2, CP = 1 (1e-10).
* Bad input: ``ValueError`` naming the field, the value and the rule.
"""

import math

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import (  # noqa: E402
    save_tiny_wan_transformer,
    tiny_wan_config,
    tiny_wan_transformer,
    write_random_latent_shards,
)

I2V_P = 0.5  # with train.seed 4: step 0's two samples are one I2V, one T2V (asserted)
LAYOUTS = {  # (TP, U, R, ranks per simulated node)
    "reference": (1, 1, 1, 4),
    "u2xr2": (1, 2, 2, 2),
    "u4": (1, 4, 1, 4),
    "tp2xcp2": (2, 1, 2, 2),
}
CASES = [("wan", "u2xr2"), ("wan", "tp2xcp2"), ("wan_ar", "u2xr2"), ("wan_ar", "u4")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_ti2v")
    cfg = tiny_wan_config("wan", root, root / "shards")
    write_random_latent_shards(cfg, root / "shards")
    save_tiny_wan_transformer(root / "transformer", cfg)
    return root


def _config(family: str, root, layout: str):
    tp, U, R, rpn = LAYOUTS[layout]
    cfg = tiny_wan_config(
        family,
        root,
        root / "shards",
        tensor_model_parallel_size=tp,
        context_parallel_size=U * R,
        ulysses_size=U,
        ring_size=R,
        ranks_per_node=rpn,
    )
    cfg.model.init_from = str(root / "transformer")
    cfg.data.i2v_probability = I2V_P
    return cfg


def _float64(mb):
    for k, v in vars(mb).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            setattr(mb, k, v.double())
    return mb


def _full_grads(model, groups) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(g, groups.cp_group, tag="test.grad")
        if getattr(p, "tensor_model_parallel", False) and p.partition_dim >= 0:
            if ps.get_tensor_model_parallel_world_size() > 1:
                g = comm.all_gather_cat(
                    g, ps.get_tensor_model_parallel_group(), dim=p.partition_dim
                )
        out[name] = g
    return out


def _wrong(objective, wrong: str):
    """A deliberately wrong TI2V: the loss on the first frame too, or its timestep left at t."""
    import types

    from megatron_video.training.objectives import (
        WAN_NUM_TIMESTEPS,
        FlowObjective,
        wan_to_patchify_order,
    )

    if wrong == "loss_on_first":
        objective.loss = types.MethodType(
            lambda self, out, mb: FlowObjective.loss(
                self, wan_to_patchify_order(out, self.patch, self.channels), mb
            ),
            objective,
        )
    elif wrong == "t_nonzero":
        call = objective.model_call

        def model_call(mb, first_stage):
            (tokens, t, text, g), kw = call(mb, first_stage)
            t = (WAN_NUM_TIMESTEPS * mb.t)[:, None].expand_as(t).contiguous()
            return (tokens, t, text, g), kw

        objective.model_call = model_call


def _step(family: str, root, layout: str, wrong=None) -> dict:
    """Rank side: one float64 step of the family's pieces under ``layout``."""
    import torch.distributed as dist

    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.config import validate
    from megatron_video.training.families import get_family
    from megatron_video.training.families.wan import wan_transformer_config

    cfg = _config(family, root, layout)
    validate(cfg, dist.get_world_size())
    tp, U, R, rpn = LAYOUTS[layout]
    fam = get_family(family)
    with video_parallel(U, R, tp=tp, ranks_per_node=rpn, seed=0) as groups:
        model = fam.build_model(wan_transformer_config(cfg, params_dtype=torch.float64), config=cfg)
        sample = fam.sample_layout(cfg, groups.cp_size)
        coords = RankCoords(cp_rank=groups.cp_rank, ulysses_size=U, ring_size=R)
        batches = fam.make_batches(
            cfg, coords=coords, vae=None, latent_scale=1.0, layout=sample.layout
        )
        objective = fam.make_objective(cfg, groups, sample)
        if wrong:
            _wrong(objective, wrong)
        mb = _float64(next(batches.step_batches(0)))
        args, kwargs = objective.model_call(mb, True)
        share = objective.loss(model(*args, **kwargs), mb)
        share.backward()
        loss = share.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(loss, groups.cp_group, tag="test.loss")
        return dict(loss=float(loss), grads=_full_grads(model, groups), mb=mb, args=args[:2])


_REFERENCE = {}


def _reference(pool4, family, root) -> dict:
    if family not in _REFERENCE:
        _REFERENCE[family] = pool4.run(_step, family, root, "reference")[0]
    return _REFERENCE[family]


def _diffusers_loss(root, mb, monkeypatch, loss_on_first=False, t_first=False) -> float:
    """``mean((v - (eps - x0))^2)`` over the loss elements, ``v`` diffusers' model on ``x_t``
    with the I2V samples' frame 0 clean and (unless ``t_first``) timestep 0 there."""
    from diffusers import WanTransformer3DModel

    from megatron_video.models.embedders import unpatchify

    monkeypatch.setattr(WanTransformer3DModel, "_keep_in_fp32_modules", None)
    model = WanTransformer3DModel.from_pretrained(str(root / "transformer")).double()
    grid, patch = (4, 2, 3), (1, 2, 2)
    x0, eps = (unpatchify(v, patch, grid, 4) for v in (mb.clean, mb.noise))
    t = mb.t.view(-1, 1, 1, 1, 1)
    first = torch.zeros(x0.shape[2:], dtype=torch.bool)
    first[0] = True
    cond = mb.i2v.view(-1, 1, 1, 1, 1) & first  # [b, 1, F, H, W]
    x = torch.where(cond, x0, (1 - t) * x0 + t * eps)
    tokens_first = torch.zeros(grid, dtype=torch.bool)
    tokens_first[0] = True
    per_token = (1000 * mb.t)[:, None] * torch.ones(1, math.prod(grid), dtype=torch.float64)
    if not t_first:
        per_token = torch.where(mb.i2v[:, None] & tokens_first.flatten()[None], 0.0, per_token)
    text = mb.caption_ids * mb.caption_mask[..., None] * (~mb.drop)[:, None, None]
    with torch.no_grad():
        v = model(x, per_token, text, return_dict=False)[0]
    err = (v - (eps - x0)) ** 2
    keep = torch.ones_like(cond) if loss_on_first else ~cond
    keep = keep.expand_as(err)
    return float(err[keep].sum() / keep.sum())


def test_ti2v_loss_is_flow_matching_on_diffusers(pool4, root, monkeypatch):
    ref = _reference(pool4, "wan", root)
    mb = ref["mb"]
    assert bool(mb.i2v.any()) and not bool(mb.i2v.all()), mb.i2v  # one I2V, one T2V sample
    assert bool(mb.drop.any()) and not bool(mb.drop.all())  # one CFG-dropped
    want = _diffusers_loss(root, mb, monkeypatch)
    assert math.isclose(ref["loss"], want, rel_tol=1e-6), (ref["loss"], want)
    print(f"TI2V loss {ref['loss']!r} vs diffusers {want!r}: rel {abs(ref['loss'] / want - 1):.1e}")
    # the oracle itself tells the variants apart, by > 10x the tolerance (t = 0 vs t on the
    # first frame's tokens changes only their modulation: ~5e-5 relative on this tiny model)
    for kw in (dict(loss_on_first=True), dict(t_first=True)):
        other = _diffusers_loss(root, mb, monkeypatch, **kw)
        assert not math.isclose(other, want, rel_tol=1e-5), (kw, other, want)


@pytest.mark.parametrize("wrong", ["loss_on_first", "t_nonzero"])
def test_wrong_ti2v_fails_the_oracle(pool4, root, monkeypatch, wrong):
    got = pool4.run(_step, "wan", root, "reference", wrong)[0]
    want = _diffusers_loss(root, got["mb"], monkeypatch)
    print(f"{wrong}: rel diff to the oracle {abs(got['loss'] / want - 1):.1e}")
    assert not math.isclose(got["loss"], want, rel_tol=1e-5), (wrong, got["loss"], want)


def test_wan_ar_noisy_first_frame_is_clean_at_t0(pool4, root):
    """The reference ``wan_ar`` call: the I2V sample's noisy copy of frame 0 is its clean latent
    with timestep 0; the T2V sample's is noisy with its block's timestep."""
    ref = _reference(pool4, "wan_ar", root)
    mb, (x, t) = ref["mb"], ref["args"]
    half, S = x.shape[1] // 2, 2 * 3  # tokens per latent frame (2 x 3)
    noisy_first = slice(half, half + S)  # CP = 1: local order = frame order
    for i in range(x.shape[0]):
        if bool(mb.i2v[i]):
            assert torch.equal(x[i, noisy_first], mb.clean[i, :S])
            assert float(t[i, noisy_first].abs().max()) == 0.0
            assert float(t[i, half + S :].abs().min()) > 0.0
        else:
            assert not torch.allclose(x[i, noisy_first], mb.clean[i, :S])
            assert float(t[i, noisy_first].abs().min()) > 0.0


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_ti2v_step_matches_cp1(pool4, root, family, layout):
    ref = _reference(pool4, family, root)
    assert bool(ref["mb"].i2v.any()) and not bool(ref["mb"].i2v.all())
    per_rank = pool4.run(_step, family, root, layout, ranks_per_node=LAYOUTS[layout][3])
    for rank, got in enumerate(per_rank):
        assert abs(got["loss"] - ref["loss"]) <= 1e-12 * ref["loss"], (rank, got["loss"])
        assert torch.equal(got["mb"].i2v, ref["mb"].i2v)
        for name, g in ref["grads"].items():
            err = float((got["grads"][name] - g).abs().max()) / (float(g.abs().max()) + 1e-30)
            assert err <= 1e-9, (rank, name, err)


# ---------------------------------------------------------------------------------------------
# sampling with an image
# ---------------------------------------------------------------------------------------------
STEPS, SHIFT, GUIDANCE = 3, 3.0, 2.5


def _sample_inputs():
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(2, 4, 4, 4, 6, generator=gen, dtype=torch.float64)
    text = torch.randn(2, 7, 32, generator=gen, dtype=torch.float64)
    negative = torch.randn(1, 7, 32, generator=gen, dtype=torch.float64)
    image = torch.randn(2, 4, 1, 4, 6, generator=gen, dtype=torch.float64)  # its latent
    return noise, text, negative, image


def _sample_ours(hier=None):
    from megatron_video.generation.wan_sampling import sample_wan
    from megatron_video.models.wan import from_diffusers

    model = from_diffusers(
        tiny_wan_transformer().double(), cp_comm_type="a2a+p2p" if hier else "p2p"
    )
    noise, text, negative, image = _sample_inputs()
    with torch.no_grad():
        return sample_wan(
            model,
            noise,
            text,
            image=image,
            negative_encoder_hidden_states=negative,
            guidance_scale=GUIDANCE,
            num_steps=STEPS,
            shift=SHIFT,
        )


def _sample_rank():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    model_parallel_cuda_manual_seed(0)
    return _sample_ours([2, 2])


@pytest.fixture(scope="module")
def sampled_cp1():
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        return _sample_ours()


def test_sample_with_image_keeps_first_frame(sampled_cp1):
    _, _, _, image = _sample_inputs()
    assert torch.equal(sampled_cp1[:, :, :1], image)


def test_sample_with_image_equals_diffusers_i2v_loop(sampled_cp1):
    """diffusers' ``WanImageToVideoPipeline`` loop with ``expand_timesteps=True``: the model input
    ``(1 - mask) * condition + mask * latents``, timestep ``mask * t`` per token, Euler steps of
    the guided velocity, frame 0 replaced by the condition at the end."""
    from megatron_video.diffusion.samplers import flow_timesteps

    model = tiny_wan_transformer().double()
    noise, text, negative, image = _sample_inputs()
    mask = torch.ones(1, 1, 4, 4, 6, dtype=torch.float64)
    mask[:, :, 0] = 0
    condition = torch.cat([image, torch.zeros_like(noise[:, :, 1:])], dim=2)
    latents = noise
    ts = [float(v) for v in flow_timesteps(STEPS, SHIFT)]
    with torch.no_grad():
        for t_cur, t_next in zip(ts[:-1], ts[1:]):
            x = (1 - mask) * condition + mask * latents
            timestep = (mask[0, 0][:, ::2, ::2] * t_cur * 1000).flatten()[None].expand(2, -1)
            v = model(x, timestep, text, return_dict=False)[0]
            u = model(x, timestep, negative.expand(2, -1, -1), return_dict=False)[0]
            latents = latents + (t_next - t_cur) * (u + GUIDANCE * (v - u))
    want = (1 - mask) * condition + mask * latents
    err = ((sampled_cp1 - want).norm() / want.norm()).item()
    assert err <= 1e-5, err


def test_sample_with_image_u2xr2_equals_cp1(pool4, sampled_cp1):
    _, _, _, image = _sample_inputs()
    for rank, got in enumerate(pool4.run(_sample_rank)):
        assert torch.equal(got[:, :, :1], image), rank
        err = ((got - sampled_cp1).norm() / sampled_cp1.norm()).item()
        assert err <= 1e-10, (rank, err)


# ---------------------------------------------------------------------------------------------
# bad input and the default
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1.5, -0.1, True, "half"])
def test_bad_i2v_probability(root, value):
    from megatron_video.training.config import validate

    cfg = _config("wan", root, "reference")
    cfg.data.i2v_probability = value
    with pytest.raises(
        ValueError, match=r"data.i2v_probability \(.*\) must be a number in \[0, 1\]"
    ):
        validate(cfg, 4)


def test_i2v_needs_temporal_patch_1(root):
    from megatron_video.training.config import validate

    cfg = _config("wan", root, "reference")
    cfg.model.init_from, cfg.model.patch_size = None, [2, 2, 2]
    with pytest.raises(ValueError, match=r"model.patch_size \(\[2, 2, 2\]\) must have temporal"):
        validate(cfg, 4)


def test_other_families_refuse_i2v_probability(root):
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.config import validate

    cfg = tiny_config("ar_dit", str(root))
    cfg.data.i2v_probability = 0.5
    with pytest.raises(
        ValueError, match=r"data.i2v_probability \(0.5\) is not a field of model.family 'ar_dit'"
    ):
        validate(cfg, 1)


def test_default_i2v_probability(root):
    """null: 0.5 on Wan 2.2's 48-channel latents (TI2V-5B), 0 on others and other families."""
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.ti2v import i2v_probability_of

    cfg = tiny_wan_config("wan_ar", root, root / "shards")
    assert cfg.data.i2v_probability is None and i2v_probability_of(cfg) == 0.0
    cfg.vae.latent_channels = 48
    assert i2v_probability_of(cfg) == 0.5
    other = tiny_config("ar_dit", str(root))
    other.vae.latent_channels = 48
    assert i2v_probability_of(other) == 0.0


def test_sample_image_of_wrong_shape(root):
    from megatron_video.generation.wan_sampling import sample_wan
    from megatron_video.models.wan import from_diffusers
    from megatron_video.models.wan.convert import _one_process

    noise, text, _, image = _sample_inputs()
    with _one_process():
        model = from_diffusers(tiny_wan_transformer().double())
        with pytest.raises(ValueError, match=r"image \(\(2, 4, 4, 6\)\) must be the first frame"):
            sample_wan(model, noise, text, image=image[:, :, 0], num_steps=1)
