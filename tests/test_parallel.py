"""Foundation: U x R groups from Megatron's parallel state, traced autograd communication."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_video.parallel.topology import cp_index, local_groups
from megatron_video.testing.parallel import model_parallel

# ------------------------------------------------------------------------------------------
# First-principles construction from Megatron's default rank order "tp-cp-ep-dp-pp":
# global rank g = tp + TP * (c + CP * dp)   (PP = EP = 1 here)
# ------------------------------------------------------------------------------------------


def expected_groups(world, tp, cp, U, placement):
    R = cp // U
    dp = world // (tp * cp)
    ulysses, ring = {}, {}
    for t in range(tp):
        for d in range(dp):
            g = lambda c: t + tp * (c + cp * d)  # noqa: E731
            for r in range(R):
                ranks = [
                    g(r * U + u if placement == "ulysses_inner" else u * R + r) for u in range(U)
                ]
                for x in ranks:
                    ulysses[x] = ranks
            for u in range(U):
                ranks = [
                    g(r * U + u if placement == "ulysses_inner" else u * R + r) for r in range(R)
                ]
                for x in ranks:
                    ring[x] = ranks
    return ulysses, ring


def test_cp_index_and_local_groups_pure():
    # Ulysses inner: the a2a group is contiguous, the ring strided; ring inner the reverse.
    ug, rg = local_groups(list(range(8)), 2, 4, "ulysses_inner")
    assert ug == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rg == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ug, rg = local_groups(list(range(8)), 2, 4, "ring_inner")
    assert ug == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rg == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # cp_index is a bijection for every split
    for U, R in [(1, 8), (8, 1), (2, 4), (4, 2)]:
        for pl in ("ulysses_inner", "ring_inner"):
            idx = sorted(cp_index(u, r, U, R, pl) for u in range(U) for r in range(R))
            assert idx == list(range(U * R))


def _membership(tp, cp, U, placement, hier, rpn):
    from megatron_video.parallel import init_video_parallel

    with model_parallel(tp=tp, cp=cp, hierarchical_cp=hier):
        g = init_video_parallel(U, ranks_per_node=rpn, placement=placement)
        # a collective on each group proves the groups are real and consistent
        x = torch.ones(1)
        dist.all_reduce(x, group=g.ulysses_group)
        y = torch.ones(1)
        dist.all_reduce(y, group=g.ring_group)
        return dict(
            ulysses=g.ulysses_ranks,
            ring=g.ring_ranks,
            cp=g.cp_ranks,
            u=g.ulysses_rank,
            r=g.ring_rank,
            c=g.cp_rank,
            reused=g.reused_megatron_groups,
            usum=int(x.item()),
            rsum=int(y.item()),
        )


def _check_membership(results, config, world):
    tp, cp, U, placement, hier, rpn = config
    exp_u, exp_r = expected_groups(world, tp, cp, U, placement)
    R = cp // U
    for rank, got in enumerate(results):
        assert got["ulysses"] == exp_u[rank], (config, rank)
        assert got["ring"] == exp_r[rank], (config, rank)
        assert got["usum"] == U and got["rsum"] == R
        # this rank's indices are consistent with the CP index rule
        assert got["c"] == cp_index(got["u"], got["r"], U, R, placement)
        assert got["cp"][got["c"]] == rank
        if hier and U > 1 and R > 1:
            assert got["reused"], "Megatron's hierarchical CP groups must be reused, not duplicated"


CONFIGS_4 = [
    # tp, cp, U, placement, hierarchical sizes, ranks_per_node
    (1, 2, 1, "ulysses_inner", None, 4),
    (1, 2, 2, "ulysses_inner", None, 2),
    (1, 4, 1, "ulysses_inner", None, 2),
    (1, 4, 2, "ulysses_inner", None, 2),
    (1, 4, 4, "ulysses_inner", None, 4),
    (1, 4, 2, "ulysses_inner", [2, 2], 2),
    (1, 4, 2, "ring_inner", None, 4),
    (1, 4, 2, "ring_inner", [2, 2], 4),
    (2, 2, 1, "ulysses_inner", None, 2),
    (2, 2, 2, "ulysses_inner", None, 4),
    (2, 2, 2, "ring_inner", None, 4),
    (1, 2, 2, "ring_inner", None, 2),
]
CONFIGS_8 = [
    (1, 8, 2, "ulysses_inner", None, 4),
    (1, 8, 4, "ulysses_inner", [4, 2], 4),
    (1, 8, 2, "ulysses_inner", [2, 4], 4),
    (1, 8, 8, "ulysses_inner", None, 8),
    (1, 8, 1, "ring_inner", None, 4),
    (1, 8, 2, "ring_inner", [4, 2], 8),
    (2, 4, 2, "ulysses_inner", [2, 2], 4),
    (2, 4, 4, "ulysses_inner", None, 8),
    (2, 4, 2, "ring_inner", None, 8),
    (1, 4, 2, "ulysses_inner", [2, 2], 4),
    (2, 2, 2, "ulysses_inner", None, 4),
    (1, 2, 2, "ring_inner", None, 4),
]


def _config_id(c):
    tp, cp, U, placement, hier, rpn = c
    return f"tp{tp}-cp{cp}-u{U}-{placement}-{'x'.join(map(str, hier)) if hier else 'flat'}-rpn{rpn}"


@pytest.mark.parametrize("config", CONFIGS_4, ids=_config_id)
def test_group_membership_world4(pool4, config):
    _check_membership(pool4.run(_membership, *config), config, 4)


@pytest.mark.parametrize("config", CONFIGS_8, ids=_config_id)
def test_group_membership_world8(pool8, config):
    _check_membership(pool8.run(_membership, *config), config, 8)


INVALID_CASES = [
    # (megatron kwargs, init_video_parallel kwargs, env, parameter the message must name)
    (dict(context_parallel_size=4), dict(ulysses_size=3), {}, "ulysses_size"),
    (dict(context_parallel_size=4), dict(ulysses_size=0), {}, "ulysses_size"),
    (dict(context_parallel_size=4), dict(ulysses_size=True), {}, "ulysses_size"),
    (dict(context_parallel_size=4), dict(ulysses_size=2, ring_size=3), {}, "ring_size"),
    (dict(context_parallel_size=4), dict(ulysses_size=2, ring_size=0), {}, "ring_size"),
    (dict(context_parallel_size=4), dict(ulysses_size=2, placement="bogus"), {}, "placement"),
    (dict(context_parallel_size=4), dict(ulysses_size=2, ranks_per_node=3), {}, "ranks_per_node"),
    (dict(context_parallel_size=4), dict(ulysses_size=2, ranks_per_node=0), {}, "ranks_per_node"),
    (
        dict(context_parallel_size=4),
        dict(ulysses_size=2),
        {"LOCAL_WORLD_SIZE": "two"},
        "LOCAL_WORLD_SIZE",
    ),
    # Ulysses group across nodes: TP*U = 4 > 2 ranks per node
    (
        dict(tensor_model_parallel_size=2, context_parallel_size=2),
        dict(ulysses_size=2, ranks_per_node=2),
        {},
        "ulysses_size",
    ),
    # ring-inner placement puts the a2a group across nodes when CP spans two nodes
    (
        dict(context_parallel_size=4),
        dict(ulysses_size=2, placement="ring_inner", ranks_per_node=2),
        {},
        "ulysses_size",
    ),
    # Megatron's hierarchical groups disagree with U x R
    (
        dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[4, 1]),
        dict(ulysses_size=2),
        {},
        "hierarchical_context_parallel_sizes",
    ),
]


def _invalid_config(mkw, vkw, env, name):
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel import init_video_parallel

    initialize_model_parallel(**mkw)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        init_video_parallel(**vkw)
        message = (name, None)
    except ValueError as e:
        message = (name, str(e))
    finally:
        for k, v in saved.items():
            os.environ[k] = v if v is not None else ""
            if v is None:
                del os.environ[k]
        destroy_model_parallel()
    # after the rejected configuration the group machinery still works
    initialize_model_parallel(context_parallel_size=4)
    g = init_video_parallel(2, ranks_per_node=4)
    return message, g.ulysses_size * g.ring_size


@pytest.mark.parametrize(
    "i", range(len(INVALID_CASES)), ids=[f"{c[3]}-{i}" for i, c in enumerate(INVALID_CASES)]
)
def test_invalid_configurations_raise_value_error_naming_parameter(pool4, i):
    assert len(INVALID_CASES) >= 8
    for (name, msg), cp in pool4.run(_invalid_config, *INVALID_CASES[i]):
        assert cp == 4
        assert msg is not None, f"expected ValueError naming {name}"
        assert name in msg, (name, msg)


# ------------------------------------------------------------------------------------------
# Communication
# ------------------------------------------------------------------------------------------
class _WrongRingShift(torch.autograd.Function):
    """A ring exchange whose backward sends the gradient the wrong way (for the negative check)."""

    @staticmethod
    def forward(ctx, x, group):
        from megatron_video.parallel.comm import RingExchange

        ctx.group = group
        return RingExchange([x], group, 1).wait()[0]

    @staticmethod
    def backward(ctx, grad):
        from megatron_video.parallel.comm import RingExchange

        return RingExchange([grad], ctx.group, 1).wait()[0], None


def _comm_checks(gradcheck=True):
    from megatron_video.parallel.comm import (
        CommTracer,
        RingExchange,
        all_gather_cat,
        all_reduce,
        all_to_all,
        check_same_shape,
        copy_to_group,
        gather_from_group,
        ring_shift,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    half = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    res = {}
    g = torch.Generator().manual_seed(rank)
    # round trips over several (scatter, gather) pairs and groups
    ok = True
    for grp in [group] + ([half[rank // 2]] if half else []):
        n = dist.get_world_size(grp)
        for sd, gd in [(0, 1), (1, 0), (2, 1), (1, 2), (2, 0)]:
            shape = [n * 2, n * 3, n]
            x = torch.randn(shape, generator=g, dtype=torch.float64)
            y = all_to_all(x, grp, sd, gd)
            z = all_to_all(y, grp, gd, sd)
            ok &= torch.equal(x, z)
            # semantics: the chunk from group rank j sits at slot j of the gather dim
            exp_shape = list(shape)
            exp_shape[sd] //= n
            exp_shape[gd] *= n
            ok &= list(y.shape) == exp_shape
    res["roundtrip"] = ok
    # content check against an all-gather oracle
    x = torch.arange(world * 6, dtype=torch.float64).reshape(world, 6) + 100 * rank
    y = all_to_all(x, group, scatter_dim=0, gather_dim=1)
    full = all_gather_cat(x.unsqueeze(0), group, dim=0)  # [world(src), world(chunk), 6]
    res["content"] = torch.equal(
        y, torch.cat([full[j, rank : rank + 1] for j in range(world)], dim=1)
    )

    # gradcheck (float64) of the autograd all-to-all and ring exchange. gradcheck perturbs inputs
    # on all ranks at once, so the checked function must be global: a replicated input X (every
    # rank holds all ranks' shards; gradient all-reduced), this rank's shard, the op, and a
    # replicated gathered output.
    gs = torch.Generator().manual_seed(1234)  # same X on every rank
    xa = torch.randn(world, world, 2, 3, dtype=torch.float64, generator=gs, requires_grad=True)
    wa = torch.randn(world, 1, 2, 3 * world, dtype=torch.float64, generator=gs)  # breaks symmetry

    def f_a2a(x):
        local = copy_to_group(x, group)[rank]
        return gather_from_group(all_to_all(local, group, 0, 2) * wa[rank], group, dim=0)

    res["gradcheck_a2a"] = torch.autograd.gradcheck(f_a2a, (xa,)) if gradcheck else None
    xr = torch.randn(world, 3, 2, dtype=torch.float64, generator=gs, requires_grad=True)

    def f_ring(x):
        local = copy_to_group(x, group)[rank]
        return gather_from_group(ring_shift(local, group, 1) * (rank + 1), group, dim=0)

    res["gradcheck_ring"] = torch.autograd.gradcheck(f_ring, (xr,)) if gradcheck else None

    # permutations riding on the all-to-all equal index_select before / after the plain one, values
    # and gradients (the oracle is the unpermuted op composed with torch's index_select)
    ps, pg = torch.randperm(2 * world, generator=gs), torch.randperm(3 * world, generator=gs)
    xp = torch.randn(1, 3, 2 * world, 5, dtype=torch.float64, generator=gs)
    wp = torch.randn(1, 3 * world, 2, 5, dtype=torch.float64, generator=gs)
    fused = xp.clone().requires_grad_()
    y1 = all_to_all(fused, group, 2, 1, scatter_index=ps, gather_index=pg)
    (y1 * wp).sum().backward()
    plain = xp.clone().requires_grad_()
    y2 = all_to_all(plain.index_select(2, ps), group, 2, 1).index_select(1, pg)
    (y2 * wp).sum().backward()
    res["permuted"] = torch.equal(y1, y2) and torch.equal(fused.grad, plain.grad)
    if gradcheck:

        def f_perm(x):
            local = copy_to_group(x, group)[rank]
            return gather_from_group(
                all_to_all(
                    local,
                    group,
                    1,
                    0,
                    scatter_index=ps[:world].argsort(),
                    gather_index=pg[:world].argsort(),
                )
                * (rank + 1),
                group,
                dim=0,
            )

        xq = torch.randn(world, 1, world, 2, dtype=torch.float64, generator=gs, requires_grad=True)
        res["gradcheck_perm"] = torch.autograd.gradcheck(f_perm, (xq,))
    # a wrong backward must be caught by the same check (the test can fail)
    if gradcheck:

        def f_wrong(x):
            return gather_from_group(
                _WrongRingShift.apply(copy_to_group(x, group)[rank], group), group, 0
            )

        res["gradcheck_catches_bug"] = not torch.autograd.gradcheck(
            f_wrong, (xr,), raise_exception=False
        )
    res["ring_value"] = torch.equal(
        ring_shift(torch.full((2,), float(rank)), group, 1),
        torch.full((2,), float((rank - 1) % world)),
    )

    # tracer: exact call and byte counts
    with CommTracer() as t:
        x = torch.randn(world * 4, 5, 7, dtype=torch.float32, requires_grad=True)
        y = all_to_all(x, group, scatter_dim=0, gather_dim=1, tag="t.a2a")
        y.sum().backward()
        ex = RingExchange(
            [torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(11, dtype=torch.float64)],
            group,
            shift=1,
            tag="t.ring",
        )
        ex.wait()
        buf = torch.ones(10, dtype=torch.float32)
        all_reduce(buf, group, tag="t.ar")
    nb = world * 4 * 5 * 7 * 4
    res["tracer"] = dict(
        a2a_fwd=(t.count("all_to_all", "fwd"), t.bytes("all_to_all", "fwd")),
        a2a_bwd=(t.count("all_to_all", "bwd"), t.bytes("all_to_all", "bwd")),
        send=(t.count("send"), t.bytes("send")),
        ar=(t.count("all_reduce"), t.bytes("all_reduce")),
        expect_a2a=nb * (world - 1) // world,
        expect_send=3 * 5 * 2 + 11 * 8,
        expect_ar=40 * (world - 1) // world,
        intra_a2a=t.count("all_to_all", intra_node=True),
        table=t.table(),
    )
    # shape mismatch between ranks is detected before a collective, on every rank
    bad = torch.zeros(2, 3 + (rank == 1))
    try:
        check_same_shape({"x": bad}, group, where="test")
        res["mismatch"] = None
    except ValueError as e:
        res["mismatch"] = str(e)
    # indivisible scatter dim is a ValueError, raised before any traffic
    try:
        all_to_all(torch.zeros(world + 1, 2), group, 0, 1)
        res["indivisible"] = None
    except ValueError as e:
        res["indivisible"] = str(e)
    try:  # a permutation of the wrong length names the parameter, before any traffic
        all_to_all(torch.zeros(world, 2), group, 0, 1, gather_index=torch.arange(3))
        res["bad_index"] = None
    except ValueError as e:
        res["bad_index"] = str(e)
    return res


def test_comm_roundtrip_gradcheck_and_tracer(pool4):
    for _rank, res in enumerate(pool4.run(_comm_checks, ranks_per_node=2)):
        assert res["roundtrip"] and res["content"]
        assert res["gradcheck_a2a"] and res["gradcheck_ring"] and res["ring_value"]
        assert res["gradcheck_catches_bug"]
        assert res["permuted"] and res["gradcheck_perm"]
        tr = res["tracer"]
        assert tr["a2a_fwd"] == (1, tr["expect_a2a"])
        assert tr["a2a_bwd"] == (1, tr["expect_a2a"])
        assert tr["send"] == (2, tr["expect_send"])
        assert tr["ar"] == (1, tr["expect_ar"])
        assert tr["intra_a2a"] == 0  # world group spans both simulated nodes
        assert "all_to_all" in tr["table"]
        assert res["mismatch"] is not None and "differ between ranks" in res["mismatch"]
        assert res["indivisible"] is not None and "divisible" in res["indivisible"]
        assert res["bad_index"] is not None and res["bad_index"].startswith("gather_index (")
        assert "permutation of 8 positions" in res["bad_index"], res[
            "bad_index"
        ]  # [4, 2] -> gather 2 * 4


def test_comm_world8(pool8):
    # gradcheck is covered on 4 ranks; here the round trips, content and byte counts at N = 8
    for res in pool8.run(_comm_checks, gradcheck=False):
        assert res["roundtrip"] and res["content"] and res["ring_value"] and res["permuted"]
        assert res["tracer"]["a2a_fwd"] == (1, res["tracer"]["expect_a2a"])


def _device_only_groups_run():
    """Megatron's groups and ours on a backend with no CPU device, as NCCL on GPUs (torch's
    FakeProcessGroup registered for "cuda" only: a CPU tensor on it raises), the world staying
    gloo. 2D attention (Ulysses a2a, shape check), the loss reductions and the agreement checks on
    host tensors must all travel over ``comm.host_group``'s gloo groups."""
    from torch._C._distributed_c10d import FakeProcessGroup

    from megatron_video.attention import dist_attention, masks
    from megatron_video.layouts import shard_sequence
    from megatron_video.parallel import comm, destroy_video_parallel, init_video_parallel
    from megatron_video.parallel.comm import groups as comm_groups
    from megatron_video.testing.oracles import attention_with_grads, max_rel_error, random_qkv

    if not hasattr(dist.Backend, "DEVICEONLY"):
        dist.Backend.register_backend(
            "deviceonly",
            lambda store, rank, size, timeout: FakeProcessGroup._create_internal(rank, size),
            devices=["cuda"],
        )
    new_group = dist.new_group

    def device_only(*a, backend=None, **kw):  # Megatron's and our groups; its gloo ones stay gloo
        return new_group(*a, backend="deviceonly" if backend in (None, "nccl") else backend, **kw)

    dist.new_group, res = device_only, {}
    try:
        with model_parallel(cp=4, hierarchical_cp=[2, 2]):
            groups = init_video_parallel(2, ranks_per_node=2)
            try:  # the emulation is real: a host tensor on the group itself is refused
                dist.all_reduce(torch.ones(1), group=groups.cp_group)
            except RuntimeError as e:
                res["refused"] = str(e)
            q, k, v, dout = random_qkv(1, 64, 4, 4, 8, seed=3)
            ref = attention_with_grads(q, k, v, dout, torch.ones(64, 64, dtype=torch.bool).tril())
            shard = lambda x: shard_sequence(x, groups, scheme="zigzag")  # noqa: E731
            ql, kl, vl = (shard(x).clone().requires_grad_() for x in (q, k, v))
            out = dist_attention(ql, kl, vl, groups, mask=masks.causal(), scheme="zigzag")
            (out * shard(dout)).sum().backward()
            got = [out, ql.grad, kl.grad, vl.grad]
            res["error"] = max_rel_error(got, [shard(r) for r in ref])
            x = comm.all_reduce(torch.tensor([float(dist.get_rank())]), groups.cp_group)
            res["sum"] = float(x)
            try:
                n = 2 + dist.get_rank() % 2
                comm.check_same_shape({"x": torch.zeros(n)}, groups.ulysses_group, "t")
            except ValueError as e:
                res["mismatch"] = str(e)
            ug, me = groups.ulysses_group, dist.get_rank()
            res["me"] = me
            res["counts"] = comm.exchange_counts([me, me + 10], ug)
            res["gathered"] = comm.all_gather_cat(torch.tensor([me]), ug).tolist()
            res["broadcast"] = int(comm.broadcast(torch.tensor([me]), ug, src=1))
            comm.check_same_values({"ids": torch.arange(4)}, groups.ring_group, "t")
            res["mirrors"] = len(comm_groups._HOST_GROUPS)
            res["same_mirror"] = comm.host_group(groups.cp_group) is comm.host_group(
                groups.cp_group
            )
            destroy_video_parallel()
            res["dropped"] = len(comm_groups._HOST_GROUPS)
    finally:
        dist.new_group = new_group
    return res


def test_host_tensors_avoid_device_only_groups(pool4):
    """With groups that cannot carry CPU tensors (NCCL), every host-side collective (shape checks,
    counts, flags) goes over a gloo group of the same ranks; 2D attention stays exact."""
    for res in pool4.run(_device_only_groups_run, ranks_per_node=2):
        assert "No backend type associated with device type cpu" in res["refused"], res
        assert res["error"] < 1e-10, res
        assert res["sum"] == 6.0
        u0 = res["gathered"][0]  # Ulysses groups {0, 1} and {2, 3}: counts from both members
        assert res["gathered"] == [u0, u0 + 1] and res["broadcast"] == u0 + 1
        gr = res["me"] - u0  # group rank j sent [u0 + j, u0 + j + 10]: this rank gets entry gr
        assert res["counts"] == [u0 + 10 * gr, u0 + 1 + 10 * gr], res
        assert "differ between ranks" in res["mismatch"]
        assert res["mirrors"] >= 2 and res["same_mirror"] and res["dropped"] == 0, res


def _ring_pads_run():
    from megatron_video.parallel.comm import RingExchange

    rank, batch, batches = dist.get_rank(), dist.batch_isend_irecv, [0]

    def counted(ops):
        batches[0] += 1
        return batch(ops)

    group = dist.new_group([0, 1, 2, 3])
    dist.batch_isend_irecv = counted
    try:  # only rank 0 sends (to rank 1); ranks 2 and 3 have nothing to move
        send = [torch.full((3,), 7.0)] if rank == 0 else []
        recv = [torch.empty(3)] if rank == 1 else []
        got = RingExchange(send, group, 1, recv=recv, device=torch.device("cpu")).wait()
        try:
            RingExchange([], group, 1, recv=[])
        except ValueError as e:
            refused = str(e)
    finally:
        dist.batch_isend_irecv = batch
    return batches[0], [t.tolist() for t in got], refused


def test_ring_exchange_every_rank_posts_a_batch(pool4):
    """A rank with nothing to move still posts a batch (one pad byte each way), so a group's first
    batch, where NCCL builds its communicator, is joined by all its ranks."""
    for rank, (batches, got, refused) in enumerate(pool4.run(_ring_pads_run)):
        assert batches == 1
        assert got == ([[7.0, 7.0, 7.0]] if rank == 1 else [])
        assert "device must be given" in refused
