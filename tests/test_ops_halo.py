"""Halo scatter / gather: the C++ extension equals the references bit for bit; oracles for both."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_video.ops import (
    halo_gather,
    halo_gather_packed,
    halo_gather_reference,
    halo_scatter,
    halo_scatter_reference,
)
from megatron_video.testing.strategies import DTYPES, LAYOUTS, bits, halo_case
from megatron_video.testing.strategies import halo_windows as _halo_windows

pytestmark = [pytest.mark.one_env, pytest.mark.usefixtures("extension")]

SETTINGS = settings(max_examples=12, deadline=None, database=None)


def window_of(video, layout, s, e):
    return video[:, :, s:e] if layout == "bcthw" else video[:, s:e]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(data=st.data())
def test_scatter_matches_reference_and_windows(layout, dtype, data):
    video, windows, _, _, _ = data.draw(halo_case(layout, dtype))
    got = halo_scatter(video, windows, layout)
    ref = halo_scatter_reference(video, windows, layout)
    assert torch.equal(bits(got.buffer), bits(ref.buffer))
    assert torch.equal(got.offsets, ref.offsets) and torch.equal(got.sizes, ref.sizes)
    assert got.shapes == ref.shapes
    assert got.buffer.dtype == dtype and got.buffer.numel() == int(got.sizes.sum())
    for p, (s, e) in enumerate(windows.tolist()):  # oracle: each rank's slice is its window
        assert torch.equal(bits(got.window(p)), bits(window_of(video, layout, s, e)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(data=st.data())
def test_gather_restores_global_latents(layout, dtype, data):
    """Ranks encode [throw-away] + halo + kept latents; gathering with `drop` gives the global video."""
    _, windows, drop, bounds, halo = data.draw(halo_case(layout, dtype))
    F = bounds[-1][1]
    Cl, h, w = (
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 3)),
    )
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    tdim = 2 if layout == "bcthw" else 1
    full = torch.randn((2, Cl, F, h, w) if layout == "bcthw" else (2, F, Cl, h, w), generator=g).to(
        dtype
    )
    latents = []
    for (ls, le), d in zip(bounds, drop.tolist()):
        halo_start = max(0, ls - halo)
        assert d == int(halo_start > 0) + ls - halo_start
        body = full.narrow(tdim, halo_start, le - halo_start)
        if halo_start > 0:  # pseudo first-frame latent: junk to be dropped
            junk = torch.randn(body.narrow(tdim, 0, 1).shape, generator=g).to(dtype)
            body = torch.cat([junk, body], dim=tdim)
        latents.append(body.contiguous())
    got = halo_gather(latents, drop, layout)
    assert torch.equal(bits(got), bits(halo_gather_reference(latents, drop, layout)))
    assert torch.equal(bits(got), bits(full))
    packed = torch.cat([t.reshape(-1) for t in latents])
    shapes = [tuple(t.shape) for t in latents]
    assert torch.equal(bits(halo_gather_packed(packed, shapes, drop, layout)), bits(full))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_then_gather_roundtrip(layout):
    """Gathering the packed raw windows, dropping each window's overlap, rebuilds the video."""
    video = torch.randn((2, 3, 1 + 4 * 11, 3, 5) if layout == "bcthw" else (2, 1 + 4 * 11, 3, 3, 5))
    windows, _ = _halo_windows([(0, 3), (3, 5), (5, 9), (9, 12)], halo=2)
    packed = halo_scatter(video, windows, layout)
    prev_end = [0] + windows[:-1, 1].tolist()
    overlap = [max(0, pe - s) for pe, s in zip(prev_end, windows[:, 0].tolist())]
    assert torch.equal(halo_gather_packed(packed.buffer, packed.shapes, overlap, layout), video)


def test_non_contiguous_and_empty_kept():
    video = torch.randn(2, 9, 3, 4, 5).permute(0, 2, 1, 3, 4)  # bcthw view of a btchw tensor
    windows = torch.tensor([[0, 5], [4, 9]])
    got, ref = halo_scatter(video, windows), halo_scatter_reference(video, windows)
    assert torch.equal(got.buffer, ref.buffer)
    parts = [torch.randn(1, 2, 3, 2, 2), torch.randn(1, 2, 4, 2, 2)]
    out = halo_gather(parts, [3, 1])  # rank 0 keeps nothing
    assert torch.equal(out, parts[1][:, :, 1:])


def test_halo_windows_rule():
    windows, drop = _halo_windows([(0, 2), (2, 4), (4, 6), (6, 8)], halo=2)
    assert windows.tolist() == [[0, 5], [0, 13], [4, 21], [12, 29]]
    assert drop.tolist() == [0, 2, 3, 3]
    for (s, e), d, (ls, le) in zip(
        windows.tolist(), drop.tolist(), [(0, 2), (2, 4), (4, 6), (6, 8)]
    ):
        encoded = (e - s - 1) // 4 + 1  # latents a causal VAE makes from the window
        assert encoded == d + (le - ls)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: halo_scatter(torch.zeros(1, 2, 5, 2, 2), [[0, 3]], layout="bhwct"),
            r"layout \('bhwct'\)",
        ),
        (
            lambda: halo_scatter(torch.zeros(2, 5, 2, 2), [[0, 3]]),
            r"video \(\(2, 5, 2, 2\)\) must be a 5-D",
        ),
        (lambda: halo_scatter(torch.zeros(1, 2, 5, 2, 2), [[3, 3]]), r"windows\[0\] \(\[3, 3\)\)"),
        (lambda: halo_scatter(torch.zeros(1, 2, 5, 2, 2), [[0, 6]]), r"end <= T \(5\)"),
        (lambda: halo_scatter(torch.zeros(1, 2, 5, 2, 2), [0, 3]), r"windows \(shape \(2,\)"),
        (
            lambda: halo_gather([torch.zeros(1, 2, 3, 2, 2)], [4]),
            r"drop\[0\] \(4\) must be in \[0, frames",
        ),
        (
            lambda: halo_gather([torch.zeros(1, 2, 3, 2, 2), torch.zeros(1, 3, 3, 2, 2)], [0, 0]),
            r"latents\[1\] \(\(1, 3, 3, 2, 2\)",
        ),
        (lambda: halo_gather([torch.zeros(1, 2, 3, 2, 2)], [0, 1]), r"drop \(shape \(2,\)"),
        (
            lambda: halo_gather_packed(torch.zeros(10), [(1, 1, 3, 1, 1)], [0]),
            r"buffer \(10 elements\)",
        ),
        (lambda: _halo_windows([(2, 2)], 1), r"latent_bounds\[0\]"),
        (
            lambda: halo_scatter(torch.zeros(1, 2, 5, 2, 2, requires_grad=True), [[0, 3]]),
            r"video \(requires_grad=True\)",
        ),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
