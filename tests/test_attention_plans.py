"""Plan reuse and the hot path: plans built once per layout / mask / tile and shared by every layer,
ring step and the backward; masks are immutable values (no stale plan); no host read of device data
(``.cpu()``, ``.item()``, ``.tolist()``, ``bool()`` / ``int()`` / ``float()`` of a tensor) inside an
attention call once its plan exists."""

import pytest
import torch
import torch.distributed as dist

from megatron_video.attention import dist_attention, local_attention, masks
from megatron_video.attention.plans import PLANS, PlanCache
from megatron_video.testing.host_reads import count_host_reads

F64 = torch.float64


def _layers(n, b, s, h, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(b, s, h, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
        for _ in range(n)
    ]


def _fwd_bwd(qkv, **kw):
    q, k, v = qkv
    out = dist_attention(q, k, v, **kw)
    out.square().sum().backward()
    return out


# ------------------------------------------------------------------------------------------
# Masks are values
# ------------------------------------------------------------------------------------------
def test_masks_are_hashable_values():
    assert masks.causal() == masks.causal() and hash(masks.causal()) == hash(masks.causal())
    assert masks.block_causal(4) == masks.block_causal(4) != masks.block_causal(8)
    assert masks.packed([0, 3, 8]) == masks.packed(torch.tensor([0, 3, 8]))
    assert masks.packed([0, 3, 8]) != masks.packed([0, 4, 8])
    assert masks.packed([0, 3, 8], masks.causal()) != masks.packed([0, 3, 8])
    assert masks.video_rows(4, "spatial") != masks.video_rows(4, "temporal")
    assert masks.causal() != masks.full() and masks.causal() != masks.block_causal(1)

    def fn(a, b):
        return b <= a

    assert masks.predicate(fn) == masks.predicate(fn)
    assert masks.predicate(fn) != masks.predicate(lambda a, b: b <= a)  # another function
    t = torch.ones(4, 4, dtype=torch.bool)
    assert masks.from_dense(t) != masks.from_dense(t)  # tables compare by identity


@pytest.mark.parametrize(
    "make",
    [
        masks.causal,
        lambda: masks.block_causal(4),
        lambda: masks.packed([0, 3, 8]),
        lambda: masks.predicate(lambda a, b: b <= a),
    ],
)
def test_masks_cannot_be_mutated(make):
    m = make()
    with pytest.raises(AttributeError, match="immutable"):
        m.block_tokens = 8
    with pytest.raises(AttributeError, match="immutable"):
        m.default_scheme = "zigzag"
    with pytest.raises(AttributeError, match="immutable"):
        del m.tile_hint


def test_mask_content_cannot_change_under_a_plan():
    cu = torch.tensor([0, 3, 8])
    m = masks.packed(cu)
    cu[1] = 5  # the caller's tensor
    m.cu_seqlens[1] = 6  # a copy
    assert m == masks.packed([0, 3, 8]) and m.cu_seqlens.tolist() == [0, 3, 8]
    t = torch.eye(8, dtype=torch.bool)
    d = masks.from_dense(t)
    t.fill_(True)  # the mask kept its own copy
    assert torch.equal(d.dense(torch.arange(8), torch.arange(8)), torch.eye(8, dtype=torch.bool))


# ------------------------------------------------------------------------------------------
# Plan cache
# ------------------------------------------------------------------------------------------
def test_plan_cache_is_bounded_and_counts():
    c = PlanCache(maxsize=2)
    built = []
    for key in ("a", "b", "a", "c", "b"):
        c.get(key, lambda: built.append(key) or key)
    assert built == ["a", "b", "c", "b"] and len(c) == 2 and c.builds == 4 and c.hits == 1
    assert c.get(None, lambda: 7) == 7 and len(c) == 2  # key None: built, not kept
    with pytest.raises(ValueError, match=r"maxsize \(0\)"):
        PlanCache(0)


@pytest.mark.parametrize(
    "mask", [masks.causal(), masks.block_causal(8), masks.packed([0, 20, 50, 64], masks.causal())]
)
def test_zero_builds_after_the_first_layer(mask):
    PLANS.clear()
    layers = _layers(6, 1, 64, 2, 8)
    _fwd_bwd(layers[0], mask=mask, tile=16)
    first = PLANS.builds
    assert first == 1  # one ring (of one rank): one plan entry
    for qkv in layers[1:]:
        _fwd_bwd(qkv, mask=mask, tile=16)
    assert PLANS.builds == first and PLANS.hits == 5  # every later layer, fwd and bwd: no build


def test_a_different_mask_value_tile_or_length_gets_a_fresh_plan():
    PLANS.clear()
    qkv = _layers(1, 1, 64, 2, 8)[0]
    _fwd_bwd(qkv, mask=masks.block_causal(8), tile=16)
    _fwd_bwd(qkv, mask=masks.block_causal(8), tile=16)  # an equal value: the same plan
    assert PLANS.builds == 1
    _fwd_bwd(qkv, mask=masks.block_causal(4), tile=16)  # another value
    assert PLANS.builds == 2
    _fwd_bwd(qkv, mask=masks.block_causal(4), tile=32)  # another tile
    assert PLANS.builds == 3
    _fwd_bwd(_layers(1, 1, 32, 2, 8)[0], mask=masks.block_causal(4), tile=32)  # another length
    assert PLANS.builds == 4


def test_cached_plans_stay_exact_for_each_mask():
    """Alternating masks through one cache: every output equals an uncached float64 reference."""
    q, k, v = (x.detach() for x in _layers(1, 1, 48, 2, 8, dtype=F64, seed=3)[0])
    cases = [masks.causal(), masks.block_causal(6), masks.packed([0, 10, 40], masks.causal())]
    refs = []
    for m in cases:
        PLANS.clear()
        refs.append(dist_attention(q, q, q, mask=m, tile=8))
    PLANS.clear()
    for _ in range(2):
        for m, ref in zip(cases, refs):
            assert torch.equal(dist_attention(q, q, q, mask=m, tile=8), ref), m
    assert PLANS.builds == len(cases)


def test_local_attention_shares_plans_but_not_one_call_tables():
    PLANS.clear()
    q = torch.randn(1, 24, 2, 8)
    for _ in range(3):
        local_attention(q, q, q, masks.causal(), tile=8)
    assert PLANS.builds == 1 and len(PLANS) == 1
    table = torch.rand(24, 24) < 0.5
    for _ in range(2):
        local_attention(q, q, q, table, tile=8)
    assert PLANS.builds == 3 and len(PLANS) == 1  # built per call, never kept


# ------------------------------------------------------------------------------------------
# No host reads of device data after the first call
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask",
    [
        None,
        masks.causal(),
        masks.block_causal(8),
        masks.packed([0, 20, 50, 64], masks.causal()),
        masks.predicate(lambda a, b: (b <= a) & ((a - b) < 20)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_no_host_sync_after_the_first_call(mask, dtype):
    layers = _layers(2, 1, 64, 2, 8, dtype=dtype)
    _fwd_bwd(layers[0], mask=mask, tile=16)
    local_attention(*(x.detach() for x in layers[0]), mask, tile=16)
    with count_host_reads() as counts:
        _fwd_bwd(layers[1], mask=mask, tile=16)
        local_attention(*(x.detach() for x in layers[1]), mask, tile=16)
    assert sum(counts.values()) == 0, counts


# ------------------------------------------------------------------------------------------
# U2 x R2 on 4 gloo ranks
# ------------------------------------------------------------------------------------------
def _u2r2_plans_and_syncs(kinds):
    from megatron_video.attention.plans import PLANS
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
    from megatron_video.layouts import BalancedSPLayout, shard_sequence
    from megatron_video.layouts.placement import Placement, ring_members
    from megatron_video.parallel import CommTracer, destroy_video_parallel, init_video_parallel

    initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    groups = init_video_parallel(2, 2, ranks_per_node=2, placement="ulysses_inner")
    out = {}
    try:
        S = 128
        for kind in kinds:
            if kind == "teacher_forcing":
                lay = BalancedSPLayout(
                    num_latent_frames=8,
                    tokens_per_frame=S // 16,
                    frames_per_block=2,
                    sp_size=4,
                    ring_size=2,
                )
                mask, scheme = TeacherForcingMask(lay), "contiguous"
            elif kind == "placed_packed":  # routed ring: only the split clip's keys travel
                flat = [*range(0, 40), *range(70, 94), *range(40, 70), *range(94, 128)]
                rows = [None] * 4
                for r, members in enumerate(ring_members(2, 2)):
                    for u, cp in enumerate(members):
                        rows[cp] = torch.tensor(flat[(2 * r + u) * 32 : (2 * r + u + 1) * 32])
                mask = masks.packed([0, 40, 70, 128], masks.causal())
                scheme = Placement(torch.stack(rows))
            else:
                mask, scheme = masks.causal(), "zigzag"
            PLANS.clear()
            g = torch.Generator().manual_seed(0)
            full = [torch.randn(1, S, 4, 8, generator=g) for _ in range(3 * 4)]

            def shard(x):
                if isinstance(scheme, Placement):
                    return scheme.shard(x, groups.cp_rank)
                return shard_sequence(x, groups, dim=1, scheme=scheme)

            layers = [
                tuple(shard(x).requires_grad_() for x in full[3 * i : 3 * i + 3]) for i in range(4)
            ]
            _fwd_bwd(layers[0], groups=groups, mask=mask, scheme=scheme, tile=16)
            builds = PLANS.builds
            with count_host_reads() as counts, CommTracer() as t:
                for qkv in layers[1:]:
                    _fwd_bwd(qkv, groups=groups, mask=mask, scheme=scheme, tile=16)
            counts = dict(counts, kv_bytes=t.bytes("send", direction="fwd"))
            out[kind] = (builds, PLANS.builds, counts, dist.get_rank())
    finally:
        destroy_video_parallel()
        destroy_model_parallel()
    return out


def test_u2r2_one_build_then_none_and_no_host_sync(pool4):
    for res in pool4.run(_u2r2_plans_and_syncs, ("causal", "teacher_forcing", "placed_packed")):
        for kind, (first, later, counts, rank) in res.items():
            assert first == 1 and later == 1, (rank, kind, first, later)
            sent, every = counts.pop("kv_bytes"), 3 * 2 * 64 * 2 * 8 * 4  # 3 layers' K, V
            assert sum(counts.values()) == 0, (rank, kind, counts)
            assert (sent < every) == (kind == "placed_packed"), (rank, kind, sent)


# ------------------------------------------------------------------------------------------
# Megatron's packed sequences: cu_seqlens read once per PackedSeqParams, not per layer
# ------------------------------------------------------------------------------------------
class _Cfg:
    context_parallel_size = 1
    kv_channels = 8
    attention_dropout = 0.0
    cp_comm_type = None


@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
def test_packed_seq_params_read_once_per_micro_batch(fmt):
    """Six layers share one ``PackedSeqParams`` (as Megatron passes it): the first reads
    ``cu_seqlens`` on the host, the other five read nothing; each equals the float64 oracle; a
    ``cu_seqlens`` changed in place is read again (no stale documents)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_video.attention.megatron import DistAttention2D
    from megatron_video.testing.oracles import softmax_attention

    layers = [DistAttention2D(_Cfg(), i + 1, AttnMaskType.causal, "self") for i in range(6)]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(16, 1, 2, 8, generator=g, dtype=F64) for _ in range(3)]
    call = [x[:, 0] for x in qkv] if fmt == "thd" else qkv

    def oracle(bounds):
        doc = torch.bucketize(torch.arange(16), torch.tensor(bounds[1:]), right=True)
        allow = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
        q, k, v = (x.transpose(0, 1) for x in qkv)
        return softmax_attention(q, k, v, allow, 8**-0.5)[0].reshape(16, -1)

    layers[0](*call, None, packed_seq_params=params)
    with count_host_reads() as counts:
        outs = [m(*call, None, packed_seq_params=params) for m in layers[1:]]
    assert sum(counts.values()) == 0, counts
    ref = oracle([0, 5, 12, 16])
    for out in outs:
        torch.testing.assert_close(out.reshape(16, -1), ref, rtol=1e-12, atol=1e-12)
    cu[1] = 9  # in place: documents [0, 9), [9, 12), [12, 16)
    out = layers[1](*call, None, packed_seq_params=params)
    torch.testing.assert_close(out.reshape(16, -1), oracle([0, 9, 12, 16]), rtol=1e-12, atol=1e-12)
