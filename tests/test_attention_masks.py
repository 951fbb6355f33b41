"""Masks on global token indices: dense blocks from first principles, block status, errors."""

import pytest
import torch

from megatron_video.attention import masks
from megatron_video.attention.masks import EMPTY, FULL, PARTIAL

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only


def _brute(fn, q, k):
    rows = [[bool(fn(int(a), int(b))) for b in k] for a in q]
    return torch.tensor(rows, dtype=torch.bool).reshape(len(q), len(k))


CU = [0, 4, 5, 13, 20]


def _doc(i):
    for d in range(len(CU) - 1):
        if CU[d] <= i < CU[d + 1]:
            return d
    return -1


DEFINITIONS = {  # mask -> the rule it must follow, one pair at a time
    "full": (masks.full(), lambda q, k: True),
    "causal": (masks.causal(), lambda q, k: k <= q),
    "block_causal": (masks.block_causal(3), lambda q, k: k // 3 <= q // 3),
    "packed": (masks.packed(CU), lambda q, k: _doc(q) == _doc(k) and _doc(q) >= 0),
    "packed_causal": (
        masks.packed(CU, inner=masks.causal()),
        lambda q, k: _doc(q) == _doc(k) and _doc(q) >= 0 and k <= q,
    ),
    # inner masks see document-relative positions: blocks of 2 restart at each document start
    "packed_block": (
        masks.packed(CU, inner=masks.block_causal(2)),
        lambda q, k: (
            _doc(q) == _doc(k) and _doc(q) >= 0 and (k - CU[_doc(k)]) // 2 <= (q - CU[_doc(q)]) // 2
        ),
    ),
    "predicate": (masks.predicate(lambda q, k: (q + k) % 3 != 0), lambda q, k: (q + k) % 3 != 0),
}


@pytest.mark.parametrize("name", sorted(DEFINITIONS))
def test_dense_and_status_match_definition(name):
    mask, rule = DEFINITIONS[name]
    g = torch.Generator().manual_seed(0)
    for trial in range(25):
        # arbitrary (unsorted, gappy) id sets, plus padding ids past cu_seqlens[-1]
        q = torch.randperm(24, generator=g)[: 1 + trial % 7]
        k = torch.randperm(24, generator=g)[: 1 + (trial * 5) % 9]
        expect = _brute(rule, q, k)
        assert torch.equal(mask.dense(q, k), expect), (name, q, k)
        st = EMPTY if not expect.any() else FULL if expect.all() else PARTIAL
        assert mask.block_status(q, k) == st, (name, q, k)
    # contiguous runs too (what the ring passes), including the status shortcuts of causal masks
    for a in range(0, 24, 4):
        for b in range(0, 24, 4):
            q, k = torch.arange(a, a + 4), torch.arange(b, b + 4)
            expect = _brute(rule, q, k)
            st = EMPTY if not expect.any() else FULL if expect.all() else PARTIAL
            assert mask.block_status(q, k) == st


def test_default_schemes_and_empty_blocks():
    assert masks.full().default_scheme == "contiguous"
    assert masks.causal().default_scheme == "zigzag"
    assert masks.block_causal(4).default_scheme == "zigzag"
    assert masks.packed([0, 3]).default_scheme == "contiguous"
    assert masks.packed([0, 3], inner=masks.causal()).default_scheme == "zigzag"
    assert masks.predicate(lambda q, k: q >= k, default_scheme="zigzag").default_scheme == "zigzag"
    empty = torch.arange(0)
    assert masks.causal().block_status(empty, torch.arange(3)) == EMPTY
    assert masks.full().block_status(torch.arange(2), empty) == EMPTY


def test_packed_padding_attends_nothing():
    m = masks.packed([0, 2, 5])
    d = m.dense(torch.arange(7), torch.arange(7))
    assert not d[5:].any() and not d[:, 5:].any()
    assert d[:2, :2].all() and d[2:5, 2:5].all() and not d[:2, 2:].any()


def test_subclass_with_dense_only():
    class Frames(masks.AttentionMask):  # e.g. an identity-table mask from another module
        def __init__(self, table):
            self.table = table

        def dense(self, q_ids, k_ids):
            return self.table[q_ids][:, k_ids]

    t = torch.rand(10, 10) < 0.5
    t[3, :] = False
    m = Frames(t)
    q = torch.tensor([3])
    assert m.block_status(q, torch.arange(10)) == EMPTY
    assert torch.equal(m.dense(torch.arange(10), torch.arange(10)), t)


@pytest.mark.parametrize(
    "call,frag",
    [
        (lambda: masks.block_causal(0), "block_tokens (0) must be a positive integer"),
        (lambda: masks.block_causal(2.5), "block_tokens (2.5)"),
        (lambda: masks.packed([1, 4]), "must start at 0 and be non-decreasing"),
        (lambda: masks.packed([0, 4, 2]), "must start at 0 and be non-decreasing"),
        (lambda: masks.packed([0.0, 2.0]), "1-D integer sequence"),
        (lambda: masks.packed([0, 2], inner="causal"), "inner ('causal') must be an AttentionMask"),
        (lambda: masks.predicate(3), "must be callable"),
        (lambda: masks.predicate(lambda q, k: q > k, default_scheme="x"), "default_scheme ('x')"),
        (
            lambda: masks.predicate(lambda q, k: (q - k).float()).dense(
                torch.arange(2), torch.arange(2)
            ),
            "must return a bool tensor",
        ),
    ],
)
def test_mask_errors(call, frag):
    with pytest.raises(ValueError) as e:
        call()
    assert frag in str(e.value)
