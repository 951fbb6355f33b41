"""2D attention (Ulysses x ring) against a float64 explicit-softmax oracle of the whole sequence.

Every rank builds the same full q, k, v, dout, computes the oracle (and its gradients) on one
process, runs ``dist_attention`` on its shard and compares its shard of the outputs AND of dq, dk,
dv; together the ranks cover the whole sequence (``shard_sequence`` is a tested bijection). Many
cases run inside one ``pool.run``; all of them use the 8-rank pool (CP degrees below 8 run as DP
replicas of the same case), so the attention tests start no other pool.
"""
import math

import torch
import torch.distributed as dist

from megatron_video.attention import RingStats, dist_attention, masks
from megatron_video.layouts import global_token_ids, shard_sequence

# ------------------------------------------------------------------------------------------
# Oracle and first-principles masks (independent of megatron_video.attention.masks)
# ------------------------------------------------------------------------------------------
S4, S8 = 32, 48          # sequence lengths on the 4- and 8-rank pools (divisible by 2N)
CU = [0, 3, 11, 12, 25, 29]  # uneven packed documents; tokens past 29 are padding


def allowed(kind, S, seed=0):
    """Bool ``[S, S]`` (True = attend) straight from each mask's definition."""
    q = torch.arange(S)[:, None]
    k = torch.arange(S)[None, :]
    if kind == "full":
        return torch.ones(S, S, dtype=torch.bool)
    if kind == "causal":
        return k <= q
    if kind == "block_causal":
        return k // 5 <= q // 5
    if kind in ("packed", "packed_causal"):
        doc = torch.full((S,), -1)
        for i in range(len(CU) - 1):
            doc[CU[i]:CU[i + 1]] = i
        a = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
        return a & (k <= q) if kind == "packed_causal" else a
    if kind in ("random", "dead_rows"):
        g = torch.Generator().manual_seed(1000 + seed)
        a = torch.rand(S, S, generator=g) < (0.4 if kind == "random" else 0.15)
        if kind == "dead_rows":
            a[::5] = False  # rows with no visible key
        return a
    raise KeyError(kind)


def make_mask(kind, S, seed=0):
    if kind == "full":
        return masks.full()
    if kind == "causal":
        return masks.causal()
    if kind == "block_causal":
        return masks.block_causal(5)
    if kind == "packed":
        return masks.packed(CU)
    if kind == "packed_causal":
        return masks.packed(CU, inner=masks.causal())
    table = allowed(kind, S, seed)
    return masks.predicate(lambda qi, ki: table[qi, ki])


def oracle(q, k, v, allow, scale):
    """Explicit softmax attention on one process; dead rows give exact zeros (and zero grads)."""
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    dead = ~allow.any(-1)
    s = s.masked_fill(~allow, float("-inf")).masked_fill(dead[:, None], 0.0)
    p = torch.softmax(s, dim=-1) * (~dead)[:, None].to(s.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def full_inputs(b, S, h, hk, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return mk(b, S, h, d), mk(b, S, hk, d), mk(b, S, hk, d), mk(b, S, h, d)


def oracle_with_grads(q, k, v, dout, allow, scale):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = oracle(q, k, v, allow, scale)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------------------
# Rank-side helpers
# ------------------------------------------------------------------------------------------
def setup(U, R, placement, tp=1, ranks_per_node=None):
    from megatron_video.compat import initialize_model_parallel
    from megatron_video.parallel import init_video_parallel

    kw = dict(tensor_model_parallel_size=tp, context_parallel_size=U * R)
    if U > 1 and R > 1:
        kw["hierarchical_context_parallel_sizes"] = [U, R] if placement == "ulysses_inner" else [R, U]
    initialize_model_parallel(**kw)
    rpn = ranks_per_node if ranks_per_node is not None else dist.get_world_size()
    return init_video_parallel(U, R, ranks_per_node=rpn, placement=placement)


def teardown():
    from megatron_video.compat import destroy_model_parallel
    from megatron_video.parallel import destroy_video_parallel

    destroy_video_parallel()
    destroy_model_parallel()


def run_case(groups, S, kind, b, h, hk, d, seed, scheme=None, dtype=torch.float64, stats=None,
             backend="auto", tile=512):
    """Max abs errors (out, dq, dk, dv) of this rank's shard against the oracle, and a NaN flag."""
    q, k, v, dout = full_inputs(b, S, h, hk, d, seed)
    scale = d ** -0.5 * 1.3
    ref = oracle_with_grads(q, k, v, dout, allowed(kind, S, seed), scale)
    mask = make_mask(kind, S, seed)
    scheme = scheme or mask.default_scheme
    shard = lambda x: shard_sequence(x, groups, dim=1, scheme=scheme)  # noqa: E731
    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    out = dist_attention(ql, kl, vl, groups, mask=mask, softmax_scale=scale, scheme=scheme,
                         backend=backend, stats=stats, tile=tile)
    (out * shard(dout).to(dtype)).sum().backward()
    got = [out.detach(), ql.grad, kl.grad, vl.grad]
    nan = any(bool(torch.isnan(x).any()) for x in got)
    errs = []
    for g, r in zip(got, ref):
        r = shard(r)
        errs.append(float((g.double() - r).abs().max() / max(1.0, float(r.abs().max()))))
    return errs, nan


# ------------------------------------------------------------------------------------------
# Correctness over degrees, placements, masks, schemes, GQA and batch
# ------------------------------------------------------------------------------------------
MASK_SCHEMES = [("full", "contiguous"), ("causal", "zigzag"), ("causal", "contiguous"),
                ("block_causal", "zigzag"), ("packed", "contiguous"), ("packed_causal", "zigzag"),
                ("random", "contiguous"), ("dead_rows", "contiguous"), ("dead_rows", "zigzag")]


def _degree_cases(degrees, S):
    results = []
    i = 0
    for U, R, placement in degrees:
        groups = setup(U, R, placement)
        try:
            for kind, scheme in MASK_SCHEMES:
                # cycle batch and GQA so every degree sees MHA, split and replicated kv heads
                b = 1 + i % 2
                hk = (4, 2, 1)[i % 3]
                errs, nan = run_case(groups, S, kind, b, 4, hk, 8, seed=i, scheme=scheme)
                results.append(((U, R, placement, kind, scheme, b, hk), errs, nan))
                i += 1
        finally:
            teardown()
    return results


def _assert_results(per_rank, tol):
    for rank, results in enumerate(per_rank):
        for case, errs, nan in results:
            assert not nan, f"NaN on rank {rank} in {case}"
            assert max(errs) < tol, f"rank {rank} case {case}: errors (out, dq, dk, dv) = {errs}"


DEGREES4 = [(1, 1, "ulysses_inner"), (1, 4, "ulysses_inner"), (4, 1, "ulysses_inner"),
            (2, 2, "ulysses_inner"), (2, 2, "ring_inner"), (1, 4, "ring_inner"), (4, 1, "ring_inner")]
DEGREES8 = [(2, 4, "ulysses_inner"), (4, 2, "ulysses_inner"), (2, 4, "ring_inner"), (4, 2, "ring_inner")]


def test_exact_vs_oracle_cp4_and_below(pool8):
    _assert_results(pool8.run(_degree_cases, DEGREES4, S4), 1e-10)


def test_exact_vs_oracle_cp8(pool8):
    _assert_results(pool8.run(_degree_cases, DEGREES8, S8), 1e-10)


def _gqa_cases():
    """Head counts where H_kv neither divides nor is divisible by U (kv heads enter as lcm(H_kv, U))."""
    out = []
    for U, R, h, hk in [(2, 2, 6, 3), (2, 1, 6, 3), (4, 1, 12, 3), (4, 2, 12, 3), (2, 4, 10, 5)]:
        groups = setup(U, R, "ulysses_inner")
        try:
            for kind, scheme in [("causal", "zigzag"), ("packed_causal", "zigzag"), ("full", "contiguous")]:
                S = 8 * U * R
                errs, nan = run_case(groups, S, kind, 1, h, hk, 4, seed=U + R + h, scheme=scheme, tile=3)
                out.append(((U, R, h, hk, kind), errs, nan))
        finally:
            teardown()
    return out


def test_gqa_any_head_counts_exact(pool8):
    _assert_results(pool8.run(_gqa_cases), 1e-10)


def _low_precision_cases():
    out = []
    for U, R, placement in [(2, 2, "ulysses_inner"), (1, 4, "ulysses_inner"), (4, 1, "ring_inner")]:
        groups = setup(U, R, placement)
        try:
            for kind, hk, dtype in [("causal", 2, torch.bfloat16), ("dead_rows", 1, torch.bfloat16),
                                    ("block_causal", 4, torch.float32), ("full", 2, torch.float32)]:
                errs, nan = run_case(groups, S4, kind, 2, 4, hk, 16, seed=7, dtype=dtype)
                out.append(((U, R, placement, kind, hk, str(dtype)), errs, nan))
        finally:
            teardown()
    return out


def test_bf16_and_fp32_fused_kernel(pool8):
    """bf16 within 2.5e-2 and fp32 (CPU flash kernel) within 1e-5 of the float64 oracle."""
    for rank, results in enumerate(pool8.run(_low_precision_cases)):
        for case, errs, nan in results:
            assert not nan, (rank, case)
            tol = 2.5e-2 if "bfloat16" in case[-1] else 1e-5
            assert max(errs) < tol, f"rank {rank} {case}: {errs}"


# ------------------------------------------------------------------------------------------
# Skipped ring work equals the count of fully masked tiles (first principles)
# ------------------------------------------------------------------------------------------
def _runs(ids):
    ids = ids.tolist()
    runs, start = [], 0
    for p in range(1, len(ids) + 1):
        if p == len(ids) or ids[p] != ids[p - 1] + 1:
            runs.append(ids[start:p])
            start = p
    return runs


def _tiles(ids, tile):
    """Runs of consecutive ids, each cut into tiles of ``tile`` ids (the last may be shorter)."""
    return [run[a:a + tile] for run in _runs(ids) for a in range(0, len(run), tile)]


def _skip_cases(S):
    out = []
    for U, R, placement in [(1, 4, "ulysses_inner"), (2, 2, "ulysses_inner"), (2, 2, "ring_inner")]:
        groups = setup(U, R, placement)
        try:
            # Each ring member's ids during ring attention = the union of its Ulysses group's shards,
            # learnt from the ranks themselves (not from the library's index map).
            for kind, scheme in [("causal", "zigzag"), ("causal", "contiguous"), ("block_causal", "zigzag"),
                                 ("packed", "contiguous"), ("dead_rows", "zigzag")]:
                mine = global_token_ids(groups, S, scheme)
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, (dist.get_rank(), groups.ulysses_ranks, mine))
                shard_of = {g: ids for g, _, ids in everyone}
                ugroup_of = {g: ug for g, ug, _ in everyone}
                held = [torch.sort(torch.cat([shard_of[m] for m in ugroup_of[g]])).values
                        for g in groups.ring_ranks]
                allow = allowed(kind, S, seed=3)
                q_ids = held[groups.ring_rank]
                for tile in (3, 512):  # 3 divides no run length; 512 = whole runs
                    exp = dict(steps=0, steps_skipped=0, tiles=0, tiles_skipped=0, tiles_full=0)
                    for kv_ids in held:
                        cells = [allow[qt][:, kt] for qt in _tiles(q_ids, tile) for kt in _tiles(kv_ids, tile)]
                        exp["steps"] += 1
                        exp["steps_skipped"] += int(not any(bool(c.any()) for c in cells))
                        exp["tiles"] += len(cells)
                        exp["tiles_skipped"] += sum(1 for c in cells if not c.any())
                        exp["tiles_full"] += sum(1 for c in cells if c.all())
                    stats = RingStats()
                    errs, nan = run_case(groups, S, kind, 1, 4, 2, 8, seed=3, scheme=scheme, stats=stats,
                                         tile=tile)
                    out.append(((U, R, placement, kind, scheme, tile), exp, stats, errs, nan, groups.ring_rank))
        finally:
            teardown()
    return out


def test_skipped_steps_match_masked_tiles(pool8):
    per_rank = pool8.run(_skip_cases, S4)
    for rank, results in enumerate(per_rank):
        for case, exp, st, errs, nan, _ in results:
            assert max(errs) < 1e-10 and not nan, (rank, case, errs)
            got = dict(steps=st.steps, steps_skipped=st.steps_skipped, tiles=st.tiles,
                       tiles_skipped=st.tiles_skipped, tiles_full=st.tiles_full)
            assert got == exp, (rank, case, got, exp)
            bwd = dict(steps=st.bwd_steps, steps_skipped=st.bwd_steps_skipped, tiles=st.bwd_tiles,
                       tiles_skipped=st.bwd_tiles_skipped)
            assert bwd == {k: exp[k] for k in bwd}, (rank, case, bwd, exp)
            # float64 runs the math kernel: no call ever holds more than one tile pair of scores
            tile = case[-1]
            assert 0 < st.max_score_elements <= tile * tile, (rank, case, st.max_score_elements)
            assert st.max_mask_elements <= tile * tile, (rank, case, st.max_mask_elements)
    # Hand-derived numbers for the balanced layouts (ring rank r of R = 4, and of R = 2), whole runs:
    for rank, results in enumerate(per_rank):
        by_case = {c: (st, r) for c, _, st, _, _, r in results}
        # causal contiguous, pure ring: the KV blocks of every later ring rank are skipped
        st, r = by_case[(1, 4, "ulysses_inner", "causal", "contiguous", 512)]
        assert st.steps_skipped == 3 - r
        # causal zigzag: no whole step is empty, but half of every off-diagonal step is (2 of 4
        # tiles) and 1 of 4 on the diagonal
        # (ring rank R-1 holds chunks R-1 and R, one run of ids, so its grid has fewer tiles)
        st, r = by_case[(1, 4, "ulysses_inner", "causal", "zigzag", 512)]
        assert (st.steps_skipped, st.tiles, st.tiles_skipped) == ((0, 14, 6) if r < 3 else (0, 7, 3))
        st, r = by_case[(2, 2, "ulysses_inner", "causal", "zigzag", 512)]
        assert (st.steps_skipped, st.tiles, st.tiles_skipped) == ((0, 6, 2) if r < 1 else (0, 3, 1))


# ------------------------------------------------------------------------------------------
# Communication volume (tracer) against the formulas of docs/architecture.md, "Capabilities" 1
# ------------------------------------------------------------------------------------------
def _tracer_cases():
    from megatron_video.parallel import CommTracer

    out = []
    b, h, d, e = 2, 8, 4, 4  # float32
    for U, R, hk in [(2, 4, 4), (4, 2, 4), (4, 2, 2), (1, 8, 2), (4, 1, 4)]:
        N = U * R
        s_local = 6
        groups = setup(U, R, "ulysses_inner", ranks_per_node=4)
        try:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(b, s_local, h, d, generator=g).requires_grad_()
            k = torch.randn(b, s_local, hk, d, generator=g).requires_grad_()
            v = torch.randn(b, s_local, hk, d, generator=g).requires_grad_()
            with CommTracer() as t:
                out_ = dist_attention(q, k, v, groups, mask=masks.causal(), scheme="zigzag")
                out_.sum().backward()
            rec = {key: t.bytes(op, direction=dr) for key, (op, dr) in dict(
                a2a_fwd=("all_to_all", "fwd"), a2a_bwd=("all_to_all", "bwd"), ring_fwd=("send", "fwd"),
                ring_bwd=("send", "bwd")).items()}
            rec.update(a2a_inter=t.bytes("all_to_all", intra_node=False),
                       ring_fwd_inter=t.bytes("send", direction="fwd", intra_node=False),
                       a2a_calls=t.count("all_to_all"), shape_checks=t.count("shape_check"),
                       next_on_other_node=(groups.ring_ranks[(groups.ring_rank + 1) % R] // 4
                                           != dist.get_rank() // 4))
            out.append(((U, R, hk, N, b, s_local, h, d, e), rec))
        finally:
            teardown()
    return out


def test_comm_bytes_match_design_formulas(pool8):
    for rank, results in enumerate(pool8.run(_tracer_cases)):
        for (U, R, hk, N, b, s_local, h, d, e), rec in results:
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

    groups = setup(2, 2, "ulysses_inner")
    msgs = []
    try:
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
                dist_attention(torch.randn(qs), torch.randn(qs), torch.randn(qs), groups,
                               mask=masks.causal(), scheme="zigzag")
                msgs.append(("differ between ranks", "no error", -1))
            except ValueError as e:
                msgs.append(("differ between ranks", str(e), 0))
        # Same shapes, but one rank believes in another layout.
        x = torch.randn(1, 6, 4, 4)
        try:
            dist_attention(x, x, x, groups, mask=masks.causal(), scheme="contiguous" if odd else "zigzag")
            msgs.append(("differ between ranks", "no error", -1))
        except ValueError as e:
            msgs.append(("differ between ranks", str(e), 0))
    finally:
        teardown()
    return msgs


def test_errors_before_collectives_and_shape_mismatch(pool8):
    for rank, msgs in enumerate(pool8.run(_error_cases)):
        for frag, msg, n_events in msgs:
            assert frag in msg, (rank, frag, msg)
            assert n_events == 0, f"rank {rank}: {frag!r} raised only after {n_events} comm calls"
