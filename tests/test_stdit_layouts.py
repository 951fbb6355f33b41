"""ST-DiT layouts A/B: pure index maps with inverses, checked against first-principles loops.

The communicating A<->B transitions are tested on gloo ranks in ``tests/test_stdit.py`` (one pool).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_video.layouts import stdit as L

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only


# ---------------------------------------------------------------------------------------------
# Pure index maps
# ---------------------------------------------------------------------------------------------
def _first_principles_a(rank, t, n, P):
    tl = t // P
    return [(rank * tl + i // n) * n + i % n for i in range(tl * n)]


def _first_principles_b(rank, t, n, P):
    m = -(-n // P)
    out = []
    for pl in range(m):
        p = rank * m + pl
        out.extend([f * n + p if p < n else -1 for f in range(t)])
    return out


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 5), tl=st.integers(1, 3), n=st.integers(1, 11))
def test_index_maps_match_first_principles_and_invert(P, tl, n):
    t = tl * P if tl * P > 1 else 2 * P  # t == 1 is the image case, tested separately
    seen_a, seen_b = [], []
    for r in range(P):
        ia, ib = L.layout_a_indices(r, t, n, P), L.layout_b_indices(r, t, n, P)
        assert ia.tolist() == _first_principles_a(r, t, n, P)
        assert ib.tolist() == _first_principles_b(r, t, n, P)
        ra, la = L.layout_a_owner(ia, t, n, P)
        assert (ra == r).all() and torch.equal(la, torch.arange(ia.numel()))
        real = ib >= 0
        rb, lb = L.layout_b_owner(ib[real], t, n, P)
        assert (rb == r).all() and torch.equal(lb, torch.arange(ib.numel())[real])
        seen_a += ia.tolist()
        seen_b += ib[real].tolist()
    assert sorted(seen_a) == list(range(t * n)) == sorted(seen_b)  # each layout is a partition
    assert (
        L.padded_positions(n, P) - n
        == sum((L.layout_b_indices(r, t, n, P) < 0).sum().item() for r in range(P)) // t
    )


def test_shard_helpers_follow_the_index_maps():
    b, t, n, P = 2, 8, 7, 4
    video = torch.randn(b, t, n, 3, dtype=torch.float64)
    flat = video.reshape(b, t * n, 3)
    blocks = []
    for r in range(P):
        a = L.shard_layout_a(video, r, P)
        assert torch.equal(a.reshape(b, -1, 3), flat[:, L.layout_a_indices(r, t, n, P)])
        blocks.append(a)
        bb = L.shard_layout_b(video, r, P).reshape(b, -1, 3)
        ib = L.layout_b_indices(r, t, n, P)
        assert torch.equal(bb[:, ib >= 0], flat[:, ib[ib >= 0]])
        assert (bb[:, ib < 0] == 0).all()
    assert torch.equal(L.unshard_layout_a(blocks, t), video)
    images = torch.randn(8, 1, n, 3)
    parts = [L.shard_layout_a(images, r, P) for r in range(P)]
    assert [p.shape[0] for p in parts] == [2] * P
    assert torch.equal(L.unshard_layout_a(parts, 1), images)
    assert list(L.image_batch_range(3, 8, 4)) == [6, 7]


def test_token_thw_and_geometry():
    g = L.VideoGeometry(3, 2, 5)
    assert (g.positions, g.tokens, g.is_image) == (10, 30, False)
    thw = L.token_thw(torch.tensor([0, 7, 10 + 5 * 1 + 3, -1]), g)
    assert thw.tolist() == [[0, 0, 0], [0, 1, 2], [1, 1, 3], [0, 0, 0]]
    with pytest.raises(ValueError, match=r"height \(0\) must be a positive integer"):
        L.VideoGeometry(2, 0, 3)


def test_divisibility_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"num_frames \(6\) must be divisible by cp_size \(4\)"):
        L.check_stdit_divisibility(6, 4)
    with pytest.raises(ValueError, match=r"num_frames \(6\) must be divisible by cp_size \(4\)"):
        L.layout_a_indices(0, 6, 5, 4)
    with pytest.raises(ValueError, match=r"batch_size \(3\) must be divisible by cp_size \(2\)"):
        L.check_stdit_divisibility(1, 2, batch_size=3)
    with pytest.raises(ValueError, match=r"rank \(4\) must be an integer in \[0, cp_size \(4\)\)"):
        L.layout_b_indices(4, 8, 5, 4)
    with pytest.raises(ValueError, match=r"num_positions \(0\) must be a positive integer"):
        L.positions_per_rank(0, 2)
    L.check_stdit_divisibility(1, 4)  # images without a batch size: nothing to check


def test_transitions_live_with_the_communication_code():
    """The communicating A <-> B transitions are in attention/ (layouts stay pure); the old
    megatron_video.models package re-exports them; VideoGeometry has its own module."""
    import megatron_video.layouts as layouts
    import megatron_video.layouts.stdit as lay
    import megatron_video.models as old
    from megatron_video.attention import stdit_transitions
    from megatron_video.layouts.geometry import VideoGeometry

    assert old.frames_to_positions is stdit_transitions.frames_to_positions
    assert old.positions_to_frames is stdit_transitions.positions_to_frames
    assert lay.VideoGeometry is layouts.VideoGeometry is VideoGeometry
    assert not hasattr(lay, "frames_to_positions")
