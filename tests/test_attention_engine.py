"""The tiled attention engine against a float64 explicit-softmax oracle (single process).

Oracles here are written from the masks' definitions (index arithmetic on global ids), never from
``megatron_video.attention.masks``. Tile sizes deliberately do not divide the sequence; ids come in
runs (zigzag-like) and in arbitrary order; all-masked rows and all-masked blocks give zeros, never
NaN. The engine's instrumentation (``EngineStats``) bounds every mask and score buffer by one tile
pair, and an independent recorder on the mask's ``dense`` checks the same from outside.
"""

import pytest
import torch

from megatron_video.attention import dist_attention, engine, masks
from megatron_video.attention.engine import planning
from megatron_video.attention.ring import RingStats
from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
from megatron_video.layouts import BalancedSPLayout
from megatron_video.testing import masks as mask_oracles
from megatron_video.testing.oracles import max_rel_error as max_err
from megatron_video.testing.oracles import output_and_grads as grads
from megatron_video.testing.oracles import random_qkv
from megatron_video.testing.oracles import softmax_attention as oracle

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

F64, F32 = torch.float64, torch.float32
CU = [0, 5, 13, 14, 30, 41]  # packed documents; tokens past 41 are padding


MASK_PARAMS = dict(block=6, cu=CU, window=9, inner_block=4)


def allowed(kind, q, k):
    """Bool [len q, len k] from first principles on global ids ``q``, ``k`` (1-D LongTensors)."""
    if kind == "dead_rows":
        Q, K = q[:, None], k[None, :]
        return (K <= Q) & (Q % 7 != 3)
    return mask_oracles.allowed(kind, q, k, **MASK_PARAMS)


def make_mask(kind):
    if kind == "dead_rows":
        return masks.predicate(lambda q, k: (k <= q) & (q % 7 != 3))
    return mask_oracles.mask_for(kind, **MASK_PARAMS)


def inputs(b, sq, sk, h, hk, d, seed):
    return random_qkv(b, sq, h, hk, d, seed, sk=sk)


KINDS = [
    "full",
    "causal",
    "block_causal",
    "packed",
    "packed_causal",
    "packed_block",
    "dead_rows",
    "none",
    "window",
]


@pytest.mark.parametrize("kind", KINDS)
def test_local_engine_matches_oracle_with_tiles_that_do_not_divide(kind):
    S, scale = 45, 0.31
    q, k, v, dout = inputs(2, S, S, 4, 2, 8, seed=len(kind))
    ids = torch.arange(S)
    ref = grads(lambda q, k, v: oracle(q, k, v, allowed(kind, ids, ids), scale), q, k, v, dout)
    for dtype, tol in ((F64, 1e-12), (F32, 2e-5)):
        for tile in (1, 4, 7, 16, 512):
            st = RingStats()
            got = grads(
                lambda q, k, v: dist_attention(
                    q, k, v, None, mask=make_mask(kind), softmax_scale=scale, tile=tile, stats=st
                ),
                *(x.to(dtype) for x in (q, k, v)),
                dout,
            )
            assert not any(bool(torch.isnan(x).any()) for x in got), (kind, dtype, tile)
            assert max_err(got, ref) < tol, (kind, dtype, tile, max_err(got, ref))
            assert st.max_mask_elements <= tile * tile and st.max_score_elements <= tile * tile


@pytest.mark.parametrize("kind", ["causal", "packed_causal", "block_causal", "dead_rows", "none"])
def test_block_engine_on_arbitrary_id_order(kind):
    """Plan / forward / backward of one block whose ids are runs and scattered ids (as after the
    Ulysses gather), against the oracle restricted to those ids; backward from the global out/lse."""
    g = torch.Generator().manual_seed(5)
    q_ids = torch.cat(
        [torch.arange(3, 14), torch.randperm(40, generator=g)[:9] + 14, torch.arange(30, 41)]
    )
    k_ids = torch.cat([torch.arange(0, 9), torch.arange(20, 37), torch.tensor([5, 1])])
    q, k, v, dout = inputs(1, len(q_ids), len(k_ids), 2, 1, 8, seed=11)
    allow = allowed(kind, q_ids, k_ids)
    ref = grads(lambda q, k, v: oracle(q, k, v, allow, 0.5), q, k, v, dout)
    for backend, dtype, tol in (("math", F64, 1e-12), ("sdpa", F32, 2e-5)):
        for tile in (3, 8, 64):
            plan = engine.plan_for(q_ids, k_ids, make_mask(kind), tile, backend)
            qc, kc, vc = (x.to(dtype) for x in (q, k, v))
            out, lse = engine.accumulators(qc)
            engine.block_forward(out, lse, qc, kc, vc, plan, 0.5, backend, fresh=True)
            dq = torch.zeros(qc.shape, dtype=out.dtype)
            dk = torch.zeros(kc.shape[0], kc.shape[1], qc.shape[2], kc.shape[3], dtype=out.dtype)
            dv = torch.zeros_like(dk)
            engine.block_backward(
                dq,
                dk,
                dv,
                dout.transpose(1, 2).to(dtype).contiguous(),
                qc,
                kc,
                vc,
                out.to(dtype),
                lse.masked_fill(torch.isneginf(lse), float("inf")),
                plan,
                0.5,
                backend,
            )
            got = [
                out.transpose(1, 2).double(),
                dq.double(),
                dk.sum(2, keepdim=True).double(),
                dv.sum(2, keepdim=True).double(),
            ]
            assert max_err(got, ref) < tol, (kind, backend, tile, max_err(got, ref))
            dead = ~allow.any(-1)
            assert bool(torch.isneginf(lse[0, :, dead]).all())  # rows without keys: lse = -inf


def test_teacher_forcing_mask_tiles_from_cxx_equal_dense_rule():
    lay = BalancedSPLayout(num_latent_frames=8, tokens_per_frame=5, frames_per_block=2, sp_size=2)
    m = TeacherForcingMask(lay)
    F, S = 8, 5
    n = 2 * F * S
    order = lay.attention_order_global_ids()  # single-GPU id at each attention position
    side, frame = order // (F * S), (order % (F * S)) // S
    blk = frame // 2
    qc, kc = side[:, None] == 0, side[None, :] == 0
    want = torch.where(
        kc,
        torch.where(qc, blk[None, :] <= blk[:, None], blk[None, :] < blk[:, None]),
        ~qc & (blk[None, :] == blk[:, None]),
    )
    ids = torch.arange(n)
    assert torch.equal(m.dense(ids, ids), want)
    for tile in (3, 7, 10, 64):
        st = m.tile_status(ids, ids, tile, tile)
        for i in range(st.shape[0]):
            for j in range(st.shape[1]):
                w = want[i * tile : (i + 1) * tile, j * tile : (j + 1) * tile]
                assert int(st[i, j]) == (2 if w.all() else 0 if not w.any() else 1), (tile, i, j)
    q, k, v, dout = inputs(1, n, n, 2, 2, 8, seed=2)
    ref = grads(lambda q, k, v: oracle(q, k, v, want, 0.4), q, k, v, dout)
    got = grads(
        lambda q, k, v: dist_attention(q, k, v, None, mask=m, softmax_scale=0.4, tile=6),
        q,
        k,
        v,
        dout,
    )
    assert max_err(got, ref) < 1e-12


class _Recorder:
    """Wraps a predicate and records the size of every evaluation (independent of EngineStats)."""

    def __init__(self, fn):
        self.fn, self.largest, self.calls = fn, 0, 0

    def __call__(self, q, k):
        m = self.fn(q, k)
        self.largest = max(self.largest, int(m.numel()))
        self.calls += 1
        return m


def test_no_mask_or_score_buffer_exceeds_one_tile_pair():
    S, tile = 700, 64
    q, k, v, dout = inputs(1, S, S, 2, 2, 8, seed=3)
    for dtype, backend in ((F64, "math"), (F32, "sdpa")):
        rec = _Recorder(lambda a, b: (b <= a) & ((a // 50) % 3 != 1))
        st = RingStats()
        grads(
            lambda q, k, v: dist_attention(
                q, k, v, None, mask=masks.predicate(rec), tile=tile, stats=st, backend=backend
            ),
            *(x.to(dtype) for x in (q, k, v)),
            dout,
        )
        assert rec.calls > 0 and rec.largest <= tile * tile, (backend, rec.largest)
        assert 0 < st.max_mask_elements <= tile * tile, (backend, st.max_mask_elements)
        if backend == "math":  # the only kernel that materialises scores
            assert 0 < st.max_score_elements <= tile * tile
        else:
            assert st.max_score_elements == 0
        assert st.tiles_skipped > 0 and st.tiles_full > 0 and st.tiles_partial > 0


def test_causal_block_is_one_kernel_call_and_full_rows_merge():
    """A causal block of identical id runs is one call with the kernel's causal flag; a full mask is
    one call; block-causal rows with the same FULL runs share a call (first-principles counts)."""
    S = 96
    q = torch.randn(1, S, 2, 8)
    for mask, tile, calls in (
        (masks.causal(), 16, 1),
        (masks.full(), 16, 1),
        # blocks of 24 tokens, tiles of 6: all tiles FULL or EMPTY; the 4 tile
        # rows of block b share the FULL run [0, 24(b+1)) -> 4 calls
        (masks.block_causal(24), 6, 4),
        # blocks of 6, tiles of 12: 8 tile rows; row i: FULL run [0, 12i) (i > 0)
        # and a PARTIAL diagonal tile (2 blocks, not a triangle) -> 7 + 8 calls
        (masks.block_causal(6), 12, 15),
    ):
        st = RingStats()
        dist_attention(q, q, q, None, mask=mask, tile=tile, stats=st)
        assert st.kernel_calls == calls, (mask, st)


@pytest.mark.parametrize("kind", ["causal", "packed_causal"])
def test_zigzag_shard_is_one_causal_call_and_exact(kind):
    """A zigzag shard (chunks c and 2N-1-c: two runs of increasing ids) against itself is ONE call
    with the kernel's causal flag (the staircase spans both runs), and equals the oracle."""
    c, S = 40, 320  # 8 chunks of 40; this shard holds chunks 1 and 6
    ids = torch.cat([torch.arange(c, 2 * c), torch.arange(6 * c, 7 * c)])
    mask = masks.causal() if kind == "causal" else masks.packed([0, S], inner=masks.causal())
    q, k, v, dout = inputs(1, ids.numel(), ids.numel(), 2, 2, 8, seed=4)
    ref = grads(lambda q, k, v: oracle(q, k, v, allowed("causal", ids, ids), 0.5), q, k, v, dout)
    for tile in (7, 16, 512):
        plan = engine.plan_for(ids, ids, mask, tile, "sdpa")
        assert [c_.kind for c_ in plan.calls] == [engine.CAUSAL], (tile, plan.calls)
        assert (plan.calls[0].q, plan.calls[0].k) == (slice(0, 2 * c), slice(0, 2 * c))
        qc, kc, vc = (x.float() for x in (q, k, v))
        out, lse = engine.block_forward(None, None, qc, kc, vc, plan, 0.5, "sdpa", fresh=True)
        dq = torch.zeros(qc.shape)
        dk = torch.zeros(kc.shape)
        dv = torch.zeros_like(dk)
        engine.block_backward(
            dq, dk, dv, dout.float().transpose(1, 2), qc, kc, vc, out, lse, plan, 0.5, "sdpa"
        )
        got = [out.transpose(1, 2).double(), dq.double(), dk.double(), dv.double()]
        assert max_err(got, ref) < 2e-5, (tile, max_err(got, ref))


def test_block_forward_without_calls_keeps_accumulators_and_allocates_none():
    q = torch.randn(1, 6, 2, 4)
    plan = engine.plan_for(torch.arange(6), torch.arange(6) + 10, masks.causal(), 4, "sdpa")
    assert not plan.calls  # every key is later than every query
    assert engine.block_forward(None, None, q, q, q, plan, 0.5, "sdpa", fresh=True) == (None, None)
    out = dist_attention(
        q, q, q, None, mask=masks.predicate(lambda a, b: (a < 0) & (b < 0)), tile=4
    )
    assert torch.equal(out, torch.zeros_like(out))  # all rows masked: zeros, never NaN


class _LowerLiar(masks.AttentionMask):
    """Block-causal (blocks of 4) in its dense form, but claims every tile is a lower triangle."""

    def dense(self, q_ids, k_ids):
        return k_ids[None, :] // 4 <= q_ids[:, None] // 4

    def lower_triangle(self, q_ids, k_ids):
        return True

    def __repr__(self):
        return "LowerLiar()"


def test_debug_mode_catches_a_lying_lower_triangle(monkeypatch):
    q = torch.randn(1, 32, 2, 8)
    monkeypatch.setenv(engine.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=r"mask \(LowerLiar\(\)\)\.lower_triangle says the tile"):
        dist_attention(q, q, q, None, mask=_LowerLiar(), tile=8)


class _LyingMask(masks.AttentionMask):
    """Causal in its dense form, but claims every tile is FULL."""

    def dense(self, q_ids, k_ids):
        return k_ids[None, :] <= q_ids[:, None]

    def block_status(self, q_ids, k_ids):
        return masks.FULL

    def __repr__(self):
        return "LyingMask()"


def test_debug_mode_catches_a_lying_tile_classification(monkeypatch):
    q = torch.randn(1, 32, 2, 8)
    dist_attention(q, q, q, None, mask=_LyingMask(), tile=8)  # not checked: silently trusted
    monkeypatch.setenv(engine.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=r"mask \(LyingMask\(\)\) classifies the tile .* as FULL"):
        dist_attention(q, q, q, None, mask=_LyingMask(), tile=8)
    dist_attention(q, q, q, None, mask=masks.causal(), tile=8)  # honest masks pass the check


@pytest.mark.parametrize(
    "tile,frag",
    [
        (0, "tile (0) must be a positive int"),
        (-4, "tile (-4)"),
        (True, "tile (True)"),
        (2.0, "tile (2.0)"),
    ],
)
def test_bad_tile_raises_naming_tile(tile, frag):
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=frag.replace("(", r"\(").replace(")", r"\)")):
        dist_attention(q, q, q, None, mask=masks.causal(), tile=tile)


def test_tile_must_be_a_multiple_of_the_flex_block_on_cuda():
    with pytest.raises(
        ValueError,
        match=r"tile \(100\) must be a multiple of the 'flex' kernel's block size \(128\)",
    ):
        engine.check_tile(100, "flex", torch.device("cuda"))
    assert engine.check_tile(256, "flex", torch.device("cuda")) == 256
    assert engine.check_tile(7, "sdpa", torch.device("cpu")) == 7


def test_flex_block_mask_from_tile_status_forward_matches_oracle():
    """The GPU path's BlockMask (C++ tile status -> from_kv_blocks, mask_mod on global ids), run
    eagerly on CPU (forward only there) against the oracle."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    S, tile = 96, 32
    ids = torch.arange(S)
    q, k, v, _ = inputs(1, S, S, 2, 2, 16, seed=4)
    for kind in ("causal", "packed_causal", "block_causal"):
        plan = engine.plan_for(ids, ids, make_mask(kind), tile, "flex")
        out, lse = engine.accumulators(q.float())
        engine.block_forward(out, lse, q.float(), k.float(), v.float(), plan, 0.25, "flex")
        ref = oracle(q, k, v, allowed(kind, ids, ids), 0.25)
        assert float((out.transpose(1, 2).double() - ref).abs().max()) < 1e-5, kind
        st = plan.status
        assert int((st == 0).sum()) > 0  # EMPTY tiles really are absent from the BlockMask


def test_local_attention_cross_lengths_through_the_engine():
    """``local_attention`` (the path of spatial / temporal / cross-attention): sq != sk, no mask, a
    bool table read tile by tile, and a rule mask, in float64 and fp32, outputs and gradients."""
    from megatron_video.attention import local_attention

    sq, sk = 37, 23
    q, k, v, dout = inputs(2, sq, sk, 4, 2, 8, seed=9)
    g = torch.Generator().manual_seed(9)
    table = torch.rand(sq, sk, generator=g) < 0.5
    table[5] = False  # a row without keys
    qi, ki = torch.arange(sq), torch.arange(sk)
    for mask, allow in (
        (None, torch.ones(sq, sk, dtype=torch.bool)),
        (table, table),
        (masks.causal(), allowed("causal", qi, ki)),
    ):
        ref = grads(lambda q, k, v: oracle(q, k, v, allow, 0.3), q, k, v, dout)
        for dtype, tol in ((F64, 1e-12), (F32, 2e-5)):
            st = engine.EngineStats()
            got = grads(
                lambda q, k, v: local_attention(q, k, v, mask, 0.3, tile=8, stats=st)[0],
                *(x.to(dtype) for x in (q, k, v)),
                dout,
            )
            assert max_err(got, ref) < tol, (type(mask).__name__, dtype, max_err(got, ref))
            assert st.max_mask_elements <= 64 and st.max_score_elements <= 64


def test_full_tiles_partition_into_fewest_rectangles():
    """The FULL tiles of a block are cut into rectangles (one kernel call each) that cover every
    FULL tile exactly once and nothing else, never more than the row grouping gives; rows with
    different runs share a column run (first-principles count)."""
    grid = [[1, 0, 1], [1, 0, 0], [1, 0, 1]]
    assert len(planning._row_groups(grid)) == 5
    assert sorted(planning._fewest_rectangles(grid)) == [(0, 1, 2, 3), (0, 3, 0, 1), (2, 3, 2, 3)]
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        nq, nk = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
        full = (torch.rand(nq, nk, generator=g) < 0.3 + 0.6 * (trial % 3) / 2).tolist()
        rects = planning._fewest_rectangles(full)
        cover = torch.zeros(nq, nk, dtype=torch.int64)
        for i0, i1, j0, j1 in rects:
            assert 0 <= i0 < i1 <= nq and 0 <= j0 < j1 <= nk
            cover[i0:i1, j0:j1] += 1
        assert torch.equal(cover, torch.tensor(full, dtype=torch.int64)), (full, rects)
        assert len(rects) <= len(planning._row_groups(full))


@pytest.mark.parametrize("b", [1, 2])
def test_equal_diagonal_blocks_are_batched_calls_and_exact(b):
    """Packed documents of 8 tokens, tiles of 8: the 8 diagonal tiles are FULL calls of one shape
    stepping by (8, 8); they run as batched calls of at most a quarter of the rows (2 x 4 here);
    forward and backward equal the oracle, with batch 1 and (split back into single calls) 2."""
    S, t = 64, 8
    mask = masks.packed(list(range(0, S + 1, t)))
    ids = torch.arange(S)
    plan = engine.plan_for(ids, ids, mask, t, "sdpa")
    assert [(c.batch, c.q_step, c.k_step) for c in plan.calls] == [(2, t, t)] * 4, plan.calls
    assert sorted(blk.q.start for c in plan.calls for blk in c.blocks()) == list(range(0, S, t))
    allow = (ids[:, None] // t) == (ids[None, :] // t)
    q, k, v, dout = inputs(b, S, S, 2, 3 - b, 8, seed=5)  # b = 2 with GQA (one kv head)
    ref = grads(lambda q, k, v: oracle(q, k, v, allow, 0.5), q, k, v, dout)
    st = RingStats()
    got = grads(
        lambda q, k, v: dist_attention(
            q, k, v, None, mask=mask, tile=t, softmax_scale=0.5, stats=st
        ),
        *(x.float() for x in (q, k, v)),
        dout.float(),
    )
    assert max_err([x.double() for x in got], ref) < 2e-5
    assert st.kernel_calls == 4 and st.bwd_kernel_calls == 4, st
