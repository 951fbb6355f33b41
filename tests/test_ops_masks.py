"""Mask construction: the C++ extension equals the references exactly; the references equal the
rules written out pair by pair; the FlexAttention BlockMask equals the dense mask."""

import pytest
import torch
from hypothesis import given, settings
from torch.nn.attention.flex_attention import create_mask, flex_attention

from megatron_video.ops import (
    RULES,
    TokenIds,
    block_mask_status,
    block_mask_status_reference,
    dense_mask,
    dense_mask_reference,
    flex_block_fields,
    flex_block_mask,
    lower_triangle,
)
from megatron_video.testing.masks import dense_rule_oracle as dense_oracle
from megatron_video.testing.masks import rank_major_teacher_forcing_ids
from megatron_video.testing.masks import tile_status_oracle as status_oracle
from megatron_video.testing.strategies import mask_case

pytestmark = [pytest.mark.one_env, pytest.mark.usefixtures("extension")]

SETTINGS = settings(max_examples=40, deadline=None, database=None)


@SETTINGS
@given(case=mask_case())
def test_extension_equals_reference_and_oracle(case):
    q, k, rule, qb, kb = case
    dense = dense_mask(q, k, rule)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, dense_mask_reference(q, k, rule))
    assert torch.equal(dense, dense_oracle(q, k, rule))
    status = block_mask_status(q, k, rule, qb, kb)
    assert torch.equal(status, block_mask_status_reference(q, k, rule, qb, kb))
    assert torch.equal(status, status_oracle(dense, qb, kb))


@SETTINGS
@given(case=mask_case())
def test_lower_triangle_is_never_wrong(case):
    """``lower_triangle`` (O(length), no mask) says True only when the oracle's tile is exactly the
    lower triangle ``j <= i``."""
    q, k, rule, _, _ = case
    if lower_triangle(q, k, rule):
        d = dense_oracle(q, k, rule)
        assert d.shape[0] == d.shape[1] and torch.equal(d, torch.ones_like(d).tril()), (rule, q, k)


def test_lower_triangle_recognises_the_causal_tiles_the_engine_meets():
    run = torch.arange(10, 20)
    zigzag = torch.cat([torch.arange(4, 8), torch.arange(28, 32)])  # two runs, increasing
    for pos in (run, zigzag):
        assert lower_triangle(TokenIds(pos=pos), TokenIds(pos=pos), "causal")
        one_doc = TokenIds(pos=pos, doc=torch.zeros_like(pos))
        assert lower_triangle(one_doc, one_doc, "causal")
        assert lower_triangle(TokenIds(block=pos), TokenIds(block=pos), "block_causal")
        clean = TokenIds(side=torch.zeros_like(pos), block=pos)
        assert lower_triangle(clean, clean, "teacher_forcing")
    # not lower triangles (or not provably so): different ids, two documents, repeated keys, noisy
    assert not lower_triangle(TokenIds(pos=run), TokenIds(pos=run + 1), "causal")
    two_docs = TokenIds(pos=run, doc=(run >= 15).long())
    assert not lower_triangle(two_docs, two_docs, "causal")
    frames = TokenIds(block=run // 2)
    assert not lower_triangle(frames, frames, "block_causal")
    noisy = TokenIds(side=torch.ones_like(run), block=run)
    assert not lower_triangle(noisy, noisy, "teacher_forcing")
    assert not lower_triangle(TokenIds(pos=run), TokenIds(pos=run), "full")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@settings(max_examples=8, deadline=None, database=None)
@given(case=mask_case())
def test_flex_block_mask_equals_dense(case):
    q, k, rule, qb, kb = case
    dense = dense_mask_reference(q, k, rule)
    lq, lk = dense.shape
    bm = flex_block_mask(q, k, rule, qb, kb)
    nq, nk = -(-lq // qb), -(-lk // kb)

    def tiles(num, idx):  # which [q tile, k tile] the fields list
        out = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            out[i, idx[0, 0, i, : num[0, 0, i]].long()] = True
        return out

    partial = tiles(bm.kv_num_blocks, bm.kv_indices)
    full = tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not bool((partial & full).any())
    assert torch.equal(bm.to_dense()[0, 0, :nq, :nk], partial | full)
    grow = lambda t: t.repeat_interleave(qb, 0).repeat_interleave(kb, 1)[:lq, :lk]  # noqa: E731
    # What a block-sparse kernel computes: full tiles as is, partial tiles through mask_mod.
    mod = create_mask(bm.mask_mod, None, None, lq, lk, device="cpu")[0, 0]
    assert torch.equal(grow(full) | (grow(partial) & mod), dense)
    # flex_attention (eager, CPU) against explicit softmax attention, on rows that see a key.
    g = torch.Generator().manual_seed(0)
    x_q, x_k, x_v = (
        torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (lq, lk, lk)
    )
    out = flex_attention(x_q, x_k, x_v, block_mask=bm)
    scores = (x_q @ x_k.transpose(-1, -2) / 8**0.5).masked_fill(~dense, float("-inf"))
    ref = torch.softmax(scores, -1).nan_to_num(0.0) @ x_v
    rows = dense.any(1)
    assert torch.allclose(out[:, :, rows], ref[:, :, rows], atol=1e-10)


def test_fields_layout_by_hand():
    status = torch.tensor([[2, 1, 0, 1], [0, 0, 0, 0], [1, 2, 2, 1]], dtype=torch.uint8)
    f = flex_block_fields(status)
    assert f.kv_num_blocks.tolist() == [[[2, 0, 2]]]
    assert f.kv_indices[0, 0, 0, :2].tolist() == [1, 3] and f.kv_indices[0, 0, 2, :2].tolist() == [
        0,
        3,
    ]
    assert f.full_kv_num_blocks.tolist() == [[[1, 0, 2]]]
    assert f.full_kv_indices[0, 0, 2, :2].tolist() == [1, 2]
    assert all(t.dtype == torch.int32 for t in f)
    assert sorted(f.kv_indices[0, 0, 1].tolist()) == [0, 1, 2, 3]  # padding is a permutation


def test_balanced_sp_order_is_permuted_single_gpu_mask():
    """Rank-major teacher-forcing mask == single-GPU [clean; noisy] mask under the permutation."""
    P, F, S, nb = 4, 8, 3, 2
    frame = torch.arange(F).repeat_interleave(S)
    single = TokenIds.from_frames(
        frame.repeat(2), nb, side=torch.arange(2).repeat_interleave(F * S)
    )
    per = F * S // P
    perm = torch.cat(
        [
            torch.cat(
                [torch.arange(r * per, (r + 1) * per), F * S + torch.arange(r * per, (r + 1) * per)]
            )
            for r in range(P)
        ]
    )
    rank_major = TokenIds(side=single.side[perm], block=single.block[perm])
    want = dense_oracle(single, single, "teacher_forcing")[perm][:, perm]
    assert torch.equal(dense_mask(rank_major, rank_major, "teacher_forcing"), want)
    assert torch.equal(
        block_mask_status(rank_major, rank_major, "teacher_forcing", 6, 4),
        status_oracle(want, 6, 4),
    )


def test_packed_documents_causal_within_doc():
    doc = torch.tensor([0] * 5 + [1] * 2 + [2] * 9)
    pos = torch.cat([torch.arange(5), torch.arange(2), torch.arange(9)])
    ids = TokenIds(doc=doc, pos=pos)
    want = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    assert torch.equal(dense_mask(ids, ids, "causal"), want)
    assert torch.equal(dense_mask(ids, ids, "full"), doc[:, None] == doc[None, :])
    assert (
        block_mask_status(ids, ids, "causal", 4, 4).tolist() == status_oracle(want, 4, 4).tolist()
    )


def test_large_structured_tiles_equal_reference():
    """A model-sized shape (rank-major teacher forcing, 128-token tiles) exercises the bound shortcut."""
    P, F, S, nb = 4, 16, 40, 2
    ids = rank_major_teacher_forcing_ids(P, F, S, nb)
    for rule in RULES:
        got = block_mask_status(ids, ids, rule, 128, 128)
        assert torch.equal(got, block_mask_status_reference(ids, ids, rule, 128, 128)), rule


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: dense_mask(
                TokenIds(pos=torch.arange(3)), TokenIds(pos=torch.arange(3)), "sliding"
            ),
            r"rule \('sliding'\) must be one of",
        ),
        (
            lambda: dense_mask(
                TokenIds(block=torch.arange(3)), TokenIds(block=torch.arange(3)), "causal"
            ),
            r"q.pos \(None\) is required",
        ),
        (
            lambda: dense_mask(
                TokenIds(side=torch.tensor([0, 2]), block=torch.arange(2)),
                TokenIds(side=torch.tensor([0, 1]), block=torch.arange(2)),
                "teacher_forcing",
            ),
            r"q.side \(values \[0, 2\]\) must be 0 \(clean\) or 1",
        ),
        (
            lambda: dense_mask(
                TokenIds(pos=torch.arange(3), doc=torch.zeros(3, dtype=torch.long)),
                TokenIds(pos=torch.arange(3)),
                "causal",
            ),
            r"doc \(q: True, k: False\)",
        ),
        (
            lambda: dense_mask(
                TokenIds(pos=torch.arange(3), block=torch.arange(4)),
                TokenIds(pos=torch.arange(3)),
                "causal",
            ),
            r"q.pos \(length 3",
        ),
        (
            lambda: dense_mask(
                TokenIds(pos=torch.arange(3.0)), TokenIds(pos=torch.arange(3)), "causal"
            ),
            r"q.pos \(torch.Size\(\[3\]\)\) must be a 1-D integer",
        ),
        (
            lambda: block_mask_status(
                TokenIds(pos=torch.arange(3)), TokenIds(pos=torch.arange(3)), "causal", 0, 4
            ),
            r"q_block \(0\) must be a positive int",
        ),
        (lambda: TokenIds.from_frames(torch.arange(4), 0), r"frames_per_block \(0\)"),
        (lambda: TokenIds.from_frames(torch.tensor([-1, 0]), 2), r"frame \(min -1\) must be >= 0"),
        (
            lambda: flex_block_fields(torch.zeros(3)),
            r"status \(torch.Size\(\[3\]\)\) must be a 2-D",
        ),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
