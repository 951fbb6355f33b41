"""MM-SP (two-stage sharding for long-video understanding) on Megatron-Core's LLaVA model.

Pure maps (no processes): stage-1 frame shards (tubelets whole, remainders rotated, every unit
exactly once) and the stage-2 re-shard, emulated for every rank, assemble exactly the zigzag shard
of the combined sequence; the inverse map sends every gradient row back to its producer.

On 4 gloo ranks, float64, for U2xR2 (``a2a+p2p``), U4 (``a2a``), R4 (``p2p``) and TP2 x CP2: the
loss and the gradients of the LLM, the projector and the vision encoder equal the single-process
model (Megatron's own LLaVA forward at CP = 1 with Megatron's local core attention; for packed
samples its forward with the 2D attention's packed mask at CP = 1) -- for an unpacked batch with
videos whose frame count does not divide the CP size and a sample without video, a packed sample
(three documents over one sequence) and a batch with no video at all. Each rank's encoder sees only
its frames, and the re-shard is one all-to-all-v forward and one backward with exact byte counts.
"""

import zlib

import pytest
import torch
from torch.testing import assert_close

from megatron_video.layouts import mmsp as L
from megatron_video.layouts.zigzag import shard_global_ids

IMG = -200


# ---------------------------------------------------------------------------------------------
# pure maps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "frames,cp,t", [([5, 6, 4], 4, 1), ([8, 6], 2, 2), ([7], 1, 1), ([9, 4, 5], 3, 1)]
)
def test_frame_shards_cover_each_unit_once(frames, cp, t):
    sh = L.frame_shards(frames, cp, t)
    units = [f // t for f in frames]
    got = torch.cat([sh.local_units(r) for r in range(cp)]).sort().values
    assert got.tolist() == list(range(sum(units)))
    totals = [sh.local_units(r).numel() for r in range(cp)]
    assert max(totals) - min(totals) <= 1, totals  # remainders rotate over the ranks
    start = 0
    for _j, n in enumerate(units):  # every rank holds one contiguous run of every video
        owners = sh.owner[start : start + n].tolist()
        assert owners == sorted(owners) and set(owners) == set(range(cp)), owners
        start += n
    for r in range(cp):  # tubelets stay whole: frames come in aligned runs of t
        f = sh.local_frames(r).view(-1, t)
        assert (f[:, 0] % t == 0).all() and (f.diff(dim=1) == 1).all()
        assert (sh.local_index[sh.local_units(r)] == torch.arange(totals[r])).all()


def _batch():
    ids = torch.arange(2 * 14).view(2, 14) % 50 + 1
    ids[0, 2], ids[0, 9] = IMG, IMG
    return ids, [5, 6]


def test_reshard_plan_assembles_the_zigzag_shard():
    ids, frames = _batch()
    P, N, h = 3, 4, 2
    sh = L.frame_shards(frames, N)
    lay = L.sequence_layout(ids, IMG, [f * P for f in frames], N)
    assert lay.seq_len % (2 * N) == 0 and lay.lengths.tolist() == [14 - 2 + 11 * P, 14]
    text = torch.randn(ids.numel(), h, dtype=torch.float64)
    visual = torch.randn(sum(frames) * P, h, dtype=torch.float64)  # source order
    full = torch.zeros(lay.batch * lay.seq_len, h, dtype=torch.float64)
    full[lay.text_pos] = text[lay.text_src]
    full[lay.visual_pos] = visual
    full = full.view(lay.batch, lay.seq_len, h)
    plans = [L.reshard_plan(lay, sh, P, r) for r in range(N)]
    local_vis = [visual.view(-1, P, h)[sh.local_units(r)].reshape(-1, h) for r in range(N)]
    sends = [local_vis[r][p.send_index].split(p.send_counts) for r, p in enumerate(plans)]
    for r, p in enumerate(plans):
        assert [plans[s].send_counts[r] for s in range(N)] == p.recv_counts
        recv = torch.cat([sends[s][r] for s in range(N)])
        rows = torch.cat([torch.zeros(1, h, dtype=torch.float64), text[p.text_index], recv])
        got = rows[p.gather].view(lay.batch, lay.local_len, h)
        want = full[:, shard_global_ids(r, N, lay.seq_len, "zigzag")]
        assert torch.equal(got, want), r
        # inverse map: every local position names its producer
        kind, src_rank, src_idx = L.position_sources(lay, sh, P, r)
        flat = got.reshape(-1, h)
        for k, sr, si, row in zip(kind.tolist(), src_rank.tolist(), src_idx.tolist(), flat):
            if k == 1:
                assert torch.equal(row, text[si])
            elif k == 2:
                assert torch.equal(row, local_vis[sr][si])
            else:
                assert not row.any()
    # every visual token lands on exactly one rank
    dst, _ = L.visual_targets(lay)
    assert sum(sum(p.recv_counts) for p in plans) == visual.shape[0] == dst.numel()


def test_causal_work_of_zigzag_is_balanced_for_one_sequence():
    ids = torch.ones(1, 32, dtype=torch.long)
    lay = L.sequence_layout(ids, IMG, [], 4)
    work = [L.causal_work(lay, r) for r in range(4)]
    assert len(set(work)) == 1 and sum(work) == 32 * 33 // 2


# ---------------------------------------------------------------------------------------------
# multi-rank exactness
# ---------------------------------------------------------------------------------------------
SIZES = dict(
    vocab_size=64,
    max_sequence_length=128,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vision_layers=1,
    vision_hidden_size=16,
    vision_heads=2,
    img_size=8,
    patch_dim=4,
)

# name -> (tp, cp, hierarchical sizes, cp_comm_type)
CASES = {
    "u2xr2": (1, 4, [2, 2], "a2a+p2p"),
    "r4": (1, 4, None, "p2p"),
    "tp2xcp2": (2, 2, None, "p2p"),
    "u4": (1, 4, None, "a2a"),
}


def _data(name):
    """(images, input_ids, labels, loss_mask, num_image_tiles, cu_seqlens or None)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name == "unpacked":  # videos of 5 and 6 frames in sample 0, no video in sample 1
        ids = torch.randint(1, 64, (2, 14), generator=g)
        ids[0, 2], ids[0, 9] = IMG, IMG
        frames = [5, 6]
    elif name == "packed":  # three documents: video(6) + text | text | text + video(4)
        ids = torch.randint(1, 64, (1, 20), generator=g)
        ids[0, 3], ids[0, 15] = IMG, IMG
        frames = [6, 4]
    else:  # "text_only": no video in the batch
        ids = torch.randint(1, 64, (2, 12), generator=g)
        frames = []
    labels = torch.randint(0, 64, ids.shape, generator=g)
    loss_mask = (torch.rand(ids.shape, generator=g) > 0.2).double()
    images = torch.randn(sum(frames), 3, 8, 8, generator=g, dtype=torch.float64)
    cu = None
    if name == "packed":
        width = torch.where(
            ids[0] == IMG,
            4 * torch.tensor([frames[0] if i == 3 else frames[1] for i in range(20)]),
            torch.ones(20, dtype=torch.long),
        )
        start = torch.cat([torch.zeros(1, dtype=torch.long), width.cumsum(0)])
        cu = torch.tensor([0, int(start[8]), int(start[13]), int(start[20])], dtype=torch.int32)
    return images, ids, labels, loss_mask, torch.tensor(frames, dtype=torch.int), cu


def _perturb(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _full(model, what):
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out = {}
    tp = ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        if what == "grad":
            t = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            if ps.get_context_parallel_world_size() > 1:
                comm.all_reduce(
                    t, ps.get_context_parallel_group()
                )  # what DDP's dp_cp reduction sums
        else:
            t = p.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            t = comm.all_gather_cat(t, ps.get_tensor_model_parallel_group(), dim=p.partition_dim)
        out[name] = t
    return out


def _load(model, full):
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = full[name]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                v = v.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(v)


def _step(model, name, cp_group=None):
    """Forward + backward of one data case; the loss normalised over the global target count."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_video.mmsp import global_token_loss

    images, ids, labels, loss_mask, tiles, cu = _data(name)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    packed = (
        None
        if cu is None
        else PackedSeqParams(
            qkv_format="sbhd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int(cu[-1]),
            max_seqlen_kv=int(cu[-1]),
        )
    )  # RoPE length: the combined sequence (positions are global)
    model.zero_grad(set_to_none=True)
    logits, _ = model(
        images,
        ids,
        pos,
        None,
        num_image_tiles=tiles,
        packed_seq_params=packed,
        runtime_gather_output=True,
    )
    batch = model.last_mmsp_batch if cp_group is not None else None
    lab, mask = model.local_labels(ids, labels, loss_mask, tiles, batch=batch)
    ce = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), lab.flatten().clamp(min=0), reduction="none"
    ).view_as(mask)
    mask = mask.double() * (lab >= 0)
    loss = global_token_loss(ce, mask, cp_group)
    loss.backward()
    total = loss.detach().clone()
    if cp_group is not None:
        from megatron_video.parallel import comm

        comm.all_reduce(total, cp_group)
    return float(total), _full(model, "grad")


def _run(case_names, data_names):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model
    from megatron_video.parallel.comm import CommTracer

    sizes = VideoLLaVASizes(**SIZES)
    out = {}
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    ref = {
        n: video_llava_model(sizes, two_d_attention=(n == "packed")).double() for n in data_names
    }
    _perturb(ref[data_names[0]])
    weights = _full(ref[data_names[0]], "param")
    for n in data_names:
        _load(ref[n], weights)
        out[("reference", n)] = _step(ref[n], n)
    destroy_model_parallel()
    for case in case_names:
        tp, cp, hier, comm_type = CASES[case]
        kw = dict(tensor_model_parallel_size=tp, context_parallel_size=cp)
        if hier:
            kw["hierarchical_context_parallel_sizes"] = hier
        ps.initialize_model_parallel(**kw)
        try:
            model = video_llava_model(sizes, tp=tp, cp=cp, cp_comm_type=comm_type).double()
            _load(model, weights)
            for n in data_names:
                with CommTracer() as tr:
                    loss, grads = _step(model, n, ps.get_context_parallel_group())
                b = model.last_mmsp_batch
                r = ps.get_context_parallel_rank()
                row = SIZES["hidden_size"] * 8
                out[(case, n)] = (
                    loss,
                    grads,
                    dict(
                        units=int(b.shards.local_units(r).numel()),
                        total_units=b.shards.total_units,
                        a2av=(tr.count("all_to_all_v", "fwd"), tr.count("all_to_all_v", "bwd")),
                        bytes=(tr.bytes("all_to_all_v", "fwd"), tr.bytes("all_to_all_v", "bwd")),
                        want=row * (sum(b.plan.send_counts) - b.plan.send_counts[r]),
                        want_bwd=row * (sum(b.plan.recv_counts) - b.plan.recv_counts[r]),
                    ),
                )
        finally:
            destroy_model_parallel()
    dist.barrier()
    return out


def _check(per_rank, cases, data_names):
    ref0 = per_rank[0]
    for n in data_names:
        loss_ref, grads_ref = ref0[("reference", n)]
        assert loss_ref > 0
        vis = [k for k in grads_ref if k.startswith("vision_model.")]
        proj = [k for k in grads_ref if k.startswith("vision_projection.")]
        if n != "text_only":  # the encoder and projector are in the graph and get gradients
            assert vis and proj and all(float(grads_ref[k].abs().max()) > 0 for k in vis + proj), n
        for rank, res in enumerate(per_rank):
            for case in cases:
                loss, grads, info = res[(case, n)]
                assert loss == pytest.approx(loss_ref, rel=1e-9, abs=1e-12), (case, n, rank)
                assert set(grads) == set(grads_ref)
                for k, g in grads_ref.items():
                    scale = float(g.abs().max()) + 1e-30
                    assert_close(
                        grads[k],
                        g,
                        rtol=1e-7,
                        atol=1e-9 * scale,
                        msg=lambda m: f"{case}/{n}/rank{rank} grad {k}: {m}",
                    )
                # ONE all-to-all-v each way (no visual token: nothing needs a gradient back)
                assert info["a2av"] == (1, int(n != "text_only")), (case, n, info)
                assert info["bytes"] == (info["want"], info["want_bwd"]), (case, n, info)
        for case in cases:  # stage 1: every frame encoded once, by one rank, balanced
            units = [per_rank[r][(case, n)][2]["units"] for r in range(len(per_rank))]
            tp = CASES[case][0]
            assert sum(units) == tp * per_rank[0][(case, n)][2]["total_units"], (case, n, units)
            assert max(units) - min(units) <= 1


DATA = ["unpacked", "packed", "text_only"]


@pytest.mark.parametrize("case", ["u2xr2", "r4", "tp2xcp2"])
def test_exact_vs_single_process_two_nodes(pool4, case):
    _check(pool4.run(_run, [case], DATA), [case], DATA)


def test_exact_vs_single_process_ulysses4(pool4):
    per_rank = pool4.run(_run, ["u4"], DATA, ranks_per_node=4)
    _check(per_rank, ["u4"], DATA)


# ---------------------------------------------------------------------------------------------
# the primitive: comm.all_to_all_v with uneven (and zero) counts, its inverse backward, bad counts
# ---------------------------------------------------------------------------------------------
COUNTS = [[0, 3, 1, 2], [2, 0, 0, 5], [1, 1, 1, 1], [0, 0, 4, 0]]  # COUNTS[src][dst]


def _a2av_rows():
    import torch.distributed as dist

    from megatron_video.parallel import comm

    me, n = dist.get_rank(), 4
    # row (src, dst, k) carries the value 100*src + 10*dst + k, three features wide
    vals = [100 * me + 10 * d + k for d in range(n) for k in range(COUNTS[me][d])]
    x = torch.tensor(vals, dtype=torch.float64)[:, None].repeat(1, 3).requires_grad_(True)
    with comm.CommTracer() as tr:
        y = comm.all_to_all_v(x, COUNTS[me], None, tag="t")
        (y * (1 + torch.arange(y.shape[0], dtype=torch.float64))[:, None]).sum().backward()
    errors = {}
    bad_sum = [COUNTS[me][0] + 1] + COUNTS[me][1:]
    for name, counts in (("length", [1, 2, 3]), ("sum", bad_sum), ("negative", [-1, 3, 1, 3])):
        try:
            comm.all_to_all_v(x.detach()[: sum(COUNTS[me])], counts, None)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
        dist.barrier()
    return dict(
        y=y.detach(),
        grad=x.grad,
        fwd=tr.bytes("all_to_all_v", "fwd"),
        bwd=tr.bytes("all_to_all_v", "bwd"),
        calls=tr.count("all_to_all_v"),
        counts_calls=tr.count("a2a_counts"),
        errors=errors,
    )


def test_all_to_all_v_uneven_counts(pool4):
    res = pool4.run(_a2av_rows)
    for me, r in enumerate(res):
        want = [100 * s + 10 * me + k for s in range(4) for k in range(COUNTS[s][me])]
        assert r["y"][:, 0].tolist() == want and (r["y"] == r["y"][:, :1]).all()
        assert r["calls"] == 2 and r["counts_calls"] == 1
        row = 3 * 8
        assert r["fwd"] == row * (sum(COUNTS[me]) - COUNTS[me][me])
        assert r["bwd"] == row * (sum(COUNTS[s][me] for s in range(4)) - COUNTS[me][me])
        # the gradient of each sent row is the weight its receiver gave it (1 + received position)
        for d in range(4):
            start = sum(COUNTS[me][:d])
            pos0 = sum(COUNTS[s][d] for s in range(me))
            for k in range(COUNTS[me][d]):
                assert r["grad"][start + k].tolist() == [1.0 + pos0 + k] * 3, (me, d, k)
        for name, msg in r["errors"].items():
            assert msg is not None and "send_counts" in msg, (name, msg)


# ---------------------------------------------------------------------------------------------
# pipeline parallelism: PP2 x CP2 through Megatron's pipelined schedule
# ---------------------------------------------------------------------------------------------
def _stage_name(model, name):
    """Parameter name with the stage's local layer index replaced by the global one."""
    parts = name.split(".")
    if parts[:3] == ["language_model", "decoder", "layers"]:
        parts[3] = str(model.language_model.decoder.layers[int(parts[3])].layer_number - 1)
    return ".".join(parts)


def _pp_run():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.mmsp import global_token_loss
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model

    sizes = VideoLLaVASizes(**SIZES)
    images, ids, labels, loss_mask, tiles, _ = _data("unpacked")
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    f64 = dict(pipeline_dtype=torch.float64)

    def step(model, cp_group):
        def fwd(it, m):
            next(it)
            out, mask = m(
                images, ids, pos, None, labels=labels, loss_mask=loss_mask, num_image_tiles=tiles
            )

            def loss_func(o):
                share = global_token_loss(o.double(), mask, cp_group)
                return share, {"loss": share.detach().clone()}  # the schedule scales share in place

            return out, loss_func

        model.zero_grad(set_to_none=True)
        return get_forward_backward_func()(
            forward_step_func=fwd,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=SIZES["max_sequence_length"],
            micro_batch_size=ids.shape[0],
            forward_only=False,
        )

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    ref = video_llava_model(sizes, **f64).double()
    _perturb(ref)
    weights = _full(ref, "param")
    ref_loss = float(step(ref, None)[0]["loss"])
    ref_grads = {k: v.clone() for k, v in _full(ref, "grad").items()}
    destroy_model_parallel()

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)
    try:
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = video_llava_model(
            sizes, cp=2, cp_comm_type="a2a", pp=2, pre_process=first, post_process=last, **f64
        ).double()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[_stage_name(model, name)])
        losses = step(model, ps.get_context_parallel_group())
        grads = {
            _stage_name(model, k): v / 2 for k, v in _full(model, "grad").items()
        }  # schedule x CP
        loss = float(losses[0]["loss"]) if last else None
        if last:
            t = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(t, group=ps.get_context_parallel_group())
            loss = float(t)
    finally:
        destroy_model_parallel()
    return dict(
        ref_loss=ref_loss, ref_grads=ref_grads, loss=loss, grads=grads, first=first, last=last
    )


def test_pipeline_pp2_cp2(pool4):
    per_rank = pool4.run(_pp_run)
    seen = set()
    for rank, r in enumerate(per_rank):
        assert r["first"] != r["last"]
        if r["last"]:  # Megatron's CE runs in fp32: the loss agrees to fp32 rounding
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        for k, g in r["grads"].items():
            ref = r["ref_grads"][k]
            assert_close(
                g,
                ref,
                rtol=1e-5,
                atol=1e-6 * (float(ref.abs().max()) + 1e-30),
                msg=lambda m: f"pp2xcp2 rank{rank} grad {k}: {m}",
            )
            seen.add(k)
    assert seen == set(per_rank[0]["ref_grads"]), sorted(set(per_rank[0]["ref_grads"]) - seen)
    assert any(k.startswith("vision_model.") for k in seen)
