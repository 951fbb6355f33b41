"""2D attention (Ulysses x ring) against a float64 explicit-softmax oracle of the whole sequence.

Every rank builds the same full q, k, v, dout, computes the oracle (and its gradients) on one
process, runs ``dist_attention`` on its shard and compares its shard of the outputs AND of dq, dk,
dv; together the ranks cover the whole sequence (``shard_sequence`` is a tested bijection). Each
parallel configuration is its own test case (one ``pool.run``), covering its masks and schemes; all
of them use the 8-rank pool (CP degrees below 8 run as DP replicas of the same case), so the
attention tests start no other pool.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron_video.attention import RingStats, dist_attention, masks
from megatron_video.layouts import global_token_ids, shard_sequence
from megatron_video.testing import masks as mask_oracles
from megatron_video.testing.masks import mask_for
from megatron_video.testing.oracles import attention_with_grads, random_qkv, rel_max_errors
from megatron_video.testing.parallel import video_parallel

# ------------------------------------------------------------------------------------------
# First-principles masks (independent of megatron_video.attention.masks)
# ------------------------------------------------------------------------------------------
S4, S8 = 32, 48  # sequence lengths on the 4- and 8-rank pools (divisible by 2N)
WORLD = 8  # the 8-rank pool, one simulated node unless a test says otherwise
CU = [0, 3, 11, 12, 25, 29]  # uneven packed documents; tokens past 29 are padding


def allowed(kind, S, seed=0):
    """Bool ``[S, S]`` (True = attend) straight from each mask's definition."""
    if kind in ("random", "dead_rows"):
        g = torch.Generator().manual_seed(1000 + seed)
        a = torch.rand(S, S, generator=g) < (0.4 if kind == "random" else 0.15)
        if kind == "dead_rows":
            a[::5] = False  # rows with no visible key
        return a
    return mask_oracles.allowed(kind, S, block=5, cu=CU)


def make_mask(kind, S, seed=0):
    if kind in ("random", "dead_rows"):
        table = allowed(kind, S, seed)
        return masks.predicate(lambda qi, ki: table[qi, ki])
    return mask_for(kind, block=5, cu=CU)


# ------------------------------------------------------------------------------------------
# Rank-side helpers
# ------------------------------------------------------------------------------------------
def run_case(
    groups,
    S,
    kind,
    b,
    h,
    hk,
    d,
    seed,
    scheme=None,
    dtype=torch.float64,
    stats=None,
    backend="auto",
    tile=512,
):
    """Max abs errors (out, dq, dk, dv) of this rank's shard against the oracle, and a NaN flag."""
    q, k, v, dout = random_qkv(b, S, h, hk, d, seed)
    scale = d**-0.5 * 1.3
    ref = attention_with_grads(q, k, v, dout, allowed(kind, S, seed), scale)
    mask = make_mask(kind, S, seed)
    scheme = scheme or mask.default_scheme
    shard = lambda x: shard_sequence(x, groups, dim=1, scheme=scheme)  # noqa: E731
    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    out = dist_attention(
        ql,
        kl,
        vl,
        groups,
        mask=mask,
        softmax_scale=scale,
        scheme=scheme,
        backend=backend,
        stats=stats,
        tile=tile,
    )
    (out * shard(dout).to(dtype)).sum().backward()
    got = [out.detach(), ql.grad, kl.grad, vl.grad]
    nan = any(bool(torch.isnan(x).any()) for x in got)
    return rel_max_errors(got, [shard(r) for r in ref]), nan


# ------------------------------------------------------------------------------------------
# Correctness over degrees, placements, masks, schemes, GQA and batch
# ------------------------------------------------------------------------------------------
MASK_SCHEMES = [
    ("full", "contiguous"),
    ("causal", "zigzag"),
    ("causal", "contiguous"),
    ("block_causal", "zigzag"),
    ("packed", "contiguous"),
    ("packed_causal", "zigzag"),
    ("random", "contiguous"),
    ("dead_rows", "contiguous"),
    ("dead_rows", "zigzag"),
]


def _degree_cases(U, R, placement, S, i0):
    """Every mask / scheme under one degree; ``i0`` (the degree's index x the number of masks)
    keeps each case's seed, batch and kv heads independent of how the degrees are split up."""
    results = []
    with video_parallel(U, R, placement, ranks_per_node=WORLD) as groups:
        for i, (kind, scheme) in enumerate(MASK_SCHEMES, start=i0):
            # cycle batch and GQA so every degree sees MHA, split and replicated kv heads
            b = 1 + i % 2
            hk = (4, 2, 1)[i % 3]
            errs, nan = run_case(groups, S, kind, b, 4, hk, 8, seed=i, scheme=scheme)
            results.append(((U, R, placement, kind, scheme, b, hk), errs, nan))
    return results


def _assert_results(per_rank, tol):
    """Every failing (rank, case) in one message, so one failure hides no other."""
    bad = []
    for rank, results in enumerate(per_rank):
        for case, errs, nan in results:
            if nan:
                bad.append(f"NaN on rank {rank} in {case}")
            elif not max(errs) < tol:
                bad.append(f"rank {rank} case {case}: errors (out, dq, dk, dv) = {errs}")
    assert not bad, "\n".join(bad)


def _degree_id(d):
    U, R, placement = d
    return f"u{U}xr{R}-{placement}"


DEGREES4 = [
    (1, 1, "ulysses_inner"),
    (1, 4, "ulysses_inner"),
    (4, 1, "ulysses_inner"),
    (2, 2, "ulysses_inner"),
    (2, 2, "ring_inner"),
    (1, 4, "ring_inner"),
    (4, 1, "ring_inner"),
]
DEGREES8 = [
    (2, 4, "ulysses_inner"),
    (4, 2, "ulysses_inner"),
    (2, 4, "ring_inner"),
    (4, 2, "ring_inner"),
]


@pytest.mark.parametrize("index", range(len(DEGREES4)), ids=[_degree_id(d) for d in DEGREES4])
def test_exact_vs_oracle_cp4_and_below(pool8, index):
    _assert_results(
        pool8.run(_degree_cases, *DEGREES4[index], S4, index * len(MASK_SCHEMES)), 1e-10
    )


@pytest.mark.parametrize("index", range(len(DEGREES8)), ids=[_degree_id(d) for d in DEGREES8])
def test_exact_vs_oracle_cp8(pool8, index):
    _assert_results(
        pool8.run(_degree_cases, *DEGREES8[index], S8, index * len(MASK_SCHEMES)), 1e-10
    )


def _gqa_cases(U, R, h, hk):
    """Head counts where H_kv neither divides nor is divisible by U (kv heads enter as lcm(H_kv, U))."""
    out = []
    with video_parallel(U, R, "ulysses_inner", ranks_per_node=WORLD) as groups:
        for kind, scheme in [
            ("causal", "zigzag"),
            ("packed_causal", "zigzag"),
            ("full", "contiguous"),
        ]:
            S = 8 * U * R
            errs, nan = run_case(
                groups, S, kind, 1, h, hk, 4, seed=U + R + h, scheme=scheme, tile=3
            )
            out.append(((U, R, h, hk, kind), errs, nan))
    return out


@pytest.mark.parametrize(
    "U,R,h,hk", [(2, 2, 6, 3), (2, 1, 6, 3), (4, 1, 12, 3), (4, 2, 12, 3), (2, 4, 10, 5)]
)
def test_gqa_any_head_counts_exact(pool8, U, R, h, hk):
    _assert_results(pool8.run(_gqa_cases, U, R, h, hk), 1e-10)


def _low_precision_cases(U, R, placement):
    out = []
    with video_parallel(U, R, placement, ranks_per_node=WORLD) as groups:
        for kind, hk, dtype in [
            ("causal", 2, torch.bfloat16),
            ("dead_rows", 1, torch.bfloat16),
            ("block_causal", 4, torch.float32),
            ("full", 2, torch.float32),
        ]:
            errs, nan = run_case(groups, S4, kind, 2, 4, hk, 16, seed=7, dtype=dtype)
            out.append(((U, R, placement, kind, hk, str(dtype)), errs, nan))
    return out


@pytest.mark.parametrize(
    "degree",
    [(2, 2, "ulysses_inner"), (1, 4, "ulysses_inner"), (4, 1, "ring_inner")],
    ids=_degree_id,
)
def test_bf16_and_fp32_fused_kernel(pool8, degree):
    """bf16 within 2.5e-2 and fp32 (CPU flash kernel) within 1e-5 of the float64 oracle."""
    bad = []
    for rank, results in enumerate(pool8.run(_low_precision_cases, *degree)):
        for case, errs, nan in results:
            tol = 2.5e-2 if "bfloat16" in case[-1] else 1e-5
            if nan or not max(errs) < tol:
                bad.append(f"rank {rank} {case}: nan={nan} {errs}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------
# Skipped ring work equals the count of fully masked tiles (first principles)
# ------------------------------------------------------------------------------------------
def _runs(ids, starts=()):
    ids = ids.tolist()
    runs, start = [], 0
    for p in range(1, len(ids) + 1):
        if p == len(ids) or ids[p] != ids[p - 1] + 1 or ids[p] in starts:
            runs.append(ids[start:p])
            start = p
    return runs


def _tiles(ids, tile, starts=()):
    """Runs of consecutive ids (a new one at each id of ``starts``: packed documents never share
    a tile), each cut into tiles of ``tile`` ids (the last may be shorter)."""
    return [run[a : a + tile] for run in _runs(ids, starts) for a in range(0, len(run), tile)]


def _reaching(held, r, kind, S):
    """The keys of each ring rank that reach ring rank ``r`` (None: none). Packed documents: a
    ring rank's keys leave it only when another ring rank holds a query of their document, and
    travel up to the furthest such rank; every other mask sends everything everywhere."""
    R = len(held)
    if kind != "packed":
        return list(held)
    doc = _doc_of(S)
    docs = [set(doc[held[j]].tolist()) - {-1} for j in range(R)]
    out = []
    for j in range(R):
        hop = (r - j) % R
        users = [i for i in range(1, R) if docs[(j + i) % R] & docs[j]]
        if hop == 0:
            out.append(held[j])
        elif users and hop <= max(users):
            wanted = set().union(*(docs[(j + i) % R] for i in users))
            out.append(held[j][torch.tensor([int(doc[t]) in wanted for t in held[j]])])
        else:
            out.append(None)
    return out


def _doc_of(S):
    """Document of every id under ``CU`` (-1: padding past the last offset)."""
    doc = torch.full((S,), -1)
    for d, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
        doc[a:b] = d
    return doc


def _skip_cases(S, U, R, placement):
    out = []
    with video_parallel(U, R, placement, ranks_per_node=WORLD) as groups:
        # Each ring member's ids during ring attention = the union of its Ulysses group's shards,
        # learnt from the ranks themselves (not from the library's index map).
        for kind, scheme in [
            ("causal", "zigzag"),
            ("causal", "contiguous"),
            ("block_causal", "zigzag"),
            ("packed", "contiguous"),
            ("dead_rows", "zigzag"),
        ]:
            mine = global_token_ids(groups, S, scheme)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (dist.get_rank(), groups.ulysses_ranks, mine))
            shard_of = {g: ids for g, _, ids in everyone}
            ugroup_of = {g: ug for g, ug, _ in everyone}
            held = [
                torch.sort(torch.cat([shard_of[m] for m in ugroup_of[g]])).values
                for g in groups.ring_ranks
            ]
            allow = allowed(kind, S, seed=3)
            q_ids = held[groups.ring_rank]
            reaching = _reaching(held, groups.ring_rank, kind, S)
            for tile in (3, 512):  # 3 divides no run length; 512 = whole runs
                exp = dict(steps=0, steps_skipped=0, tiles=0, tiles_skipped=0, tiles_full=0)
                for kv_ids in reaching:
                    if kv_ids is None:  # routed away: a skipped step without tiles
                        exp["steps"] += 1
                        exp["steps_skipped"] += 1
                        continue
                    starts = set(CU[1:]) if kind == "packed" else ()
                    cells = [
                        allow[qt][:, kt]
                        for qt in _tiles(q_ids, tile, starts)
                        for kt in _tiles(kv_ids, tile, starts)
                    ]
                    exp["steps"] += 1
                    exp["steps_skipped"] += int(not any(bool(c.any()) for c in cells))
                    exp["tiles"] += len(cells)
                    exp["tiles_skipped"] += sum(1 for c in cells if not c.any())
                    exp["tiles_full"] += sum(1 for c in cells if c.all())
                stats = RingStats()
                errs, nan = run_case(
                    groups, S, kind, 1, 4, 2, 8, seed=3, scheme=scheme, stats=stats, tile=tile
                )
                out.append(
                    ((U, R, placement, kind, scheme, tile), exp, stats, errs, nan, groups.ring_rank)
                )
    return out


@pytest.mark.parametrize(
    "degree",
    [(1, 4, "ulysses_inner"), (2, 2, "ulysses_inner"), (2, 2, "ring_inner")],
    ids=_degree_id,
)
def test_skipped_steps_match_masked_tiles(pool8, degree):
    per_rank = pool8.run(_skip_cases, S4, *degree)
    for rank, results in enumerate(per_rank):
        for case, exp, st, errs, nan, _ in results:
            assert max(errs) < 1e-10 and not nan, (rank, case, errs)
            got = dict(
                steps=st.steps,
                steps_skipped=st.steps_skipped,
                tiles=st.tiles,
                tiles_skipped=st.tiles_skipped,
                tiles_full=st.tiles_full,
            )
            assert got == exp, (rank, case, got, exp)
            bwd = dict(
                steps=st.bwd_steps,
                steps_skipped=st.bwd_steps_skipped,
                tiles=st.bwd_tiles,
                tiles_skipped=st.bwd_tiles_skipped,
            )
            assert bwd == {k: exp[k] for k in bwd}, (rank, case, bwd, exp)
            # float64 runs the math kernel: no call ever holds more than one tile pair of scores
            tile = case[-1]
            assert 0 < st.max_score_elements <= tile * tile, (rank, case, st.max_score_elements)
            assert st.max_mask_elements <= tile * tile, (rank, case, st.max_mask_elements)
    # Hand-derived numbers for the balanced layouts (ring rank r of R = 4, and of R = 2), whole runs:
    for _rank, results in enumerate(per_rank):
        by_case = {c: (st, r) for c, _, st, _, _, r in results}
        if degree == (1, 4, "ulysses_inner"):
            # causal contiguous, pure ring: the KV blocks of every later ring rank are skipped
            st, r = by_case[(1, 4, "ulysses_inner", "causal", "contiguous", 512)]
            assert st.steps_skipped == 3 - r
            # causal zigzag: no whole step is empty, but half of every off-diagonal step is (2 of 4
            # tiles) and 1 of 4 on the diagonal
            # (ring rank R-1 holds chunks R-1 and R, one run of ids, so its grid has fewer tiles)
            st, r = by_case[(1, 4, "ulysses_inner", "causal", "zigzag", 512)]
            assert (st.steps_skipped, st.tiles, st.tiles_skipped) == (
                (0, 14, 6) if r < 3 else (0, 7, 3)
            )
        if degree == (2, 2, "ulysses_inner"):
            st, r = by_case[(2, 2, "ulysses_inner", "causal", "zigzag", 512)]
            assert (st.steps_skipped, st.tiles, st.tiles_skipped) == (
                (0, 6, 2) if r < 1 else (0, 3, 1)
            )


# ------------------------------------------------------------------------------------------
# Communication volume (tracer) against the formulas of docs/architecture.md, "Capabilities" 1
# ------------------------------------------------------------------------------------------
def _tracer_cases(U, R, hk):
    from megatron_video.parallel import CommTracer

    out = []
    b, h, d, e = 2, 8, 4, 4  # float32
    N = U * R
    s_local = 6
    with video_parallel(U, R, "ulysses_inner", ranks_per_node=4) as groups:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, s_local, h, d, generator=g).requires_grad_()
        k = torch.randn(b, s_local, hk, d, generator=g).requires_grad_()
        v = torch.randn(b, s_local, hk, d, generator=g).requires_grad_()
        with CommTracer() as t:
            out_ = dist_attention(q, k, v, groups, mask=masks.causal(), scheme="zigzag")
            out_.sum().backward()
        rec = {
            key: t.bytes(op, direction=dr)
            for key, (op, dr) in dict(
                a2a_fwd=("all_to_all", "fwd"),
                a2a_bwd=("all_to_all", "bwd"),
                ring_fwd=("send", "fwd"),
                ring_bwd=("send", "bwd"),
            ).items()
        }
        rec.update(
            a2a_inter=t.bytes("all_to_all", intra_node=False),
            ring_fwd_inter=t.bytes("send", direction="fwd", intra_node=False),
            a2a_calls=t.count("all_to_all"),
            shape_checks=t.count("shape_check"),
            next_on_other_node=(
                groups.ring_ranks[(groups.ring_rank + 1) % R] // 4 != dist.get_rank() // 4
            ),
        )
        out.append(((U, R, hk, N, b, s_local, h, d, e), rec))
    return out


@pytest.mark.parametrize("U,R,hk", [(2, 4, 4), (4, 2, 4), (4, 2, 2), (1, 8, 2), (4, 1, 4)])
def test_comm_bytes_match_design_formulas(pool8, U, R, hk):
    for rank, results in enumerate(pool8.run(_tracer_cases, U, R, hk)):
        for (U, R, hk, _N, b, s_local, h, d, e), rec in results:
            G = b * s_local * d * e
            hk_eff = hk * U // math.gcd(hk, U)  # kv heads enter the a2a as lcm(hk, U) replicas
            a2a = G * (2 * h + 2 * hk_eff) * (U - 1) // U
            ring = (R - 1) * 2 * hk_eff * G
            case = (rank, U, R, hk)
            assert rec["a2a_fwd"] == a2a and rec["a2a_bwd"] == a2a, (case, rec, a2a)
            assert rec["ring_fwd"] == ring, (case, rec, ring)
            # backward: K/V travel again, and the float32 dK/dV partial sums travel R-1 hops home
            assert rec["ring_bwd"] == 2 * ring, (case, rec)
            assert rec["a2a_calls"] == (8 if U > 1 else 0)
            assert rec["shape_checks"] == 1
            assert rec["a2a_inter"] == 0  # the Ulysses group lies inside a node
            assert rec["ring_fwd_inter"] == (ring if rec["next_on_other_node"] else 0), (case, rec)


# ------------------------------------------------------------------------------------------
# Errors before any collective; shape mismatch between ranks raises instead of hanging
# ------------------------------------------------------------------------------------------
def _error_cases():
    from megatron_video.parallel import CommTracer

    msgs = []
    with video_parallel(2, 2, "ulysses_inner", ranks_per_node=WORLD) as groups:
        bad = [  # (q shape, kv shape, kwargs, expected message fragment)
            ((1, 8, 3, 4), (1, 8, 3, 4), {}, "num_heads (3) must be divisible by ulysses_size (2)"),
            ((1, 8, 4, 4), (1, 8, 3, 4), {}, "num_heads (4) must be divisible by num_kv_heads (3)"),
            ((1, 8, 4, 4), (1, 8, 4, 4), dict(tile=0), "tile (0) must be a positive int"),
            ((1, 8, 4, 4), (1, 8, 4, 4), dict(tile=2.5), "tile (2.5)"),
            ((1, 8, 4, 4), (1, 8, 4, 4), dict(mask=masks.causal()), "scheme (None) must be given"),
            ((1, 7, 4, 4), (1, 7, 4, 4), dict(scheme="zigzag"), "s_local (7) must be even"),
            ((1, 6, 4, 4), (1, 6, 4, 4), dict(scheme="diagonal"), "scheme ('diagonal')"),
            ((1, 6, 4, 4), (1, 6, 4, 4), dict(mask="causal"), "mask (str)"),
            ((1, 6, 4, 4), (1, 6, 4, 4), dict(softmax_scale=-1.0), "softmax_scale (-1.0)"),
            ((1, 6, 4, 4), (1, 6, 4, 4), dict(backend="cudnn"), "backend ('cudnn')"),
            ((1, 6, 4, 4), (1, 5, 4, 4), {}, "must agree in batch, s_local and head_dim"),
        ]
        for qs, ks, kw, frag in bad:
            with CommTracer() as t:
                try:
                    dist_attention(torch.randn(qs), torch.randn(ks), torch.randn(ks), groups, **kw)
                    msgs.append((frag, "no error", -1))
                except ValueError as e:
                    msgs.append((frag, str(e), len(t.events)))
        # Individually valid shapes that differ between ranks (rank 1 has a longer shard / more heads).
        odd = dist.get_rank() % 4 == 1  # one rank of each CP group (DP = 2)
        for qs in [(1, 8 if odd else 6, 4, 4), (1, 6, 8 if odd else 4, 4)]:
            try:
                dist_attention(
                    torch.randn(qs),
                    torch.randn(qs),
                    torch.randn(qs),
                    groups,
                    mask=masks.causal(),
                    scheme="zigzag",
                )
                msgs.append(("differ between ranks", "no error", -1))
            except ValueError as e:
                msgs.append(("differ between ranks", str(e), 0))
        # Same shapes, but one rank believes in another layout.
        x = torch.randn(1, 6, 4, 4)
        try:
            dist_attention(
                x, x, x, groups, mask=masks.causal(), scheme="contiguous" if odd else "zigzag"
            )
            msgs.append(("differ between ranks", "no error", -1))
        except ValueError as e:
            msgs.append(("differ between ranks", str(e), 0))
    return msgs


def _scope_cases():
    """``shape_check_scope``: one check per distinct call inside it; a mismatch on a call new to
    every rank still raises everywhere."""
    from megatron_video.parallel import CommTracer, shape_check_scope

    out = {}
    odd = dist.get_rank() % 4 == 1
    with video_parallel(2, 2, "ulysses_inner", ranks_per_node=WORLD) as groups:

        def call(n):
            x = torch.randn(1, n, 4, 4)
            return dist_attention(x, x, x, groups, mask=masks.causal(), scheme="zigzag")

        with CommTracer() as t:
            with shape_check_scope():
                for n in (6, 6, 6, 8, 6, 8):
                    call(n)
            call(6)  # outside: checked again
        out["checks"] = t.count("shape_check")
        for first in (True, False):  # the mismatch on the scope's first call, or after one
            try:
                with shape_check_scope():
                    if not first:
                        call(6)
                    call(10 if odd else 8)
                out[first] = "no error"
            except ValueError as e:
                out[first] = str(e)
    return out


def test_shape_check_scope_checks_each_call_once(pool8):
    for rank, out in enumerate(pool8.run(_scope_cases)):
        assert out["checks"] == 3, (rank, out)
        for first in (True, False):
            assert "differ between ranks" in out[first], (rank, first, out[first])


def test_errors_before_collectives_and_shape_mismatch(pool8):
    for rank, msgs in enumerate(pool8.run(_error_cases)):
        for frag, msg, n_events in msgs:
            assert frag in msg, (rank, frag, msg)
            assert n_events == 0, f"rank {rank}: {frag!r} raised only after {n_events} comm calls"
