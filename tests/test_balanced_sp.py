"""Balanced SP layout: index maps, teacher-forcing mask, block forms, balance (pure, no processes)."""

import functools
import itertools

import pytest
import torch

from megatron_video.layouts.balanced_sp import (
    BalancedSPLayout,
    max_over_mean,
    naive_identity_units,
    naive_slice_global_ids,
    ring_attention_work,
    single_gpu_teacher_forcing_mask,
)
from megatron_video.testing.masks import teacher_forcing_oracle, tile_status_oracle

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

# the single-GPU [clean; noisy] mask written out from the rules, token by token
oracle_mask = functools.lru_cache(maxsize=None)(teacher_forcing_oracle)


def small_configs():
    """Every valid (F, S, nb, P, R, balance) with F <= 8, S in {1, 3}."""
    for F, S in itertools.product(range(1, 9), (1, 3)):
        for nb in (d for d in range(1, F + 1) if F % d == 0):
            for P in (p for p in range(1, F // nb + 1) if F % (p * nb) == 0):
                for R in (r for r in range(1, P + 1) if P % r == 0):
                    for bal in (False, True):
                        if bal and R > 1 and F % (2 * R * nb):
                            continue
                        yield F, S, nb, P, R, bal


def test_mask_equals_single_gpu_mask_under_permutation_exhaustive():
    n_cases = 0
    for F, S, nb, P, R, bal in small_configs():
        lay = BalancedSPLayout(F, S, nb, P, ring_size=R, ring_balance=bal)
        perm = lay.attention_order_global_ids()
        assert sorted(perm.tolist()) == list(range(2 * F * S)), (
            "attention order must be a permutation"
        )
        ref = oracle_mask(F, S, nb)
        got = lay.teacher_forcing_mask()
        assert torch.equal(got, ref[perm][:, perm]), (F, S, nb, P, R, bal)
        assert torch.equal(single_gpu_teacher_forcing_mask(F, S, nb), ref)
        # every query sees at least one key; clean queries never see noisy keys
        assert bool(got.any(dim=1).all())
        clean = perm < F * S
        assert not bool(got[clean][:, ~clean].any())
        n_cases += 1
    assert n_cases > 100


def test_contiguous_layout_first_principles():
    F, S, nb, P = 8, 3, 2, 4
    lay = BalancedSPLayout(F, S, nb, P)
    Fp = F // P
    for r in range(P):
        clean = list(range(r * Fp * S, (r + 1) * Fp * S))
        noisy = [F * S + g for g in clean]
        assert lay.local_global_ids(r).tolist() == clean + noisy
        pos = [r * Fp + t for t in range(Fp) for _ in range(S)]
        assert lay.rope_frame_positions(r).tolist() == pos + pos
        assert (
            lay.rope_frame_positions(r, per_token=False).tolist()
            == [r * Fp + t for t in range(Fp)] * 2
        )
        assert lay.rank_segments(r) == [(r * Fp, (r + 1) * Fp)]
    # attention order is rank-major [c_0 n_0 c_1 n_1 ...]: the concatenation, no permutation
    assert torch.equal(
        lay.attention_order_global_ids(), torch.cat([lay.local_global_ids(r) for r in range(P)])
    )


@pytest.mark.parametrize(
    "F,S,nb,P,R,bal",
    [
        (8, 3, 2, 4, 1, False),
        (16, 2, 2, 4, 2, True),
        (24, 1, 1, 6, 2, True),
        (24, 2, 2, 6, 3, True),
        (16, 2, 1, 8, 2, False),
    ],
)
def test_inverse_maps_and_partition(F, S, nb, P, R, bal):
    lay = BalancedSPLayout(F, S, nb, P, ring_size=R, ring_balance=bal)
    frames = torch.cat([lay.rank_frames(r) for r in range(P)])
    assert sorted(frames.tolist()) == list(range(F))  # frames partition [0, F)
    for r in range(P):
        fr = lay.rank_frames(r)
        assert fr.numel() == F // P and bool(
            (fr % nb == 0).sum() * nb == fr.numel()
        )  # whole blocks
        local = torch.arange(lay.local_len)
        g = lay.local_to_global(r, local)
        rr, ll = lay.global_to_local(g)
        assert bool((rr == r).all()) and torch.equal(ll, local)
        # identity of each local token: same frames in both halves, clean then noisy
        half = lay.local_len // 2
        assert bool((g[:half] < F * S).all()) and bool((g[half:] >= F * S).all())
        assert torch.equal(g[half:] - F * S, g[:half])
        assert torch.equal(lay.rope_frame_positions(r), (g % (F * S)) // S)
    perm = lay.attention_order_global_ids()
    assert torch.equal(lay.attention_positions(perm), torch.arange(2 * F * S))
    side, frame, block = lay.identity_tables()
    assert torch.equal(side, perm // (F * S)) and torch.equal(block, frame // nb)


def test_block_forms_match_dense():
    for F, S, nb, P, R, bal in [
        (8, 3, 2, 4, 1, False),
        (16, 2, 2, 4, 2, True),
        (12, 2, 1, 4, 2, True),
    ]:
        lay = BalancedSPLayout(F, S, nb, P, ring_size=R, ring_balance=bal)
        dense = lay.teacher_forcing_mask()
        ut = lay.unit_tokens
        assert torch.equal(
            lay.block_mask().repeat_interleave(ut, 0).repeat_interleave(ut, 1), dense
        )
        N = dense.shape[0]
        for bq, bk in [(ut, ut), (5, 7), (4, 4), (N, N), (1, 3), (2 * ut, ut)]:
            st = lay.block_status(bq, bk)
            assert st.tolist() == tile_status_oracle(dense, bq, bk).tolist(), (bq, bk)
        fn = lay.mask_predicate()
        gen = torch.Generator().manual_seed(0)
        for _ in range(50):
            q = torch.randperm(N, generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))]
            k = torch.randperm(N, generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))]
            sub = dense[q][:, k]
            assert torch.equal(fn(q[:, None], k[None, :]), sub)
            want = 2 if bool(sub.all()) else (0 if not bool(sub.any()) else 1)
            assert lay.block_status_ids(q, k) == want


def test_loss_tokens_balanced_and_global_count():
    for F, S, nb, P, R in [(8, 3, 2, 4, 1), (32, 4, 2, 8, 2), (12, 5, 1, 6, 3)]:
        lay = BalancedSPLayout(F, S, nb, P, ring_size=R)
        counts = lay.loss_tokens_per_rank()
        assert counts == [F // P * S] * P
        assert lay.num_loss_tokens == F * S == sum(counts)
        assert max_over_mean(counts) == 1.0
        for r in range(P):  # the loss mask marks exactly the noisy tokens
            assert torch.equal(lay.loss_mask(r), lay.local_global_ids(r) >= F * S)
    # the naive baseline: half the ranks hold no loss token at all
    naive = [int((naive_slice_global_ids(8, 3, 4, r) >= 24).sum()) for r in range(4)]
    assert naive == [0, 0, 12, 12] and max_over_mean(naive) == 2.0


def brute_work_per_ring(lay):
    """Unmasked pairs per ring slice straight from the dense mask."""
    m = lay.teacher_forcing_mask()
    return [int(x) for x in m.sum(dim=1).view(lay.ring_size, -1).sum(dim=1)]


@pytest.mark.parametrize(
    "F,S,nb,P,R",
    [(16, 2, 2, 4, 2), (32, 1, 2, 8, 2), (24, 2, 1, 6, 2), (24, 1, 2, 6, 3), (64, 1, 1, 8, 4)],
)
def test_ring_balance_counts(F, S, nb, P, R):
    bal = BalancedSPLayout(F, S, nb, P, ring_size=R)
    plain = BalancedSPLayout(F, S, nb, P, ring_size=R, ring_balance=False)
    assert bal.ring_balance and not plain.ring_balance
    for lay in (bal, plain):
        assert lay.attention_work_per_ring_rank() == brute_work_per_ring(lay)
        U = lay.ulysses_size
        assert lay.attention_work_per_rank() == [
            w / U for w in brute_work_per_ring(lay) for _ in range(U)
        ]
    assert bal.balance_report()["attention_work_max_over_mean"] <= 1.05
    assert plain.balance_report()["attention_work_max_over_mean"] > 1.05  # the problem is real
    assert bal.balance_report()["loss_tokens_max_over_mean"] == 1.0
    # balancing only changes which frames a rank owns: every rank still holds whole blocks
    for r in range(P):
        assert len(bal.rank_segments(r)) <= 2


def test_naive_work_helper_matches_dense():
    F, S, nb, R = 8, 2, 2, 2
    side, block = naive_identity_units(F, nb)
    m = oracle_mask(F, S, nb)
    want = [int(x) for x in m.sum(dim=1).view(R, -1).sum(dim=1)]
    assert ring_attention_work(side, block, nb * S, R) == want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(num_latent_frames=97, tokens_per_frame=4, frames_per_block=8, sp_size=4),
            r"num_latent_frames \(97\) must be divisible by sp_size \(4\) \* frames_per_block \(8\)",
        ),
        (
            dict(
                num_latent_frames=16,
                tokens_per_frame=4,
                frames_per_block=2,
                sp_size=4,
                world_size=6,
            ),
            r"world_size \(6\) must be divisible by sp_size \(4\)",
        ),
        (
            dict(
                num_latent_frames=16, tokens_per_frame=4, frames_per_block=2, sp_size=4, num_heads=6
            ),
            r"num_heads \(6\) must be divisible by ulysses_size \(4\)",
        ),
        (
            dict(
                num_latent_frames=16,
                tokens_per_frame=4,
                frames_per_block=2,
                sp_size=4,
                ring_size=2,
                num_heads=3,
            ),
            r"num_heads \(3\) must be divisible by ulysses_size \(2\)",
        ),
        (
            dict(
                num_latent_frames=16, tokens_per_frame=4, frames_per_block=2, sp_size=4, ring_size=3
            ),
            r"ring_size \(3\) must divide sp_size \(4\)",
        ),
        (
            dict(
                num_latent_frames=16,
                tokens_per_frame=4,
                frames_per_block=2,
                sp_size=4,
                ring_size=2,
                ulysses_size=4,
            ),
            r"ulysses_size \(4\) \* ring_size \(2\) must equal sp_size \(4\)",
        ),
        (
            dict(
                num_latent_frames=24, tokens_per_frame=1, frames_per_block=2, sp_size=4, ring_size=4
            ),
            r"num_latent_frames \(24\) must be divisible by 2 \* ring_size \(4\) \* frames_per_block \(2\)",
        ),
        (
            dict(num_latent_frames=0, tokens_per_frame=4, frames_per_block=2, sp_size=4),
            r"num_latent_frames \(0\) must be a positive integer",
        ),
        (
            dict(num_latent_frames=8, tokens_per_frame=4.0, frames_per_block=2, sp_size=4),
            r"tokens_per_frame \(4.0\) must be a positive integer",
        ),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancedSPLayout(**kwargs)


def test_rank_and_index_validation():
    lay = BalancedSPLayout(8, 2, 2, 4)
    with pytest.raises(ValueError, match=r"rank \(4\) must be an integer in \[0, sp_size \(4\)\)"):
        lay.local_global_ids(4)
    with pytest.raises(ValueError, match=r"global_ids must lie in"):
        lay.global_to_local(torch.tensor([32]))
    with pytest.raises(ValueError, match=r"q_block_tokens \(0\) must be a positive integer"):
        lay.block_status(0)
    # the unbalanced variant stays valid for any F divisible by P * nb
    assert BalancedSPLayout(24, 1, 2, 4, ring_size=4, ring_balance=False).rank_segments(3) == [
        (18, 24)
    ]


@pytest.mark.parametrize("F,nb", [(7, 2), (9, 4), (3, 2)])
def test_partial_last_block_is_refused_on_every_path(F, nb):
    """One rule for a clip that is not whole blocks (e.g. 7 latent frames in blocks of 2): the
    single-GPU mask, the work accounting and the Balanced SP layout all refuse it."""
    rule = rf"num_latent_frames \({F}\) must be a multiple of frames_per_block \({nb}\)"
    with pytest.raises(ValueError, match=rule):
        single_gpu_teacher_forcing_mask(F, 4, nb)
    with pytest.raises(ValueError, match=rule):
        naive_identity_units(F, nb)
    with pytest.raises(ValueError, match=rf"num_latent_frames \({F}\) must be divisible"):
        BalancedSPLayout(F, 4, nb, 1)
