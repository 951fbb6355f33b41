"""Packed clips placed over the CP ranks (``layouts.placement``) and attended by ``dist_attention``
with routed ring sends, against float64 oracles: the explicit softmax of the whole sequence with a
mask from first principles (``testing.masks.allowed``), and brute-force pair counts."""

import pytest
import torch

from megatron_video.attention import dist_attention, masks
from megatron_video.layouts import shard_global_ids
from megatron_video.layouts.placement import (
    Clip,
    CostModel,
    Placement,
    clip_pairs,
    plan_placement,
    ring_members,
)
from megatron_video.testing import masks as mask_oracles
from megatron_video.testing.oracles import attention_with_grads, random_qkv, rel_max_errors
from megatron_video.testing.parallel import video_parallel


# ------------------------------------------------------------------------------------------
# Pure: the placement value, the cost model, the planner
# ------------------------------------------------------------------------------------------
def test_placement_is_a_checked_immutable_value():
    p = Placement.from_scheme("zigzag", 4, 32)
    for c in range(4):
        assert torch.equal(p.rank_ids(c), shard_global_ids(c, 4, 32, "zigzag"))
        assert torch.equal(shard_global_ids(c, 4, 32, p), p.rank_ids(c))
    rank, local = p.owner()
    for c in range(4):
        assert torch.equal(rank[p.rank_ids(c)], torch.full((8,), c))
        assert torch.equal(local[p.rank_ids(c)], torch.arange(8))
    x = torch.randn(2, 32, 3)
    assert torch.equal(p.unshard([p.shard(x, c) for c in range(4)]), x)
    same = Placement(torch.stack([p.rank_ids(c) for c in range(4)]))
    assert same == p and hash(same) == hash(p) and same.digest == p.digest
    ids = p.rank_ids(0)
    ids[0] = 31  # a copy: the placement is unchanged
    assert p.rank_ids(0)[0] == 0
    assert Placement.from_scheme("contiguous", 4, 32) != p
    with pytest.raises(ValueError, match="exactly once"):
        Placement(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[cp_size, s_local\]"):
        Placement(torch.arange(4))
    with pytest.raises(ValueError, match="cp_rank"):
        p.rank_ids(4)
    with pytest.raises(ValueError, match="seq_len"):
        shard_global_ids(0, 4, 64, p)


@pytest.mark.parametrize(
    "clip,kind",
    [
        (Clip(13), "full"),
        (Clip(13, "causal"), "causal"),
        (Clip(12, "block_causal", 4), "block_causal"),
    ],
)
def test_clip_pairs_count_the_mask(clip, kind):
    assert clip_pairs(clip) == int(mask_oracles.allowed(kind, clip.tokens, block=4).sum())


def test_clip_pairs_teacher_forcing():
    F, S, nb = 4, 3, 2  # frames, tokens per frame, frames per block
    clip = Clip(2 * F * S, "teacher_forcing", nb * S)
    assert clip_pairs(clip) == int(mask_oracles.teacher_forcing_oracle(F, S, nb).sum())


def test_bad_clips_and_plans_raise():
    with pytest.raises(ValueError, match="tokens"):
        Clip(0)
    with pytest.raises(ValueError, match="kind"):
        Clip(4, "diagonal")
    with pytest.raises(ValueError, match="whole number of blocks"):
        Clip(10, "block_causal", 4)
    with pytest.raises(ValueError, match="seq_len"):
        plan_placement([Clip(10)], 2, 2, seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        plan_placement([Clip(10)], 2, 2, seq_len=14)
    with pytest.raises(ValueError, match="clips"):
        plan_placement([], 2, 2)
    with pytest.raises(ValueError, match="pair"):
        CostModel(pair=-1)


def realistic_clips(n=24, seed=0):
    """Durations 2-16 s at 16 fps (latent frames 1 + 4k -> 1 + k), three aspect buckets at a
    small latent area, 20 % images; full attention (T2V)."""
    g = torch.Generator().manual_seed(seed)
    buckets = [(6, 10), (10, 6), (8, 8)]
    clips = []
    for _ in range(n):
        h, w = buckets[int(torch.randint(3, (1,), generator=g))]
        if float(torch.rand(1, generator=g)) < 0.2:
            frames = 1
        else:
            seconds = 2 + 14 * float(torch.rand(1, generator=g))
            frames = 1 + int(seconds * 16) // 4 // 8  # latent frames (coarse, small test sizes)
        clips.append(Clip(frames * h * w))
    return clips


def _check_plan(plan, U, R):
    N, S = U * R, plan.seq_len
    ids = torch.stack([plan.placement.rank_ids(c) for c in range(N)])
    assert torch.equal(torch.sort(ids.flatten()).values, torch.arange(S))
    ring_of_cp = {cp: r for r, grp in enumerate(ring_members(U, R)) for cp in grp}
    rank, _ = plan.placement.owner()
    ring_of_token = torch.tensor([ring_of_cp[int(c)] for c in rank])
    for c, clip in enumerate(plan.clips):
        span = ring_of_token[plan.starts[c] : plan.starts[c] + clip.tokens]
        counts = torch.bincount(span, minlength=R)
        assert tuple(counts.tolist()) == plan.shares[c]
        if plan.ring_of[c] is not None:  # whole: every token on that ring rank's Ulysses group
            assert int(counts[plan.ring_of[c]]) == clip.tokens


@pytest.mark.parametrize("U,R", [(1, 1), (4, 1), (2, 2), (1, 4), (2, 4)])
def test_plan_places_every_token_and_balances(U, R):
    clips = realistic_clips()
    plan = plan_placement(clips, U, R)
    _check_plan(plan, U, R)
    assert plan.pad < U * R
    assert plan.balance() <= 1.05, plan.summary()
    assert plan_placement(clips, U, R) == plan  # deterministic
    assert "attention pairs max/mean" in plan.summary()
    # the plan's pairs per ring rank, recounted: every token sees its whole clip (full attention)
    ring_of_cp = {cp: r for r, grp in enumerate(ring_members(U, R)) for cp in grp}
    rank, _ = plan.placement.owner()
    pairs = [0] * R
    for c, clip in enumerate(clips):
        for t in range(plan.starts[c], plan.starts[c] + clip.tokens):
            pairs[ring_of_cp[int(rank[t])]] += clip.tokens
    assert tuple(pairs) == plan.pairs


def test_teacher_forcing_clips_keep_clean_and_noisy_together():
    F, S, nb = 6, 4, 2
    clips = [Clip(2 * F * S, "teacher_forcing", nb * S) for _ in range(3)] + [Clip(300, "causal")]
    plan = plan_placement(clips, 1, 4, cost=CostModel(token=0.0, ring_token=0.0))
    _check_plan(plan, 1, 4)
    rank, _ = plan.placement.owner()
    for c, clip in enumerate(clips[:3]):
        half = clip.tokens // 2
        clean = rank[plan.starts[c] : plan.starts[c] + half]
        noisy = rank[plan.starts[c] + half : plan.starts[c] + clip.tokens]
        assert torch.equal(clean, noisy)


# ------------------------------------------------------------------------------------------
# Multi-rank: dist_attention under placements, against the whole-sequence oracle
# ------------------------------------------------------------------------------------------
CLIPS = [Clip(10), Clip(3), Clip(17), Clip(1), Clip(9), Clip(8)]  # 48 tokens
CU = [0, 10, 13, 30, 31, 40, 48]


def _placements(U, R, S, seed):
    g = torch.Generator().manual_seed(seed)
    N = U * R
    planned = plan_placement(CLIPS, U, R, cost=CostModel(token=0.0, ring_token=0.0)).placement
    members = ring_members(U, R)
    whole = [[] for _ in range(R)]  # clips grouped by ring rank, then cut into equal shards
    for c, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
        whole[c % R].extend(range(a, b))
    flat = [t for ring in whole for t in ring]
    rows = [None] * N
    for r in range(R):
        for u, cp in enumerate(members[r]):
            rows[cp] = torch.tensor(flat[(r * U + u) * S // N : (r * U + u + 1) * S // N])
    return {
        "planned": planned,
        "random": Placement(torch.randperm(S, generator=g).view(N, -1)),
        "zigzag": Placement.from_scheme("zigzag", N, S),
        "grouped": Placement(torch.stack(rows)),
    }


MASKS = {  # name: (our mask, the oracle's kind and arguments)
    "packed": (lambda: masks.packed(CU), "packed", {}),
    "packed_causal": (lambda: masks.packed(CU, masks.causal()), "packed_causal", {}),
    "packed_block": (
        lambda: masks.packed(CU, masks.block_causal(3)),
        "packed_block",
        dict(inner_block=3),
    ),
}


def _placement_cases(U, R, S=48):
    from megatron_video.parallel import CommTracer

    results = []
    with video_parallel(U, R, ranks_per_node=8) as groups:
        c = groups.cp_rank
        for i, (mname, (make, kind, extra)) in enumerate(MASKS.items()):
            allow = mask_oracles.allowed(kind, S, cu=CU, **extra)
            q, k, v, dout = random_qkv(1, S, 4, 2, 8, seed=i)
            ref = attention_with_grads(q, k, v, dout, allow)
            placements = _placements(U, R, S, seed=i)
            for pname, pl in placements.items():
                ql, kl, vl = (pl.shard(x, c).requires_grad_() for x in (q, k, v))
                with CommTracer() as t:
                    out = dist_attention(ql, kl, vl, groups, mask=make(), scheme=pl)
                    (out * pl.shard(dout, c)).sum().backward()
                got = [out, ql.grad, kl.grad, vl.grad]
                errs = rel_max_errors(got, [pl.shard(x, c) for x in ref])
                comm = (t.bytes("send"), t.count("skip_send"), t.count("skip_recv"))
                results.append(((mname, pname), errs, comm))
            # negative control: the same placement with clips seeing each other must not match
            pl = placements["planned"]
            ql, kl, vl = (pl.shard(x, c) for x in (q, k, v))
            wrong = dist_attention(ql, kl, vl, groups, mask=masks.full(), scheme=pl)
            results.append(((mname, "leaky"), rel_max_errors([wrong], [pl.shard(ref[0], c)]), None))
    return results


@pytest.mark.parametrize("U,R", [(2, 2), (4, 1), (1, 4)], ids=["u2xr2", "u4", "r4"])
def test_placements_exact_vs_oracle(pool8, U, R):
    per_rank = pool8.run(_placement_cases, U, R)
    bad = []
    for rank, results in enumerate(per_rank):
        for case, errs, _ in results:
            leaky = case[1] == "leaky"
            if leaky and not max(errs) > 1e-3:
                bad.append(f"rank {rank} {case}: a leaky mask matched the oracle ({errs})")
            if not leaky and not max(errs) < 1e-10:
                bad.append(f"rank {rank} {case}: errors (out, dq, dk, dv) = {errs}")
    assert not bad, "\n".join(bad)
    # routed sends: skips are counted on both sides (their totals agree over the ring)
    for case_i in range(len(per_rank[0])):
        if per_rank[0][case_i][2] is None:
            continue
        sends = sum(per_rank[r][case_i][2][1] for r in range(4))
        recvs = sum(per_rank[r][case_i][2][2] for r in range(4))
        assert sends == recvs, per_rank[0][case_i][0]
        if R == 1:  # no ring
            assert all(per_rank[r][case_i][2][0] == 0 for r in range(4)), per_rank[0][case_i]


def _ring_bytes_cases(U, R):
    """Ring K/V bytes per rank of a packed micro-batch (whole clips + one split clip), against the
    tokens that must travel: those of the split clip, counted from the plan's shares alone."""
    from megatron_video.parallel import CommTracer

    clips = [Clip(6), Clip(40, "causal"), Clip(2), Clip(8), Clip(4), Clip(4)]
    plan = plan_placement(clips, U, R, cost=CostModel(token=0.0, ring_token=0.0))
    mask = masks.packed(plan.cu_seqlens, masks.causal())
    with video_parallel(U, R, ranks_per_node=8) as groups:
        pl, c = plan.placement, groups.cp_rank
        q, k, v, _ = random_qkv(1, plan.seq_len, 4, 4, 8, seed=0)
        ql, kl, vl = (pl.shard(x, c).float() for x in (q, k, v))
        with CommTracer() as t:
            dist_attention(ql, kl, vl, groups, mask=mask, scheme=pl)
        return plan.shares, plan.ring_of, groups.ring_rank, t.bytes("send", direction="fwd")


def test_whole_clips_add_no_ring_bytes(pool8):
    for rank, (shares, ring_of, r, sent) in enumerate(pool8.run(_ring_bytes_cases, 1, 4)):
        R = len(shares[0])
        split = [c for c, ro in enumerate(ring_of) if ro is None]
        # K/V of ring rank j leave it only for the split clips' tokens it holds, and travel as far
        # as the last ring rank holding a part of one of them (k, v: float32, 4 heads x 8)
        expected = 0
        for i in range(R - 1):
            j = (r - i) % R
            kept = sum(shares[c][j] for c in split)
            holders = [h for h in range(1, R) if any(shares[c][(j + h) % R] for c in split)]
            if kept and holders and i + 1 <= max(holders):
                expected += kept * 2 * 4 * 8 * 4
        assert split, "the plan must split the long clip for this check"
        assert sent == expected, (rank, sent, expected, shares)
