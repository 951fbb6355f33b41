"""CUDA kernels against the CPU references (run by benchmarks/gpu_check.sh on a GPU machine)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_video.ops import (
    RULES,
    TokenIds,
    active_backend,
    block_mask_status,
    block_mask_status_reference,
    dense_mask,
    dense_mask_reference,
    halo_gather,
    halo_gather_reference,
    halo_scatter,
    halo_scatter_reference,
)
from megatron_video.testing.masks import rank_major_teacher_forcing_ids
from megatron_video.testing.strategies import DTYPES, LAYOUTS, bits, halo_case, mask_case

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (run benchmarks/gpu_check.sh)"
    ),
]
SETTINGS = settings(max_examples=10, deadline=None, database=None)


def on_cuda(ids: TokenIds) -> TokenIds:
    return TokenIds(**{k: v.cuda() for k, v in ids.present().items()})


def test_cuda_kernels_are_built():
    import megatron_video._C as ext

    assert ext.has_cuda(), (
        "megatron_video._C was built without CUDA kernels; rebuild with nvcc available"
    )
    assert active_backend("cuda") == "extension"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(data=st.data())
def test_halo_cuda_equals_reference(layout, dtype, data):
    video, windows, drop, _, _ = data.draw(halo_case(layout, dtype))
    got = halo_scatter(video.cuda(), windows, layout)
    ref = halo_scatter_reference(video, windows, layout)
    assert got.buffer.is_cuda and torch.equal(bits(got.buffer.cpu()), bits(ref.buffer))
    assert torch.equal(got.offsets, ref.offsets) and got.shapes == ref.shapes
    latents = [ref.window(p) for p in range(len(ref.shapes))]
    out = halo_gather([t.cuda() for t in latents], drop, layout)
    assert torch.equal(bits(out.cpu()), bits(halo_gather_reference(latents, drop, layout)))


def test_halo_cuda_grid_stride_paths():
    """More blocks than one grid dimension holds, and odd byte lengths (1-byte words)."""
    video = torch.randn(70_000, 1, 9, 1, 1)
    got = halo_scatter(video.cuda(), [[0, 5], [4, 9]])
    assert torch.equal(got.buffer.cpu(), halo_scatter_reference(video, [[0, 5], [4, 9]]).buffer)
    odd = torch.randint(0, 255, (3, 7, 13, 3, 5), dtype=torch.uint8)
    got = halo_scatter(odd.cuda(), [[0, 3], [2, 13], [5, 6]], layout="btchw")
    assert torch.equal(
        got.buffer.cpu(), halo_scatter_reference(odd, [[0, 3], [2, 13], [5, 6]], "btchw").buffer
    )


@SETTINGS
@given(case=mask_case())
def test_masks_cuda_equal_reference(case):
    q, k, rule, qb, kb = case
    assert torch.equal(
        dense_mask(on_cuda(q), on_cuda(k), rule).cpu(), dense_mask_reference(q, k, rule)
    )
    assert torch.equal(
        block_mask_status(on_cuda(q), on_cuda(k), rule, qb, kb).cpu(),
        block_mask_status_reference(q, k, rule, qb, kb),
    )


def test_masks_cuda_model_size():
    P, F, S, nb = 4, 16, 60, 2
    ids = rank_major_teacher_forcing_ids(P, F, S, nb)
    for rule in RULES:
        ref = block_mask_status_reference(ids, ids, rule, 128, 64)
        assert torch.equal(
            block_mask_status(on_cuda(ids), on_cuda(ids), rule, 128, 64).cpu(), ref
        ), rule
        assert torch.equal(
            dense_mask(on_cuda(ids), on_cuda(ids), rule).cpu(), dense_mask_reference(ids, ids, rule)
        )
