"""Public contracts probed with configurations the feature tests do not list (independent oracles).

* 2D attention (``dist_attention``) on shapes, degrees, masks and dtypes outside the feature tests,
  against a float64 explicit-softmax oracle (outputs and dq, dk, dv), and the scheme contract when
  ``scheme`` is omitted: exact (the layout recorded by ``shard_sequence`` / ``global_token_ids``,
  or any layout for position-independent masks) or a ``ValueError`` before any communication.
* ``init_video_parallel`` with PP = 2 and DP > 1 against Megatron's rank order from first principles.
* ``RingExchange`` / ``ring_shift`` with a shift that is a whole turn (or a ring of one).
* ``BalancedSPLayout`` and ``halo_windows`` against docs/architecture.md (Capabilities 2) derived
by hand; ST-DiT
  index maps and transitions with ``n % P != 0``, ``b > 1``, ``P = 8``.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_video.attention import dist_attention, masks
from megatron_video.layouts import (
    BalancedSPLayout,
    global_token_ids,
    halo_windows,
    shard_sequence,
    unshard_sequence,
)
from megatron_video.testing.masks import (
    allowed,
    mask_for,
    teacher_forcing_oracle,
    tile_status_oracle,
)
from megatron_video.testing.oracles import softmax_attention
from megatron_video.testing.parallel import model_parallel, video_parallel

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


# ------------------------------------------------------------------------------------------
# Attention oracle and masks from their definitions
# ------------------------------------------------------------------------------------------
def _params(kind, extra):
    """The mask parameter ``extra`` as ``testing.masks`` keywords."""
    return {
        "block_causal": dict(block=extra),
        "packed": dict(cu=extra),
        "packed_causal": dict(cu=extra),
        "window": dict(window=extra),
    }.get(kind, {})


def _allowed(kind, S, extra):
    return allowed(kind, S, **_params(kind, extra))


def _mask(kind, extra):
    return mask_for(kind, **_params(kind, extra))


def _case_errors(groups, case, seed):
    """Relative max errors (out, dq, dk, dv) of this rank's shard; ``scheme`` passed only if asked."""
    kind, extra, scheme, pass_scheme, b, S, h, hk, d, dtype, scale = case
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, S, n, d, generator=g, dtype=F64) for n in (h, hk, hk, h))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = softmax_attention(
        *ref_in, _allowed(kind, S, extra), scale if scale is not None else d**-0.5
    )
    (ref * do).sum().backward()
    refs = [ref.detach()] + [x.grad for x in ref_in]
    shard = lambda x: shard_sequence(x, groups, dim=1, scheme=scheme)  # noqa: E731
    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    kw = dict(mask=_mask(kind, extra))
    if scale is not None:
        kw["softmax_scale"] = scale
    if pass_scheme:
        kw["scheme"] = scheme
    out = dist_attention(ql, kl, vl, groups, **kw)
    (out * shard(do).to(dtype)).sum().backward()
    got = [out.detach(), ql.grad, kl.grad, vl.grad]
    assert not any(bool(torch.isnan(x).any()) for x in got), case
    return [
        float((a.double() - shard(r)).abs().max() / max(1.0, float(r.abs().max())))
        for a, r in zip(got, refs)
    ]


def _C(kind, extra, scheme, pass_scheme, b, S, h, hk, d, dtype=F64, scale=None):
    return (kind, extra, scheme, pass_scheme, b, S, h, hk, d, dtype, scale)


# (tp, U, R, placement, megatron hierarchical groups, ranks_per_node, pp) -> cases; world 8
ATTENTION_PLAN = [
    # CP 8 = U4 x R2 (and R4 x U2 ring-inner): odd head dims, batch 3, GQA kv=1 replicated over U=4,
    # causal under the contiguous layout, block-causal blocks straddling shards, a document boundary
    # inside a chunk with padding at the end, a sliding-window predicate, fp32 / bf16, custom scale.
    (
        (1, 4, 2, "ulysses_inner", True, 4, 1),
        [
            _C("causal", None, "contiguous", True, 2, 40, 4, 1, 40),
            _C("block_causal", 13, "contiguous", True, 3, 40, 8, 8, 24, F64, 0.37),
            _C("packed", [0, 7, 8, 31], "zigzag", True, 1, 48, 4, 4, 24),
            _C("window", 9, "zigzag", True, 2, 48, 4, 2, 8, F32),
            _C("causal", None, "zigzag", True, 2, 48, 4, 1, 8, BF16),
            # scheme given explicitly (required for position-dependent masks); omitted for full()
            _C("causal", None, "contiguous", True, 1, 48, 4, 2, 24),
            _C("packed_causal", [0, 7, 8, 31], "zigzag", True, 1, 48, 4, 4, 8),
            _C("window", 9, "zigzag", True, 2, 48, 4, 2, 8),
            _C("full", None, "zigzag", False, 2, 48, 4, 2, 24, F64, 0.11),
        ],
    ),
    (
        (1, 2, 4, "ring_inner", False, 8, 1),
        [
            _C("causal", None, "contiguous", True, 3, 40, 4, 2, 40),
            _C("block_causal", 7, "zigzag", True, 1, 48, 2, 1, 24),
            _C("packed", [0, 5, 19, 37], "contiguous", True, 2, 40, 2, 2, 8, BF16, 0.5),
        ],
    ),
    # CP 2 with DP 4 (and TP 2; PP 2): 6 heads over U = 2, kv heads split / replicated
    (
        (1, 2, 1, "ulysses_inner", False, 4, 2),
        [
            _C("causal", None, "contiguous", True, 3, 10, 6, 6, 40),
            _C("causal", None, "zigzag", True, 3, 12, 6, 2, 24),
            _C("block_causal", 5, "zigzag", True, 1, 20, 6, 1, 24, F32),
        ],
    ),
    (
        (2, 1, 2, "ring_inner", False, 4, 2),
        [
            _C("packed", [0, 3, 11, 14], "zigzag", True, 2, 20, 6, 2, 40, BF16, 0.5),
            _C("window", 4, "contiguous", True, 2, 14, 6, 3, 24),
        ],
    ),
]


def _attention_contract(i, cfg, cases):
    """The cases of plan entry ``i`` (seeds ``100 i + j``); entry 0 also checks the errors."""
    from megatron_video.parallel import CommTracer

    tp, U, R, placement, hier, rpn, pp = cfg
    results, errors = [], []
    with video_parallel(
        U, R, placement, tp=tp, pp=pp, hierarchical=hier, ranks_per_node=rpn
    ) as groups:
        for j, case in enumerate(cases):
            results.append((cfg, case, _case_errors(groups, case, seed=100 * i + j)))
        if i == 0:
            errors = _error_contract(groups, CommTracer)
    return results, errors


def _error_contract(groups, CommTracer):
    """Position-dependent mask and no scheme: ValueError naming ``scheme`` even right after a
    ``shard_sequence`` call with the same groups (nothing is remembered between calls); a bad
    predicate: ValueError before the all-to-all. Both before any communication."""
    out = []
    x = shard_sequence(torch.randn(1, 6 * groups.cp_size, 4, 8), groups, dim=1, scheme="zigzag")
    for kw in (
        dict(mask=masks.causal()),
        dict(mask=masks.predicate(lambda q, k: (q >= k).int()), scheme="contiguous"),
    ):
        with CommTracer() as t:
            try:
                dist_attention(x, x, x, groups, **kw)
                out.append(("no error", -1))
            except ValueError as e:
                out.append((str(e), len(t.events)))
    # a position-independent mask needs no layout at all: exact under any layout
    out.append(("full-ok", tuple(dist_attention(x, x, x, groups, mask=masks.full()).shape)))
    return out


def _plan_id(entry):
    tp, U, R, placement, _, rpn, pp = entry[0]
    return f"tp{tp}-pp{pp}-u{U}xr{R}-{placement}-rpn{rpn}"


@pytest.mark.parametrize("i", range(len(ATTENTION_PLAN)), ids=[_plan_id(e) for e in ATTENTION_PLAN])
def test_dist_attention_contract_unlisted_configs(pool8, i):
    for rank, (results, errors) in enumerate(pool8.run(_attention_contract, i, *ATTENTION_PLAN[i])):
        bad = []
        for cfg, case, errs in results:
            dtype = case[9]
            tol = 2.5e-2 if dtype == BF16 else (1e-5 if dtype == F32 else 1e-10)
            if not max(errs) < tol:
                bad.append(f"rank {rank} {cfg} {case}: (out, dq, dk, dv) errors {errs}")
        assert not bad, "\n".join(bad)
        if i != 0:
            continue
        (msg0, ev0), (msg1, ev1), full = errors
        assert "scheme (None) must be given" in msg0 and ev0 == 0, (msg0, ev0)
        assert "bool tensor" in msg1 and ev1 == 0, (msg1, ev1)
        assert full == ("full-ok", (1, 6, 4, 8))


def test_dist_attention_single_rank_any_length():
    """One CP rank: both layouts are the identity, so an odd length works for every mask (the
    default zigzag of ``causal()`` or the Megatron adapter's explicit ``scheme="zigzag"``)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 4, 24, generator=g, dtype=F64) for _ in range(3))
    for kind, extra, kw in [
        ("causal", None, {}),
        ("causal", None, dict(scheme="zigzag")),
        ("block_causal", 3, {}),
        ("full", None, dict(scheme="zigzag")),
    ]:
        out = dist_attention(q, k, v, None, mask=_mask(kind, extra), **kw)
        ref = softmax_attention(q, k, v, _allowed(kind, 7, extra), 24**-0.5)
        assert (out - ref).abs().max() < 1e-12, (kind, kw)


def test_layout_functions_are_stateless():
    """``shard_sequence`` / ``global_token_ids`` leave the groups object as it was (no scheme is
    recorded for a later ``dist_attention`` to pick up)."""
    import copy

    from megatron_video.parallel.topology import VideoParallelGroups

    G = VideoParallelGroups(
        None, None, None, None, None, None, list(range(4)), [0, 1], [0, 2], 2, 2, 1, 1, 0
    )
    before = copy.deepcopy(vars(G))
    shard_sequence(torch.zeros(1, 16), G, dim=1, scheme="zigzag")
    assert torch.equal(global_token_ids(G, 16, "contiguous"), torch.arange(4, 8))
    with pytest.raises(ValueError, match="seq_len"):
        shard_sequence(torch.zeros(1, 12), G, dim=1, scheme="zigzag")
    assert vars(G) == before
    for bad in (2, -3):  # out of range: an error naming dim, not a wrap onto another dim
        with pytest.raises(ValueError, match=rf"dim \({bad}\) must be an integer in \[-2, 2\)"):
            shard_sequence(torch.zeros(4, 8), dim=bad, cp_rank=0, cp_size=2)
        with pytest.raises(ValueError, match=rf"dim \({bad}\)"):
            unshard_sequence([torch.zeros(4, 8)] * 2, dim=bad)
    x = torch.arange(3 * 24).reshape(3, 24)
    for scheme in ("zigzag", "contiguous"):
        parts = [shard_sequence(x, dim=-1, scheme=scheme, cp_rank=c, cp_size=4) for c in range(4)]
        assert torch.equal(unshard_sequence(parts, dim=-1, scheme=scheme), x)
        for c in range(4):
            assert torch.equal(
                parts[c], x[:, global_token_ids(None, 24, scheme, cp_rank=c, cp_size=4)]
            )


# ------------------------------------------------------------------------------------------
# Topology with PP = 2 and DP > 1; ring exchange by a whole turn
# ------------------------------------------------------------------------------------------
TOPO8 = [  # tp, pp, U, R, placement, hierarchical sizes, ranks_per_node
    (1, 2, 2, 1, "ulysses_inner", None, 4),
    (2, 2, 2, 1, "ulysses_inner", None, 4),
    (1, 2, 2, 2, "ulysses_inner", [2, 2], 4),
    (1, 2, 2, 2, "ring_inner", [2, 2], 8),
    (1, 2, 2, 2, "ring_inner", None, 8),
    (2, 2, 1, 2, "ring_inner", None, 2),
]


def _expected_topology(world, tp, pp, U, R, placement):
    """Megatron's order tp-cp-ep-dp-pp: global rank = t + TP*(c + CP*(d + DP*p))."""
    cp = U * R
    dp = world // (tp * cp * pp)
    exp = {}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                G = lambda c: t + tp * (c + cp * (d + dp * p))  # noqa: E731
                ci = (
                    (lambda u, r: r * U + u)
                    if placement == "ulysses_inner"
                    else (lambda u, r: u * R + r)
                )
                for u in range(U):
                    for r in range(R):
                        exp[G(ci(u, r))] = dict(
                            ulysses=[G(ci(x, r)) for x in range(U)],
                            ring=[G(ci(u, y)) for y in range(R)],
                            cp=[G(c) for c in range(cp)],
                            u=u,
                            r=r,
                            c=ci(u, r),
                            dp=[t + tp * (ci(u, r) + cp * (x + dp * p)) for x in range(dp)],
                        )
    return exp


def _topology(tp, pp, U, R, placement, hier, rpn):
    from megatron_video.parallel import init_video_parallel

    with model_parallel(tp=tp, pp=pp, cp=U * R, hierarchical_cp=hier):
        g = init_video_parallel(U, R, ranks_per_node=rpn, placement=placement)
        s = torch.ones(1)
        dist.all_reduce(s, group=g.ulysses_group)
        return dict(
            ulysses=g.ulysses_ranks,
            ring=g.ring_ranks,
            cp=g.cp_ranks,
            u=g.ulysses_rank,
            r=g.ring_rank,
            c=g.cp_rank,
            dp=dist.get_process_group_ranks(g.dp_group),
            usum=int(s.item()),
        )


def _ring_and_dims():
    from megatron_video.parallel import RingExchange, ring_shift

    # a whole turn (or a ring of one) is a local copy: no self-send, which gloo cannot do
    world, me = dist.get_world_size(), dist.get_rank()
    everyone = dist.new_group(list(range(world)))
    alone = [dist.new_group([r]) for r in range(world)][me]
    x = torch.full((2, 3), float(me), dtype=F64, requires_grad=True)
    ring = []
    for group, shift in [
        (everyone, 0),
        (everyone, world),
        (everyone, -world),
        (alone, 1),
        (everyone, 1),
    ]:
        got = RingExchange([x.detach(), 2 * x.detach()], group, shift).wait()
        y = ring_shift(x, group, shift)
        (y * (me + 1)).sum().backward()
        ring.append(
            (shift, got[0][0, 0].item(), got[1][0, 0].item(), y[0, 0].item(), x.grad[0, 0].item())
        )
        x.grad = None
    # a dim outside [-nd, nd) is an error, not silently wrapped onto another dim (before any comm)
    from megatron_video.parallel import all_to_all

    dims = []
    for sd, gd in [(2, 0), (0, -3), (1, 0)]:
        try:
            dims.append(tuple(all_to_all(torch.zeros(8, 8), everyone, sd, gd).shape))
        except ValueError as e:
            dims.append(str(e))
    return ring, dims


def _topo_id(c):
    tp, pp, U, R, placement, hier, rpn = c
    return f"tp{tp}-pp{pp}-u{U}xr{R}-{placement}-{'hier' if hier else 'flat'}-rpn{rpn}"


@pytest.mark.parametrize("i", range(len(TOPO8)), ids=[_topo_id(c) for c in TOPO8])
def test_topology_with_pipeline_and_data_parallel(pool8, i):
    tp, pp, U, R, placement, hier, rpn = TOPO8[i]
    exp = _expected_topology(8, tp, pp, U, R, placement)
    for rank, got in enumerate(pool8.run(_topology, *TOPO8[i])):
        assert got["usum"] == U
        for key, val in exp[rank].items():
            assert got[key] == val, (TOPO8[i], rank, key, got[key], val)


def test_ring_full_turn_and_dim_checks(pool8):
    for rank, (ring, dims) in enumerate(pool8.run(_ring_and_dims)):
        assert "scatter_dim (2) must be an integer in [-2, 2)" in dims[0], dims
        assert "gather_dim (-3)" in dims[1] and dims[2] == (64, 1), dims
        for shift, a, b, y, grad in ring[:4]:
            assert (a, b, y, grad) == (rank, 2 * rank, rank, rank + 1), (rank, shift)
        shift, a, b, y, grad = ring[4]  # a real shift by one: from rank-1; gradient from rank+1
        assert (a, b, y, grad) == (
            (rank - 1) % 8,
            2 * ((rank - 1) % 8),
            (rank - 1) % 8,
            (rank + 1) % 8 + 1,
        )


# ------------------------------------------------------------------------------------------
# Balanced SP and the VAE halo from docs/architecture.md (Capabilities 2), by hand
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "F,S,nb,P",
    [
        (1, 1, 1, 1),
        (4, 3, 1, 2),
        (6, 5, 3, 1),
        (8, 1, 2, 4),
        (12, 2, 3, 4),
        (6, 2, 1, 3),
        (16, 1, 2, 8),
        (2, 7, 1, 2),
    ],
)
def test_balanced_sp_first_principles(F, S, nb, P):
    L = BalancedSPLayout(F, S, nb, P)
    Fp = F // P
    gid = lambda side, f, s: side * F * S + f * S + s  # noqa: E731  single-GPU [clean ; noisy]
    order = []
    for r in range(P):
        local = [gid(side, r * Fp + t, s) for side in (0, 1) for t in range(Fp) for s in range(S)]
        assert L.local_global_ids(r).tolist() == local
        order += local
        assert L.rope_frame_positions(r).tolist() == [
            r * Fp + t for _ in (0, 1) for t in range(Fp) for _s in range(S)
        ]
    assert L.attention_order_global_ids().tolist() == order  # rank-major, no permutation
    assert L.loss_tokens_per_rank() == [Fp * S] * P and L.num_loss_tokens == F * S

    M = teacher_forcing_oracle(F, S, nb)[order][:, order]
    assert torch.equal(L.teacher_forcing_mask(), M)
    ut = nb * S
    assert torch.equal(L.block_mask(), M[::ut, ::ut])
    for bq, bk in [(1, 1), (3, 5), (ut + 1, 2 * ut)]:
        assert L.block_status(bq, bk).tolist() == tile_status_oracle(M, bq, bk).tolist()


def test_halo_windows_by_hand():
    for F in (1, 4, 6, 8, 12):
        for P in (1, 2, 3, 4):
            if F % P:
                with pytest.raises(
                    ValueError, match=r"num_latent_frames \(\d+\) must be divisible by sp_"
                ):
                    halo_windows(F, P, 1)
                continue
            for h in (0, 1, 2, 5):
                for st in (1, 4):
                    n = F // P
                    for r, w in enumerate(halo_windows(F, P, h, temporal_stride=st)):
                        ls, le = r * n, (r + 1) * n
                        hs = max(0, ls - h)
                        start, pseudo = (0, 0) if hs == 0 else (st * (hs - 1), 1)
                        assert (w.latent_start, w.latent_end, w.halo_start) == (ls, le, hs)
                        assert (w.raw_start, w.raw_end) == (start, 1 + st * (le - 1)), (
                            F,
                            P,
                            h,
                            st,
                            r,
                        )
                        assert (w.pseudo, w.drop) == (pseudo, pseudo + ls - hs)
                        # the window's encoding: 1 first-frame latent + (frames - 1) / stride
                        assert w.num_window_latents == 1 + (w.raw_end - w.raw_start - 1) // st
    for args, name in [
        ((8, 0, 1), "sp_size"),
        ((8, 2, -1), "halo_latents"),
        ((0, 1, 1), "num_latent_frames"),
        ((8, 2, 1, 0), "temporal_stride"),
        ((8, 2, None), "halo_latents"),
    ]:
        with pytest.raises(ValueError, match=name):
            halo_windows(*args)


# ------------------------------------------------------------------------------------------
# ST-DiT index maps and transitions: n % P != 0, b > 1, P = 8
# ------------------------------------------------------------------------------------------
def test_stdit_index_maps_padding_p8():
    from megatron_video.layouts import stdit as L

    for t, n, P in [(8, 5, 8), (8, 3, 8), (16, 13, 8), (4, 7, 4)]:
        m, tl = -(-n // P), t // P
        for r in range(P):
            a = [f * n + p for f in range(r * tl, (r + 1) * tl) for p in range(n)]
            b = [f * n + p if p < n else -1 for p in range(r * m, (r + 1) * m) for f in range(t)]
            assert L.layout_a_indices(r, t, n, P).tolist() == a
            assert L.layout_b_indices(r, t, n, P).tolist() == b
            real = torch.tensor([x for x in b if x >= 0], dtype=torch.long)
            if real.numel():
                own, loc = L.layout_b_owner(real, t, n, P)
                assert (own == r).all() and [b[i] for i in loc.tolist()] == real.tolist()


def _stdit_transitions(cases):
    from megatron_video.attention.stdit_transitions import frames_to_positions, positions_to_frames
    from megatron_video.layouts.stdit import shard_layout_a, shard_layout_b

    world, me = dist.get_world_size(), dist.get_rank()
    out = []
    for P, b, t, n, extra in cases:
        group = [dist.new_group(list(range(i, i + P))) for i in range(0, world, P)][me // P]
        r = dist.get_rank(group)
        gen = torch.Generator().manual_seed(100 * P + 10 * t + n)
        video = torch.randn((b, t, n) + extra, generator=gen, dtype=F64)
        weights = [
            torch.randn(shard_layout_b(video, q, P).shape, generator=gen, dtype=F64)
            for q in range(P)
        ]
        xa = shard_layout_a(video, r, P).clone().requires_grad_()
        xb = frames_to_positions(xa, group, t, n)
        back = positions_to_frames(xb, group, t, n)
        (xb * weights[r]).sum().backward()
        full = video.clone().requires_grad_()
        sum((shard_layout_b(full, q, P) * weights[q]).sum() for q in range(P)).backward()
        out.append(
            (
                torch.equal(xb, shard_layout_b(video, r, P)),
                torch.equal(back, xa),
                torch.equal(xa.grad, shard_layout_a(full.grad, r, P)),
            )
        )
    return out


def test_stdit_transitions_p8_padding_batch(pool8):
    cases = [(8, 3, 8, 5, ()), (8, 2, 16, 3, (4,)), (8, 1, 8, 13, (2, 3)), (4, 3, 4, 7, (5,))]
    for rank, res in enumerate(pool8.run(_stdit_transitions, cases)):
        for case, ok in zip(cases, res):
            assert all(ok), (rank, case, ok)
