"""Zigzag / contiguous layouts: bijections, inverses and the 2D (Ulysses x ring) index map."""

import pytest
import torch

from megatron_video.attention import ring_token_ids
from megatron_video.layouts import (
    concat_global_ids,
    contiguous_global_ids,
    global_token_ids,
    shard_global_ids,
    shard_owner,
    shard_sequence,
    unshard_sequence,
    zigzag_global_ids,
)
from megatron_video.parallel.topology import local_groups

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only


@pytest.mark.parametrize("scheme", ["zigzag", "contiguous"])
@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
def test_shards_partition_the_sequence_and_invert(scheme, N):
    S = 2 * N * 3
    ids = [shard_global_ids(c, N, S, scheme) for c in range(N)]
    assert sorted(torch.cat(ids).tolist()) == list(range(S))  # a partition, equal sizes
    assert all(len(i) == S // N for i in ids)
    for c, gids in enumerate(ids):
        rank, local = shard_owner(gids, N, S, scheme)
        assert rank.tolist() == [c] * len(gids)
        assert local.tolist() == list(range(len(gids)))
    # tensors: shard then unshard is the identity, along any dim, with autograd
    x = torch.randn(2, S, 3, requires_grad=True)
    shards = [shard_sequence(x, dim=1, scheme=scheme, cp_rank=c, cp_size=N) for c in range(N)]
    assert torch.equal(unshard_sequence(shards, dim=1, scheme=scheme), x)
    y = torch.randn(S, 5)
    assert torch.equal(
        unshard_sequence(
            [shard_sequence(y, dim=0, scheme=scheme, cp_rank=c, cp_size=N) for c in range(N)],
            dim=0,
            scheme=scheme,
        ),
        y,
    )


def test_zigzag_first_principles():
    # 2N = 8 chunks of 3 tokens; rank c holds chunks c and 7 - c
    assert zigzag_global_ids(0, 4, 24).tolist() == [0, 1, 2, 21, 22, 23]
    assert zigzag_global_ids(3, 4, 24).tolist() == [9, 10, 11, 12, 13, 14]
    assert contiguous_global_ids(1, 4, 24).tolist() == [6, 7, 8, 9, 10, 11]
    # causal work balance: every rank sees the same number of (q, k <= q) pairs
    work = [sum(int(i) + 1 for i in zigzag_global_ids(c, 4, 64)) for c in range(4)]
    assert len(set(work)) == 1


def test_global_token_ids_with_groups_object():
    class G:  # the attributes of VideoParallelGroups that layouts use
        cp_rank, cp_size = 2, 4

    assert torch.equal(global_token_ids(G, 32, "zigzag"), zigzag_global_ids(2, 4, 32))
    x = torch.arange(32)
    assert torch.equal(shard_sequence(x, G, dim=0, scheme="contiguous"), torch.arange(16, 24))


@pytest.mark.parametrize("U,R", [(1, 4), (4, 1), (2, 2), (2, 4), (4, 2), (2, 3)])
def test_2d_reorder_gives_ring_rank_zigzag_chunks(U, R):
    """After the Ulysses gather and the sort, ring rank r holds coarse zigzag chunks r and 2R-1-r
    (ulysses_inner), and the gathered ids of every ring rank are a partition of the sequence."""
    N, S = U * R, 2 * U * R * 2
    cp_ranks = list(range(N))
    for placement in ("ulysses_inner", "ring_inner"):
        ug, rg = local_groups(cp_ranks, U, R, placement)
        for u_ranks in ug:
            for me in u_ranks:
                ring = next(g for g in rg if me in g)
                gathered, ring_ids = ring_token_ids(
                    cp_ranks, u_ranks, ring, U, R, placement, S, "zigzag"
                )
                assert sorted(gathered.tolist()) == ring_ids[ring.index(me)].tolist()
                assert sorted(torch.cat(ring_ids).tolist()) == list(range(S))
                if placement == "ulysses_inner":
                    coarse = S // (2 * R)
                    for r, ids in enumerate(ring_ids):
                        late = 2 * R - 1 - r
                        expect = list(range(r * coarse, (r + 1) * coarse)) + list(
                            range(late * coarse, (late + 1) * coarse)
                        )
                        assert ids.tolist() == expect


def test_concat_matches_a2a_order():
    assert concat_global_ids([1, 0], 2, 8, "zigzag").tolist() == [2, 3, 4, 5, 0, 1, 6, 7]


@pytest.mark.parametrize(
    "call,frag",
    [
        (lambda: zigzag_global_ids(0, 4, 12), "seq_len (12) must be divisible by 2 * cp_size (8)"),
        (lambda: contiguous_global_ids(0, 4, 10), "seq_len (10) must be divisible by cp_size (4)"),
        (lambda: shard_global_ids(4, 4, 16, "zigzag"), "cp_rank (4) must be < cp_size (4)"),
        (lambda: shard_global_ids(0, 4, 16, "spiral"), "scheme ('spiral')"),
        (
            lambda: shard_owner(torch.tensor([16]), 4, 16, "zigzag"),
            "global_ids must lie in [0, seq_len)",
        ),
        (lambda: shard_sequence(torch.zeros(8), dim=0), "pass either groups"),
        (lambda: unshard_sequence([torch.zeros(2), torch.zeros(3)], dim=0), "same shape"),
    ],
)
def test_layout_errors(call, frag):
    with pytest.raises(ValueError, match=None) as e:
        call()
    assert frag in str(e.value)
