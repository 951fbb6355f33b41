"""The one VAE halo-window rule (layouts.vae_halo) for arbitrary latent ranges, and its use by
ops.halo: windows_for_bounds / window_tensors feed halo_scatter and halo_gather directly."""

import pytest
import torch

from megatron_video.layouts.vae_halo import (
    halo_window,
    halo_windows,
    num_raw_frames,
    window_tensors,
    windows_for_bounds,
)
from megatron_video.ops import halo_gather, halo_scatter

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only


@pytest.mark.parametrize("stride", [1, 2, 4, 8])
@pytest.mark.parametrize("first", [True, False])
def test_ragged_bounds_by_hand(stride, first):
    """Hand-written rule, any stride: hs = max(0, ls - h); first-frame case window
    [0 | st(hs-1), 1 + st(le-1)), drop = (hs > 0) + ls - hs; else [st*hs, st*le), drop = ls - hs."""
    bounds, h = [(0, 3), (3, 4), (4, 9), (9, 11)], 2
    for p, (w, (ls, le)) in enumerate(zip(windows_for_bounds(bounds, h, stride, first), bounds)):
        hs = max(0, ls - h)
        if first:
            start = 0 if hs == 0 else stride * (hs - 1)
            assert w.window == (start, 1 + stride * (le - 1)) and w.drop == int(hs > 0) + ls - hs
        else:
            assert w.window == (stride * hs, stride * le) and w.drop == ls - hs
        assert w.rank == p and w.kept == (ls, le)
        assert w == halo_window(ls, le, h, stride, first, rank=p)


def test_even_partition_is_the_bounds_case():
    for F, P, h, st in [(8, 4, 2, 4), (12, 3, 1, 2), (6, 1, 0, 4)]:
        n = F // P
        assert halo_windows(F, P, h, temporal_stride=st) == windows_for_bounds(
            [(r * n, (r + 1) * n) for r in range(P)], h, st
        )


def test_window_tensors_and_ops_roundtrip():
    """Clips packed back to back: each clip's ranges count from its own start; the windows of each
    clip, cut with ops.halo_scatter and encoded by an exact per-latent 'encoder', gather back."""
    st = 2
    clips = {0: [(0, 2), (2, 5)], 1: [(0, 1), (1, 3), (3, 4)]}  # ragged, per clip
    for bounds in clips.values():
        F = bounds[-1][1]
        metas = windows_for_bounds(bounds, 1, st)
        raw, drop = window_tensors(metas)
        assert raw.dtype == drop.dtype == torch.int64 and raw.shape == (len(bounds), 2)
        video = torch.arange(num_raw_frames(F, st), dtype=torch.float64).view(1, 1, -1, 1, 1)
        packed = halo_scatter(video, raw)
        # latent k of a window = its raw frame st*k (the causal first-frame rule's last frame)
        latents = [packed.window(p)[:, :, ::st] for p in range(len(metas))]
        assert [t.shape[2] for t in latents] == [m.num_window_latents for m in metas]
        got = halo_gather(latents, drop)
        assert torch.equal(got.flatten(), st * torch.arange(F, dtype=torch.float64))


def test_empty_and_bad_bounds():
    raw, drop = window_tensors([])
    assert raw.shape == (0, 2) and drop.shape == (0,)
    with pytest.raises(ValueError, match=r"latent_bounds\[1\] \(\(3, 3\)\) must be integers"):
        windows_for_bounds([(0, 3), (3, 3)], 1)
    with pytest.raises(ValueError, match=r"latent_bounds\[0\] \(\(0.0, 2\)\)"):
        windows_for_bounds([(0.0, 2)], 1)
    with pytest.raises(ValueError, match=r"halo_latents \(-1\) must be a non-negative integer"):
        windows_for_bounds([(0, 2)], -1)
    with pytest.raises(ValueError, match=r"halo_latents \(None\) must be a non-negative integer"):
        windows_for_bounds([(0, 2)], None)
