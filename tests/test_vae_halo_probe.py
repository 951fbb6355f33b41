"""Halos derived from an encoder's behaviour (models.vae_halo_probe.probe_halo): diffusers' Wan VAE at a
tiny random config, undeclared copies of the project's encoder, callables, the cache, bad encoders."""

import copy

import pytest
import torch
from torch import nn

from megatron_video.data.video_windows import encode_rank_latents, encode_with_halo
from megatron_video.layouts.vae_halo import (
    halo_for_lookback,
    halo_windows,
    num_raw_frames,
    temporal_lookback,
)
from megatron_video.models import vae_halo_probe
from megatron_video.models.vae import CausalVideoEncoder
from megatron_video.models.vae_halo_probe import (
    encoder_halo,
    encoder_temporal_ops,
    probe_halo,
    temporal_receptive_field,
)

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

HW = 8  # spatial size of the probe and the clips (the Wan VAE downsamples 8x: 1x1 latents)


@pytest.fixture(scope="module")
def wan():
    diffusers = pytest.importorskip("diffusers")  # a requirement: present in both test envs
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    return vae.eval()


def _clip(F, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, num_raw_frames(F), HW, HW, generator=g, dtype=torch.float64)


def _max_err(encode, x, F, P, h):
    full = encode(x)
    err = 0.0
    for w in halo_windows(F, P, h):
        out = encode(w.slice_raw(x))[:, :, w.drop :]
        err = max(err, (out - full[:, :, w.latent_start : w.latent_end]).abs().max().item())
    return err


def test_wan_vae_halo_exact_and_smallest(wan):
    """The Wan 2.1 VAE architecture declares nothing; the probed halo makes every rank's windowed
    encoding equal the full-video encoding in float64, and one latent less does not."""
    assert wan.dtype == torch.float32
    encode = lambda x: wan.encode(x).latent_dist.mean  # noqa: E731 (the callable form users write)
    vae_halo_probe._HALO_CACHE.clear()
    probe = probe_halo(encode, spatial=(HW, HW))
    h = probe.halo
    assert wan.dtype == torch.float32  # the probe restored the weights' dtype
    assert probe.verified_from == h  # the gradient look-back alone was exact
    assert h == halo_for_lookback(probe.lookback, 4)
    assert encoder_halo(encode, spatial=(HW, HW)) == h
    F = 48  # windows of ranks >= 1 start after frame 0
    x = _clip(F, 1)
    wan.double()
    try:
        with torch.no_grad():
            full = encode(x)
            for P in (2, 4):
                ws = halo_windows(F, P, h)
                assert any(w.raw_start > 0 for w in ws)
                for w in ws:
                    got = encode_with_halo(encode, w.slice_raw(x), w)
                    assert torch.allclose(
                        got, full[:, :, w.latent_start : w.latent_end], rtol=0, atol=1e-10
                    )
                got = encode_rank_latents(encode, [ws[-1].slice_raw(x)], [ws[-1]])
                assert torch.allclose(got, full[:, :, ws[-1].latent_start :], rtol=0, atol=1e-10)
            assert _max_err(encode, x, F, 2, h - 1) > 1e-10  # smallest: one less is inexact
            with pytest.raises(
                ValueError,
                match=rf"halo_latents \({h - 1}\) must be >= the encoder's "
                rf"temporal receptive field \({h} latents\)",
            ):
                w = halo_windows(F, 2, h - 1)[1]
                encode_with_halo(encode, w.slice_raw(x), w)
    finally:
        wan.float()


def _undeclared(encoder):
    enc = copy.deepcopy(encoder)
    for m in enc.modules():
        if "causal_time_op" in vars(m):
            del m.causal_time_op
    return enc


def test_probe_matches_declared_receptive_field():
    """With the declarations stripped, the probe finds the look-back the declared ops give."""
    torch.manual_seed(0)
    enc = CausalVideoEncoder(3, 4, 8)
    L, st = temporal_lookback(encoder_temporal_ops(enc))
    bare = _undeclared(enc)
    with pytest.raises(ValueError, match="not a declared causal temporal op"):
        temporal_receptive_field(bare)
    p = probe_halo(bare)
    assert (p.lookback, p.halo) == (L, temporal_receptive_field(enc)) == (9, 2)
    assert next(bare.parameters()).dtype == torch.float32 and bare.training
    assert encoder_halo(bare) == 2
    x = torch.randn(1, 3, num_raw_frames(12), 16, 16, dtype=torch.float64)
    with torch.no_grad():
        assert _max_err(bare.double(), x, 12, 4, 2) <= 1e-10


def test_probe_of_a_no_grad_encoder_equals_the_gradient_probe(wan):
    """An encoder given as a ``torch.no_grad()``-wrapped callable (the inference idiom) has no
    gradient to probe; the probe perturbs raw frames instead and finds the same halo, for the
    project's encoder and for diffusers' Wan VAE."""
    torch.manual_seed(0)
    bare = _undeclared(CausalVideoEncoder(3, 4, 8))
    plain = probe_halo(bare)
    wrapped = probe_halo(torch.no_grad()(lambda x: bare(x)), in_channels=3)
    assert (wrapped.halo, wrapped.lookback) == (plain.halo, plain.lookback) == (2, 9)

    def encode(x):
        return wan.encode(x).latent_dist.mean

    ref = probe_halo(encode, in_channels=3, spatial=(HW, HW))
    got = probe_halo(torch.no_grad()(encode), in_channels=3, spatial=(HW, HW))
    assert (got.halo, got.lookback) == (ref.halo, ref.lookback)


def test_probe_cached_per_configuration_and_declared_fast_path(monkeypatch):
    calls = []
    real = vae_halo_probe.probe_halo

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(vae_halo_probe, "probe_halo", counting)
    monkeypatch.setattr(vae_halo_probe, "_HALO_CACHE", {})
    torch.manual_seed(0)
    a, b = _undeclared(CausalVideoEncoder(3, 4, 8)), _undeclared(CausalVideoEncoder(3, 4, 8))
    assert encoder_halo(a) == encoder_halo(b) == encoder_halo(lambda x: a(x)) == 2
    assert len(calls) == 2  # module config once, the callable once
    assert encoder_halo(CausalVideoEncoder(3, 4, 8)) == 2 and len(calls) == 2  # declared: no probe
    assert encoder_halo(_undeclared(CausalVideoEncoder(3, 4, 16))) == 2 and len(calls) == 3


def test_probe_rejects_bad_encoders():
    sym = nn.Conv3d(3, 4, 3, padding=1)  # sees the future
    with pytest.raises(ValueError, match="not causal in time"):
        probe_halo(lambda x: sym(x)[:, :, ::4], causal_first_frame=True)
    with pytest.raises(ValueError, match="not causal in time"):  # the no-grad (bisection) probe
        probe_halo(torch.no_grad()(lambda x: sym(x)[:, :, ::4]), in_channels=3)
    with pytest.raises(ValueError, match=r"produced 29 latents for 29 raw frames"):
        probe_halo(nn.Conv3d(3, 4, 1))
    with pytest.raises(ValueError, match=r"num_latents \(2\) must be >= 3"):
        probe_halo(nn.Conv3d(3, 4, 1), num_latents=2)
    with pytest.raises(ValueError, match="must be an nn.Module or a callable"):
        encoder_halo(42)
