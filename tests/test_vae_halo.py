"""VAE halo windows, the small causal video VAE, and raw-frame windows to ranks."""

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn

from megatron_video.data.video_windows import (
    TensorFrameSource,
    encode_rank_latents,
    encode_with_halo,
    rank_windows,
    read_window,
    scatter_windows,
)
from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.layouts.vae_halo import (
    halo_window,
    halo_windows,
    num_raw_frames,
    temporal_lookback,
)
from megatron_video.models.vae import CausalConv3d, CausalVideoVAE
from megatron_video.models.vae_halo_probe import (
    encoder_temporal_ops,
    resolve_halo,
    temporal_receptive_field,
)


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return CausalVideoVAE(in_channels=3, latent_channels=4, base_channels=8).double()


def video(F, seed=0, hw=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, num_raw_frames(F), hw, hw, generator=g, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# pure window maps
# ---------------------------------------------------------------------------------------------
def test_halo_windows_rule_by_hand():
    # F=8, P=4, h=2: rank r keeps [2r, 2r+2)
    w = halo_windows(8, 4, 2)
    assert [(x.raw_start, x.raw_end, x.pseudo, x.drop) for x in w] == [
        (0, 5, 0, 0),  # ls=0: [0, 1+4*1)
        (0, 13, 0, 2),  # ls=2, halo_start=0: [0, 1+4*3), drop 2
        (4, 21, 1, 3),  # ls=4, halo_start=2: [4*(2-1), 1+4*5), drop 1+2
        (12, 29, 1, 3),  # ls=6, halo_start=4: [4*3, 1+4*7)
    ]
    w = halo_windows(8, 2, 0)  # no halo: the window still carries the throw-away first frame
    assert [(x.raw_start, x.raw_end, x.drop) for x in w] == [(0, 13, 0), (12, 29, 1)]
    w = halo_windows(8, 2, 1, causal_first_frame=False)
    assert [(x.raw_start, x.raw_end, x.drop) for x in w] == [(0, 16, 0), (12, 32, 1)]


@pytest.mark.parametrize("first", [True, False])
def test_halo_windows_partition_and_lengths(first):
    for F in (4, 8, 12, 16, 24):
        for P in (1, 2, 4):
            if F % P:
                continue
            for h in range(0, 6):
                ws = halo_windows(F, P, h, causal_first_frame=first)
                kept = [f for w in ws for f in range(w.latent_start, w.latent_end)]
                assert kept == list(range(F))  # kept ranges partition [0, F)
                for w in ws:
                    assert w.halo_start == max(0, w.latent_start - h)
                    assert (
                        0 <= w.raw_start < w.raw_end <= num_raw_frames(F, causal_first_frame=first)
                    )
                    # the window encodes to exactly drop + kept latents under the temporal rule
                    lat = (w.num_raw - 1) // 4 + 1 if first else w.num_raw // 4
                    assert lat == w.num_window_latents
                    if first:
                        assert (w.num_raw - 1) % 4 == 0


def test_halo_window_validation():
    with pytest.raises(
        ValueError, match=r"num_latent_frames \(10\) must be divisible by sp_size \(4\)"
    ):
        halo_windows(10, 4, 2)
    with pytest.raises(ValueError, match=r"halo_latents \(-1\) must be a non-negative integer"):
        halo_windows(8, 4, -1)
    with pytest.raises(
        ValueError, match=r"latent_end \(3\) must be an integer > latent_start \(3\)"
    ):
        halo_window(3, 3, 1)


# ---------------------------------------------------------------------------------------------
# receptive field derived from the encoder
# ---------------------------------------------------------------------------------------------
def test_default_halo_comes_from_the_encoder(vae):
    assert resolve_halo(None, vae.encoder) == 2 and resolve_halo(3, vae.encoder) == 3
    assert resolve_halo(1, None) == 1
    with pytest.raises(
        ValueError,
        match=r"halo_latents \(1\) must be >= the encoder's temporal receptive "
        r"field \(2 latents\)",
    ):
        resolve_halo(1, vae.encoder)
    with pytest.raises(ValueError, match=r"halo_latents \(None\) needs an encoder"):
        resolve_halo(None, None)
    with pytest.raises(ValueError, match=r"halo_latents \(None\) must be a non-negative integer"):
        halo_windows(8, 4, None)  # the index maps take a halo, never an encoder
    lay = BalancedSPLayout(16, 1, 2, 4, ring_size=2)
    assert rank_windows(lay, 1, encoder=vae.encoder) == rank_windows(lay, 1, 2)


def test_receptive_field_from_the_conv_stack(vae):
    ops = encoder_temporal_ops(vae.encoder)
    # conv_in k3 | down1 k2 s2 | res k3 | down2 k2 s2 | down3 k1 | conv_out k1
    assert ops == [(3, 1, 2), (2, 2, 1), (3, 1, 2), (2, 2, 1), (1, 1, 0), (1, 1, 0)]
    assert temporal_lookback(ops) == (2 + 1 + 2 * 2 + 1 * 2, 4)
    assert temporal_receptive_field(vae.encoder) == 2  # ceil(9/4) - 1
    assert temporal_receptive_field(vae.encoder, causal_first_frame=False) == 2  # ceil((9-3)/4)
    with pytest.raises(ValueError, match=r"temporal_stride \(2\) differs from the encoder's total"):
        temporal_receptive_field(vae.encoder, temporal_stride=2)


def test_receptive_field_rejects_undeclared_temporal_convs():
    bad = nn.Sequential(CausalConv3d(3, 4), nn.Conv3d(4, 4, (3, 1, 1)))
    with pytest.raises(
        ValueError, match=r"nn.Conv3d with temporal kernel 3 / stride 1 is not a declared"
    ):
        temporal_receptive_field(bad)
    with pytest.raises(ValueError, match=r"declares no causal temporal ops"):
        temporal_receptive_field(nn.Linear(2, 2))


def _max_halo_error(encoder, x, F, P, h, first=True):
    full = encoder(x)
    err = 0.0
    for w in halo_windows(F, P, h, causal_first_frame=first):
        out = encoder(w.slice_raw(x))[:, :, w.drop :]
        assert out.shape[2] == w.num_kept
        err = max(err, (out - full[:, :, w.latent_start : w.latent_end]).abs().max().item())
    return err


@torch.no_grad()
def test_halo_exactness_float64(vae):
    h = temporal_receptive_field(vae.encoder)
    for F in (8, 12, 16):
        x = video(F, seed=F)
        full = vae.encoder(x)
        for P in (2, 4):
            for hh in (h, h + 1) if F == 12 else (h,):
                for w in halo_windows(F, P, hh):
                    out = encode_with_halo(vae.encoder, w.slice_raw(x), w)
                    assert torch.allclose(
                        out, full[:, :, w.latent_start : w.latent_end], rtol=0, atol=1e-10
                    )


@torch.no_grad()
def test_derived_halo_is_tight(vae):
    """One latent less than the derived halo is measurably wrong: the value is not a guess."""
    h = temporal_receptive_field(vae.encoder)
    x = video(8, seed=1)
    assert _max_halo_error(vae.encoder, x, 8, 4, h) <= 1e-10
    assert _max_halo_error(vae.encoder, x, 8, 4, h - 1) > 1e-6


@torch.no_grad()
def test_too_small_halo_rejected(vae):
    x = video(8)
    for w in halo_windows(8, 4, 1):  # even rank 0, whose window starts at frame 0, refuses
        with pytest.raises(
            ValueError,
            match=r"halo_latents \(1\) must be >= the encoder's temporal "
            r"receptive field \(2 latents\)",
        ):
            encode_with_halo(vae.encoder, w.slice_raw(x), w)
    w = halo_windows(8, 4, 2)[2]
    with pytest.raises(ValueError, match=r"window has 16 frames along dim 2"):
        encode_with_halo(vae.encoder, x[:, :, :16], w)


class _NoFirstFrame(nn.Module):
    """A causal encoder without the first-frame rule: latent k <- frames 4k..4k+3."""

    def __init__(self, encoder):
        super().__init__()
        self.inner = encoder

    def forward(self, x):
        return self.inner(Fn.pad(x, (0, 0, 0, 0, 1, 0)))[:, :, 1:]


@torch.no_grad()
def test_halo_exactness_without_first_frame_rule(vae):
    enc = _NoFirstFrame(vae.encoder)
    h = temporal_receptive_field(enc, causal_first_frame=False)
    F = 12
    x = torch.randn(
        1, 3, 4 * F, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    for P in (2, 4):
        assert _max_halo_error(enc, x, F, P, h, first=False) <= 1e-10
    assert _max_halo_error(enc, x, F, 4, h - 1, first=False) > 1e-6


@torch.no_grad()
def test_ring_balanced_rank_latents(vae):
    """Ranks with two segments (ring balancing) encode each with its halo: exactly their frames."""
    F = 16
    lay = BalancedSPLayout(F, 4, 2, 4, ring_size=2)  # P=4, U=2, R=2
    x = video(F, seed=5)
    full = vae.encoder(x)
    lay3 = BalancedSPLayout(24, 1, 1, 6, ring_size=2)  # U=3: a rank straddles two chunks
    x3 = video(24, seed=6)
    full3 = vae.encoder(x3)
    for layout, xx, ff in ((lay, x, full), (lay3, x3, full3)):
        for r in range(layout.sp_size):
            metas = rank_windows(layout, r, encoder=vae.encoder)
            src = TensorFrameSource(xx)
            wins = [read_window(src, m) for m in metas]
            got = encode_rank_latents(vae.encoder, wins, metas)
            assert torch.allclose(got, ff[:, :, layout.rank_frames(r)], rtol=0, atol=1e-10)
            assert src.reads == [(m.raw_start, m.raw_end) for m in metas]  # only its windows
    assert max(len(lay3.rank_segments(r)) for r in range(6)) == 2


# ---------------------------------------------------------------------------------------------
# the VAE itself
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_vae_shapes_and_causality(vae):
    F = 4
    x = video(F, seed=2)
    z = vae.encode(x)
    assert z.shape == (1, 4, F, 2, 2)
    assert vae.decode(z).shape == x.shape
    # perturb raw frame 5 (latent 2 <- frames 5..8): latents 0, 1 unchanged, latent 2 changed
    y = x.clone()
    y[:, :, 5] += 1.0
    dz = (vae.encode(y) - z).abs().amax(dim=(0, 1, 3, 4))
    assert dz[:2].max() == 0 and dz[2] > 0
    # decoder is causal too: latent 1 -> frames 1..4
    z2 = z.clone()
    z2[:, :, 1] += 1.0
    dx = (vae.decode(z2) - vae.decode(z)).abs().amax(dim=(0, 1, 3, 4))
    assert dx[:1].max() == 0 and dx[1:5].min() > 0
    s = vae.encode(x, sample=True, generator=torch.Generator().manual_seed(0))
    assert s.shape == z.shape and not torch.equal(s, z)


def test_vae_input_validation(vae):
    with pytest.raises(ValueError, match=r"num_frames \(8\) must be 1 \+ 4\*k"):
        vae.encode(torch.zeros(1, 3, 8, 16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"frame size \(12x16\) must be divisible by 8"):
        vae.encode(torch.zeros(1, 3, 5, 12, 16, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"video shape \(\(1, 2, 5, 16, 16\)\) must be \[B, 3, T, H, W\]"
    ):
        vae.encode(torch.zeros(1, 2, 5, 16, 16, dtype=torch.float64))


def test_vae_trains():
    torch.manual_seed(0)
    m = CausalVideoVAE(3, 4, 8)
    x = torch.sin(torch.linspace(0, 6, 5 * 16 * 16)).view(1, 1, 5, 16, 16).expand(1, 3, 5, 16, 16)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    first = None
    for _ in range(15):
        loss, parts = m.loss(x, generator=g)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first and set(parts) == {"recon", "kl"}


# ---------------------------------------------------------------------------------------------
# windows to ranks over gloo
# ---------------------------------------------------------------------------------------------
def _scatter_case():
    import torch.distributed as dist

    from megatron_video.parallel import CommTracer

    me = dist.get_rank()
    F, P, h = 8, 4, 2
    full = video(F, seed=7).float()
    windows = halo_windows(F, P, h)
    with CommTracer() as t:
        mine = scatter_windows(full if me == 1 else None, windows, None, src=1)
    ok = len(mine) == 1 and torch.equal(mine[0], windows[me].slice_raw(full))
    # ring-balanced: lists of windows per rank (one segment each here, two for U=3)
    lay = BalancedSPLayout(24, 1, 1, 4, ring_size=2)
    full2 = video(24, seed=8)
    wl = [rank_windows(lay, r, h) for r in range(P)]
    got = scatter_windows(full2 if me == 0 else None, wl, None, src=0)
    ok2 = all(torch.equal(g, w.slice_raw(full2)) for g, w in zip(got, wl[me]))
    # a bad video on the loading rank raises on every rank (no hang)
    try:
        scatter_windows(full[:, :, :10] if me == 0 else None, windows, None, src=0)
        err = None
    except ValueError as e:
        err = str(e)
    return ok, ok2, t.count("scatter"), t.count("broadcast"), t.bytes("scatter"), err


def test_scatter_windows_one_collective(pool4):
    out = pool4.run(_scatter_case)
    for me, (ok, ok2, n_scatter, n_bcast, nbytes, err) in enumerate(out):
        assert ok and ok2
        assert (n_scatter, n_bcast) == (1, 1)
        # the loading rank sends 3 padded windows (max window 17 frames of 3x16x16 float32)
        assert nbytes == (3 * 17 * 3 * 16 * 16 * 4 if me == 1 else 0)
        assert err is not None and "fewer frames than the windows need (29)" in err


def test_halo_window_accessors_match_the_rule():
    from megatron_video.layouts.vae_halo import halo_windows

    # F=16, P=4, h=2: rank 1 keeps [4, 8); halo_start=2 -> window [4*(2-1), 1+4*7) = [4, 29); drop 1+2
    w = halo_windows(16, 4, 2)[1]
    assert w.kept == (4, 8) and w.window == (4, 29) and w.drop == 3 and w.num_kept == 4
