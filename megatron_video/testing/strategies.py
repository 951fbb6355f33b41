"""Hypothesis strategies shared by the ``megatron_video.ops`` tests (CPU and CUDA).

Needs ``hypothesis`` (a test dependency); ``megatron_video.testing`` itself does not import this
module. ``halo_case``: a video and ragged per-rank halo windows; ``mask_case``: token ids in any
order (or the structured orders the models use), a rule and tile sizes.
"""

import torch
from hypothesis import strategies as st

from megatron_video.layouts.vae_halo import window_tensors, windows_for_bounds
from megatron_video.ops import RULES, TokenIds

__all__ = [
    "DTYPES",
    "LAYOUTS",
    "bits",
    "halo_windows",
    "halo_case",
    "random_ids",
    "structured_ids",
    "mask_case",
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["bcthw", "btchw"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view, so equality is bitwise (distinguishes -0.0, NaN payloads)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def halo_windows(latent_bounds, halo):
    """``[P, 2]`` raw windows and ``[P]`` drops of the one window rule (layouts.vae_halo)."""
    return window_tensors(windows_for_bounds(latent_bounds, halo))


def random_bounds(draw, num_ranks: int):
    """Ragged per-rank latent ranges [ls, le) covering [0, F)."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=num_ranks, max_size=num_ranks))
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


@st.composite
def halo_case(draw, layout, dtype, device="cpu"):
    P = draw(st.sampled_from([1, 2, 4, 8]))
    bounds = random_bounds(draw, P)
    halo = draw(st.integers(0, 3))
    B, C = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    H, W = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    T = 1 + 4 * (bounds[-1][1] - 1)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (B, C, T, H, W) if layout == "bcthw" else (B, T, C, H, W)
    video = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    windows, drop = halo_windows(bounds, halo)
    return video, windows, drop, bounds, halo


# ---------------------------------------------------------------------------------------------
# strategies: random ids in any order, and the structured orders the models use
# ---------------------------------------------------------------------------------------------
@st.composite
def random_ids(draw, length, with_doc):
    def ints(lo, hi):
        return draw(st.lists(st.integers(lo, hi), min_size=length, max_size=length))

    doc = None
    if with_doc:  # ragged documents, contiguous or interleaved
        doc = torch.tensor(sorted(ints(0, 3)) if draw(st.booleans()) else ints(0, 3))
    return TokenIds(
        side=torch.tensor(ints(0, 1)),
        block=torch.tensor(ints(0, 4)),
        doc=doc,
        pos=torch.tensor(ints(-2, 30)),
    )


@st.composite
def structured_ids(draw, with_doc):
    """Balanced-SP rank-major [c_0 n_0 c_1 n_1 ...] over F frames of S tokens, then reordered."""
    P, nb = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    F, S = P * draw(st.integers(1, 3)), draw(st.integers(1, 5))
    side, frame = [], []
    for r in range(P):
        fr = [f for f in range(r * F // P, (r + 1) * F // P) for _ in range(S)]
        side += [0] * len(fr) + [1] * len(fr)
        frame += fr * 2
    n = len(side)
    order = draw(st.sampled_from(["rank_major", "reversed", "shuffled", "local"]))
    perm = torch.arange(n)
    if order == "reversed":
        perm = perm.flip(0)
    elif order == "shuffled":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    elif order == "local" and n > 1:  # swap a few neighbours: tiles near block edges become mixed
        for i in draw(st.lists(st.integers(0, n - 2), max_size=6)):
            perm[[i, i + 1]] = perm[[i + 1, i]]
    doc = None
    if with_doc:  # documents of ragged lengths in token order
        cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)))
        doc = torch.bucketize(torch.arange(n), torch.tensor(cuts, dtype=torch.long), right=True)[
            perm
        ]
    ids = TokenIds.from_frames(
        torch.tensor(frame)[perm], nb, side=torch.tensor(side)[perm], doc=doc, pos=torch.arange(n)
    )
    return ids


@st.composite
def mask_case(draw):
    rule = draw(st.sampled_from(sorted(RULES)))
    with_doc = draw(st.booleans())
    if draw(st.booleans()):
        q = k = draw(structured_ids(with_doc))
    else:
        q = draw(random_ids(draw(st.integers(1, 30)), with_doc))
        k = q if draw(st.booleans()) else draw(random_ids(draw(st.integers(1, 30)), with_doc))
    return q, k, rule, draw(st.integers(1, 9)), draw(st.integers(1, 9))
