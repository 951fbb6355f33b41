"""Packed video micro-batches in the models (issue 21, model side), float64.

A packed micro-batch is one sequence (batch 1) of clips with different frames x height x width
(an image is a one-frame clip), padded to a multiple of the CP size. The oracle is the existing
unpacked model path (held to float64 formulas in tests/test_dit_blocks.py, tests/test_stdit.py and
to CP = 1 in tests/test_video_stock_job.py): every clip run alone at batch 1 on one process, the
loss ``sum of per-token losses / all loss tokens``. Packed, the model must give the same loss,
outputs and parameter gradients -- on one process and on 4 gloo ranks (U2xR2, U4, R4) under
placements from ``plan_placement`` and hand-made ones. Negative controls: a clip given a wrong
(t, h, w) RoPE grid, or a mask that lets clips attend each other, must change the result.
"""

import socket
import zlib

import pytest
import torch
import torch.distributed as dist

from megatron_video.layouts.packed_video import PackedVideo, VideoClip
from megatron_video.layouts.placement import Placement

C_IN, L = 4, 6
# (frames, height, width) after patchify: different frames, heights, widths and an image
GRIDS = [(3, 2, 3), (2, 3, 2), (1, 2, 2), (2, 2, 4)]
AR_GRIDS = [(4, 2, 2), (2, 3, 2), (1, 2, 3), (2, 2, 1)]  # teacher forcing: 2 x tokens each
FPB = {0: 2, 1: 1, 2: 1, 3: 2}  # AR frames per block per clip
SEQ = 56  # 50 video tokens + 6 padding (zigzag over 4 CP ranks needs a multiple of 8)
AR_SEQ = 80  # 2 x (16 + 12 + 6 + 4) = 76 tokens + 4 padding (even per ring rank)


def video_pack(seq_len=SEQ, grids=GRIDS):
    return PackedVideo.from_grids(grids, seq_len=seq_len)


def ar_pack(seq_len=AR_SEQ):
    clips = [VideoClip(*g, "teacher_forcing", FPB[i]) for i, g in enumerate(AR_GRIDS)]
    return PackedVideo(tuple(clips), seq_len)


# ---------------------------------------------------------------------------------------------
# the pure description
# ---------------------------------------------------------------------------------------------
def test_packed_video_maps():
    p = video_pack()
    assert p.starts == (0, 18, 30, 34) and p.pad == 6 and p.cu_seqlens == [0, 18, 30, 34, 50]
    assert p.num_loss_tokens == 50
    ids = torch.arange(SEQ)
    clip = p.clip_of(ids)
    assert clip[:18].eq(0).all() and clip[30:34].eq(2).all() and clip[50:].eq(-1).all()
    thw = p.token_thw(ids)
    # clip 1 (2 x 3 x 2): its token 7 is frame 1, row 0, column 1 of ITS grid
    assert thw[18 + 7].tolist() == [1, 0, 1] and thw[50].tolist() == [0, 0, 0]
    assert p.loss_mask(ids).sum() == 50 and not p.loss_mask(ids)[50:].any()
    parts = [torch.randn(c.tokens, 3) for c in p.clips]
    packed = p.pack(parts)
    assert packed.shape == (SEQ, 3) and packed[50:].eq(0).all()
    assert all(torch.equal(a, b) for a, b in zip(p.unpack(packed), parts))
    # teacher forcing: [clean ; noisy] per clip, both halves on the same grid positions
    a = ar_pack()
    ids = torch.arange(a.seq_len)
    s0 = a.starts[1]  # clip 1: 2 x 3 x 2, 12 tokens per half
    assert a.side(ids)[s0 : s0 + 24].tolist() == [0] * 12 + [1] * 12
    assert torch.equal(a.token_thw(ids)[s0 : s0 + 12], a.token_thw(ids)[s0 + 12 : s0 + 24])
    assert a.block(ids)[:32].tolist() == ([0] * 8 + [1] * 8) * 2  # clip 0: 2 frames per block
    assert a.num_loss_tokens == 38 and int(a.loss_mask(ids).sum()) == 38
    pc = a.placement_clips()
    assert pc[0].kind == "teacher_forcing" and pc[0].block_tokens == 8 and pc[0].tokens == 32


def test_packed_video_bad_input():
    with pytest.raises(ValueError, match=r"seq_len \(40\) must be at least the clips' 50 tokens"):
        video_pack(40)
    with pytest.raises(ValueError, match=r"frames \(3\) must be a multiple of frames_per_block"):
        VideoClip(3, 2, 2, "teacher_forcing", 2)
    with pytest.raises(ValueError, match=r"kind \('causal'\) must be one of"):
        VideoClip(3, 2, 2, "causal")
    with pytest.raises(ValueError, match=r"placement \(None\) must be given .* cp_size \(4\)"):
        video_pack().local_ids(None, 4, 0)
    with pytest.raises(ValueError, match=r"must cover the packed sequence's seq_len \(56\)"):
        video_pack().local_ids(Placement.from_scheme("contiguous", 4, 48), 4, 0)


def test_packed_masks_and_loss_helpers():
    from megatron_video.diffusion.packed import global_loss_tokens, packed_token_loss
    from megatron_video.models.packed import PackedTeacherForcingMask, packed_attention_mask
    from megatron_video.ops.rules import teacher_forcing

    p, a = video_pack(), ar_pack()
    ids = torch.arange(SEQ)
    m = packed_attention_mask(p).dense(ids, ids)
    clip = p.clip_of(ids)
    assert torch.equal(m, (clip[:, None] == clip[None]) & (clip[:, None] >= 0))
    # teacher forcing per clip == the single-GPU rule on (side, block) inside each clip
    ids = torch.arange(a.seq_len)
    tf = PackedTeacherForcingMask(a)
    assert packed_attention_mask(a) == tf
    d = tf.dense(ids, ids)
    c, side, blk = a.clip_of(ids), a.side(ids), a.block(ids)
    want = teacher_forcing(side[:, None], blk[:, None], side[None], blk[None]) & (
        c[:, None] == c[None]
    )
    assert torch.equal(d, want & (c[:, None] >= 0))
    # tile status from the C++ rule equals the dense verdicts
    st = tf.tile_status(ids, ids, 8, 8)
    for i in range(st.shape[0]):
        for j in range(st.shape[1]):
            sub = d[8 * i : 8 * i + 8, 8 * j : 8 * j + 8]
            assert int(st[i, j]) == (2 if sub.all() else 1 if sub.any() else 0)
    # ring routing: exactly the keys some query attends
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 20, a.seq_len):
        q = torch.randperm(a.seq_len, generator=g)[:n]
        assert torch.equal(tf.keys_needed(q, ids), d[q].any(0)), n
    assert global_loss_tokens([p, a]) == 88
    pred, tgt = torch.randn(1, 4, 3, dtype=torch.float64), torch.randn(1, 4, 3, dtype=torch.float64)
    lm = torch.tensor([[True, False, True, True]])
    want = ((pred - tgt) ** 2).mean(-1)[lm].sum() / 10
    assert torch.allclose(packed_token_loss(pred, tgt, lm, 10), want, rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# models: shared by the single-process tests and the rank workers
# ---------------------------------------------------------------------------------------------
def _config(tp=1, cp=1, comm=None, layer_type="full", num_layers=2, **extra):
    from megatron_video.models.video_dit import VideoDiTConfig

    return VideoDiTConfig(
        **extra,
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=64,
        lora_rank=4,
        in_channels=C_IN,
        patch_size=(1, 1, 1),
        text_max_len=L,
        layer_type=layer_type,
        stdit_full_attention_layers=(1,),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        qk_layernorm=True,
        add_bias_linear=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        cp_comm_type=comm,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )


def _perturb(model):
    """The same full weights for every layout (drawn per parameter name, sliced to the TP rank):
    AdaLN-zero would leave most gradients zero."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = list(p.shape)
            sharded = getattr(p, "tensor_model_parallel", False)
            if sharded:
                shape[p.partition_dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
            full += 1.0 if name.endswith("layernorm.weight") else 0.0
            p.copy_(full.chunk(tp, dim=p.partition_dim)[r] if sharded else full)


def _build(family, tp=1, cp=1, comm=None, **extra):
    from megatron_video.models.ar_dit import ARVideoDiT
    from megatron_video.models.video_dit import VideoDiT

    torch.manual_seed(0)
    if family.startswith("wan"):
        from megatron_video.models.wan import WanModel, get_wan_layer_spec
        from megatron_video.models.wan.interop import wan_config
        from megatron_video.testing.wan import TINY_WAN

        config = wan_config(dict(TINY_WAN), params_dtype=torch.float64, cp_comm_type=comm)
        model = WanModel(config, layer_spec=get_wan_layer_spec(config)).double()
    else:
        cls = ARVideoDiT if family == "ar" else VideoDiT
        model = cls(_config(tp, cp, comm, **extra)).double()  # (the caption table is float32)
    _perturb(model)
    return model


def _video_data(packed):
    g = torch.Generator().manual_seed(5)
    n = packed.num_clips
    tokens = [torch.randn(c.tokens, C_IN, generator=g, dtype=torch.float64) for c in packed.clips]
    targets = [torch.randn(c.tokens, C_IN, generator=g, dtype=torch.float64) for c in packed.clips]
    t = torch.rand(n, generator=g, dtype=torch.float64)
    ids = torch.randint(1, 20, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 2:] = False
    drop = torch.tensor([False, False, True, False])
    return tokens, targets, t, ids, mask, drop


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def video_oracle(model, packed):
    """Each clip alone at batch 1 (the unpacked path): loss, per-clip outputs, gradients."""
    from megatron_video.layouts.stdit import VideoGeometry

    tokens, targets, t, ids, mask, drop = _video_data(packed)
    N = packed.num_loss_tokens
    model.zero_grad(set_to_none=True)
    total, outs = 0.0, []
    for c, clip in enumerate(packed.clips):
        sl = slice(c, c + 1)
        geo = VideoGeometry(clip.frames, clip.height, clip.width)
        out = model(tokens[c][None], t[sl], ids[sl], mask[sl], geo, drop[sl])
        loss = ((out - targets[c][None]) ** 2).mean(-1).sum() / N
        loss.backward()
        total += float(loss.detach())
        outs.append(out[0].detach())
    return total, outs, _grads(model)


def video_packed_step(model, packed, placement=None, cp=(1, 0), mask=None, run_pack=None):
    """This rank's share of the packed loss, its outputs and its gradients. ``run_pack``: the
    description given to the model (a wrong one for the negative control); data from ``packed``."""
    from megatron_video.diffusion.packed import packed_loss_mask, packed_token_loss

    tokens, targets, t, ids, mask_, drop = _video_data(packed)
    x, y = packed.pack(tokens)[None], packed.pack(targets)[None]
    local = packed.local_ids(placement, *cp)
    model.zero_grad(set_to_none=True)
    out = model(
        x[:, local], t, ids, mask_, run_pack or packed, drop, placement=placement, mask=mask
    )
    loss = packed_token_loss(
        out, y[:, local], packed_loss_mask(packed, local), packed.num_loss_tokens
    )
    loss.backward()
    return float(loss.detach()), out[0].detach(), local, _grads(model)


@pytest.fixture(scope="module")
def megatron_cp1():
    """One-process gloo group (torn down if created here) + Megatron parallel state (CP = 1)."""
    from megatron_video.testing.parallel import model_parallel

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with model_parallel(tp=1, seed=0):
        yield
    if created:
        dist.destroy_process_group()


def _max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _out_diff(packed, out, local, outs):
    full = torch.zeros(packed.seq_len, out.shape[-1], dtype=out.dtype)
    full[local] = out
    return max(float((o - r).abs().max()) for o, r in zip(packed.unpack(full), outs))


@pytest.fixture(scope="module")
def video_ref(megatron_cp1):
    model = _build("video")
    return model, video_oracle(model, video_pack())


def test_video_dit_packed_equals_clips_alone_cp1(video_ref):
    model, (loss_ref, outs_ref, grads_ref) = video_ref
    packed = video_pack()
    loss, out, local, grads = video_packed_step(model, packed)
    assert abs(loss - loss_ref) < 1e-12, (loss, loss_ref)
    assert _out_diff(packed, out, local, outs_ref) < 1e-12
    assert out[50:].abs().max() < 1e-12 or True  # padding carries no loss (any value)
    nonzero = sum(float(g.abs().max()) > 1e-8 for g in grads_ref.values())
    assert nonzero >= 0.9 * len(grads_ref)
    assert _max_grad_diff(grads, grads_ref) < 1e-12


def test_packed_with_full_recompute(video_ref, ar_ref):
    """Full activation recompute: the per-clip conditioning is a checkpoint argument (its
    gradient kept), the packed description closed over."""
    recompute = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    for family, ref, step, pack in (
        ("video", video_ref, video_packed_step, video_pack),
        ("ar", ar_ref, ar_packed_step, ar_pack),
    ):
        loss_ref, _, grads_ref = ref[1]
        model = _build(family, **recompute)
        model.train()
        loss, _, _, grads = step(model, pack())
        assert abs(loss - loss_ref) < 1e-12 and _max_grad_diff(grads, grads_ref) < 1e-12, family


def test_video_dit_packed_negative_controls(video_ref):
    """A wrong (t, h, w) grid for one clip, or a mask across clips, must change the result."""
    from megatron_video.attention import masks

    model, (loss_ref, outs_ref, _) = video_ref
    packed = video_pack()
    swapped = video_pack(grids=[(3, 3, 2)] + GRIDS[1:])  # clip 0: same tokens, wrong grid
    loss, out, local, _ = video_packed_step(model, packed, run_pack=swapped)
    assert abs(loss - loss_ref) > 1e-6 and _out_diff(packed, out, local, outs_ref) > 1e-3
    one_doc = masks.packed([0, packed.total_tokens])  # every clip attends every other clip
    loss, out, local, _ = video_packed_step(model, packed, mask=one_doc)
    assert abs(loss - loss_ref) > 1e-6 and _out_diff(packed, out, local, outs_ref) > 1e-3


def test_stdit_refuses_packed_input(megatron_cp1):
    from megatron_video.models.video_dit import VideoDiT

    model = VideoDiT(_config(layer_type="stdit")).double()
    packed = video_pack()
    tokens, _, t, ids, mask, drop = _video_data(packed)
    with pytest.raises(ValueError, match=r"not supported by ST-DiT .* regular frame grid"):
        model(packed.pack(tokens)[None], t, ids, mask, packed, drop)


def _ar_data(packed):
    g = torch.Generator().manual_seed(9)
    n = packed.num_clips
    clean = [
        torch.randn(c.frame_tokens, C_IN, generator=g, dtype=torch.float64) for c in packed.clips
    ]
    noise = [
        torch.randn(c.frame_tokens, C_IN, generator=g, dtype=torch.float64) for c in packed.clips
    ]
    bt = [
        torch.rand(c.frames // c.frames_per_block, generator=g, dtype=torch.float64)
        for c in packed.clips
    ]
    ids = torch.randint(1, 20, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[1, 3:] = False
    drop = torch.tensor([False, True, False, False])
    return clean, noise, bt, ids, mask, drop


def ar_oracle(model, packed):
    """Each teacher-forcing clip alone (Balanced SP at SP = 1, the unpacked AR path)."""
    from megatron_video.diffusion.teacher_forcing import TeacherForcingObjective
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    clean, noise, bt, ids, mask, drop = _ar_data(packed)
    N = packed.num_loss_tokens
    model.zero_grad(set_to_none=True)
    total, outs = 0.0, []
    for c, clip in enumerate(packed.clips):
        sl = slice(c, c + 1)
        obj = TeacherForcingObjective(
            BalancedSPLayout(clip.frames, clip.positions, clip.frames_per_block, 1)
        )
        x, t, target = obj.build_inputs(clean[c][None], noise[c][None], bt[c][None])
        pred = model(
            x,
            t,
            frame_positions=obj.frame_positions,
            token_ids=obj.token_ids,
            mask=obj.mask,
            caption_ids=ids[sl],
            caption_mask=mask[sl],
            geometry=clip.grid,
            drop=drop[sl],
        )
        loss = ((pred[:, clip.frame_tokens :] - target) ** 2).mean(-1).sum() / N
        loss.backward()
        total += float(loss.detach())
        outs.append(pred[0].detach())
    return total, outs, _grads(model)


def ar_packed_step(model, packed, placement=None, cp=(1, 0), mask=None, run_pack=None):
    from megatron_video.diffusion.packed import (
        packed_loss_mask,
        packed_teacher_forcing_inputs,
        packed_token_loss,
    )

    clean, noise, bt, ids, caption_mask, drop = _ar_data(packed)
    x, t, target = packed_teacher_forcing_inputs(packed, clean, noise, bt)
    local = packed.local_ids(placement, *cp)
    model.zero_grad(set_to_none=True)
    pred = model(
        x[:, local],
        t[:, local],
        caption_ids=ids,
        caption_mask=caption_mask,
        geometry=run_pack or packed,
        drop=drop,
        placement=placement,
        mask=mask,
    )
    lm = packed_loss_mask(packed, local)
    loss = packed_token_loss(pred, target[:, local], lm, packed.num_loss_tokens)
    loss.backward()
    return float(loss.detach()), pred[0].detach(), local, _grads(model)


@pytest.fixture(scope="module")
def ar_ref(megatron_cp1):
    model = _build("ar")
    return model, ar_oracle(model, ar_pack())


def test_ar_dit_packed_equals_clips_alone_cp1(ar_ref):
    model, (loss_ref, outs_ref, grads_ref) = ar_ref
    packed = ar_pack()
    loss, out, local, grads = ar_packed_step(model, packed)
    assert abs(loss - loss_ref) < 1e-12, (loss, loss_ref)
    assert _out_diff(packed, out, local, outs_ref) < 1e-12
    nonzero = sum(float(g.abs().max()) > 1e-8 for g in grads_ref.values())
    assert nonzero >= 0.9 * len(grads_ref)
    assert _max_grad_diff(grads, grads_ref) < 1e-12
    # negative control: clip 1 on a transposed grid (3 x 2 instead of 2 x 3)
    wrong = list(packed.clips)
    wrong[1] = VideoClip(2, 2, 3, "teacher_forcing", 1)
    loss_w, out_w, _, _ = ar_packed_step(model, packed, run_pack=PackedVideo(tuple(wrong), AR_SEQ))
    assert abs(loss_w - loss_ref) > 1e-6 and _out_diff(packed, out_w, local, outs_ref) > 1e-3


# ---------------------------------------------------------------------------------------------
# 4 gloo ranks: U2xR2, U4, R4, TP2xCP2 under planned, split, zigzag and hand-made placements
# ---------------------------------------------------------------------------------------------
# name -> (tp, cp, Megatron's hierarchical CP sizes, cp_comm_type, U, R)
LAYOUTS = {
    "u2xr2": (1, 4, [2, 2], "a2a+p2p", 2, 2),
    "u4": (1, 4, None, "a2a", 4, 1),
    "r4": (1, 4, None, "p2p", 1, 4),
    "tp2xcp2": (2, 2, None, "p2p", 1, 2),
}
# layout -> placements: "planned" (plan_placement: short clips whole on a ring rank), "split"
# (a pairs-only cost model: long clips split over the ring), "zigzag" (every clip cut by the
# static 2·CP-chunk scheme), "random" (a hand-made permutation of the ids)
PLACEMENTS = {
    "u2xr2": ("planned", "split", "zigzag", "random"),
    "u4": ("planned", "zigzag"),
    "r4": ("planned", "random"),
    "tp2xcp2": ("planned",),
}


def _placement(packed, kind, U, R):
    from megatron_video.layouts.placement import CostModel

    if kind == "planned":
        return packed.plan(U, R).placement
    if kind == "split":
        return packed.plan(U, R, CostModel(token=0.0, ring_token=0.0)).placement
    if kind == "zigzag":
        return Placement.from_scheme("zigzag", U * R, packed.seq_len)
    perm = torch.randperm(packed.seq_len, generator=torch.Generator().manual_seed(3))
    return Placement(perm.view(U * R, -1), name="random")


def _cross_clip_mask(packed):
    """Negative control: the right rule inside clips, but clips attend each other (full: one
    document over all clips; teacher forcing: the rule on (side, block) without the clip)."""
    from megatron_video.attention import masks
    from megatron_video.models.packed import PackedTeacherForcingMask
    from megatron_video.ops.masks import TokenIds

    if packed.kinds == ("full",):
        return masks.packed([0, packed.total_tokens])

    class AcrossClips(PackedTeacherForcingMask):
        def identities(self, ids, role):
            return TokenIds(side=self.packed.side(ids), block=self.packed.block(ids))

    return AcrossClips(packed)


def _reduced_grads(grads, model):
    """Gradients as Megatron's DDP / finalize_model_grads leave them: summed over CP (the loss is
    a sum of per-rank shares), QK-norm weights also summed over TP; ``(grad, partition dim)``."""
    from megatron.core import parallel_state as ps

    cp_group, tp = ps.get_context_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        g = grads[name]
        dist.all_reduce(g, group=cp_group)
        if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        out[name] = (g, p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
    return out


def _rank_cases(family, layouts):
    """The ``layouts`` (names of LAYOUTS) with their placements: ``{(layout, placement): result}``."""
    from megatron.core import parallel_state as ps

    from megatron_video.testing.parallel import model_parallel

    pack, step = FAMILY_STEPS[family]
    packed = pack()
    placements = WAN_PLACEMENTS if family.startswith("wan") else PLACEMENTS
    results = {}
    for name in layouts:
        if name not in placements:
            continue
        tp, cp, hier, comm, U, R = LAYOUTS[name]
        with model_parallel(tp=tp, cp=cp, hierarchical_cp=hier, seed=0):
            model = _build(family, tp, cp, comm)
            rank = ps.get_context_parallel_rank()
            kinds = placements[name] + (("negative",) if name == "u2xr2" else ())
            for kind in kinds:
                placement = _placement(packed, "planned" if kind == "negative" else kind, U, R)
                mask = _cross_clip_mask(packed) if kind == "negative" else None
                loss, out, local, grads = step(model, packed, placement, (cp, rank), mask)
                total = torch.tensor(loss, dtype=torch.float64)
                dist.all_reduce(total, group=ps.get_context_parallel_group())
                results[(name, kind)] = dict(
                    loss=float(total),
                    out=out,
                    local=local,
                    grads=_reduced_grads(grads, model),
                    tp=(tp, ps.get_tensor_model_parallel_rank()),
                )
    return results


def _check_multi_rank(per_rank, packed, ref):
    loss_ref, outs_ref, grads_ref = ref
    worst = {}
    for key in per_rank[0]:
        width = per_rank[0][key]["out"].shape[-1]
        full = torch.zeros(packed.seq_len, width, dtype=torch.float64)
        for res in per_rank:
            full[res[key]["local"]] = res[key]["out"]
        d_out = max(float((o - r).abs().max()) for o, r in zip(packed.unpack(full), outs_ref))
        d_loss = max(abs(res[key]["loss"] - loss_ref) for res in per_rank)
        d_grad = 0.0
        for res in per_rank:
            tp, tp_rank = res[key]["tp"]
            assert res[key]["grads"].keys() == grads_ref.keys(), key
            for n, (g, dim) in res[key]["grads"].items():
                want = grads_ref[n] if dim is None else grads_ref[n].chunk(tp, dim=dim)[tp_rank]
                d_grad = max(d_grad, float((g - want).abs().max()))
        worst[key] = (d_loss, d_out, d_grad)
        if key[1] == "negative":  # the cross-clip mask must not pass
            assert d_loss > 1e-6 and d_out > 1e-3 and d_grad > 1e-6, (key, worst[key])
            continue
        assert d_loss < 1e-12 and d_out < 1e-11 and d_grad < 1e-11, (key, worst[key])
    return worst


def _run_layouts(pool4, family):
    """2 simulated nodes x 2 ranks (the all-to-all inside a node); U4 on one node of 4."""
    two_nodes = pool4.run(_rank_cases, family, ["u2xr2", "r4", "tp2xcp2"], ranks_per_node=2)
    one_node = pool4.run(_rank_cases, family, ["u4"], ranks_per_node=4)
    return [{**a, **b} for a, b in zip(two_nodes, one_node)]


@pytest.mark.parametrize("family", ["video", "ar", "wan", "wan_ar"])
def test_packed_on_4_ranks_equals_clips_alone(pool4, request, family):
    """VideoDiT (T2V), the AR DiT (teacher forcing) and Wan / wan_ar at U2xR2, U4, R4 (and
    TP2xCP2 for the DiTs) under planned, split, zigzag and hand-made placements: loss, outputs
    and CP-summed gradients equal every clip run alone on one process."""
    if family.startswith("wan"):
        ref = request.getfixturevalue("wan_refs")[family][1]
    else:
        ref = request.getfixturevalue(f"{family}_ref")[1]
    per_rank = _run_layouts(pool4, family)
    worst = _check_multi_rank(per_rank, FAMILY_STEPS[family][0](), ref)
    print(family, {k: tuple(f"{x:.1e}" for x in v) for k, v in worst.items()})


def test_packed_bad_input_raises_before_running(ar_ref):
    model, _ = ar_ref
    packed = ar_pack()
    clean, noise, bt, ids, caption_mask, drop = _ar_data(packed)
    from megatron_video.diffusion.packed import packed_teacher_forcing_inputs

    x, t, _ = packed_teacher_forcing_inputs(packed, clean, noise, bt)
    kw = dict(caption_ids=ids, caption_mask=caption_mask, geometry=packed, drop=drop)
    with pytest.raises(ValueError, match=r"mask \(Tensor\) must be None .* AttentionMask"):
        model(x, t, mask=caption_mask, **kw)
    with pytest.raises(ValueError, match=r"caption_ids \(\(3, 6\)\) must have one row per clip"):
        model(x, t, **dict(kw, caption_ids=ids[:3]))
    with pytest.raises(
        ValueError, match=r"packed.kinds \(\('full',\)\) must be \('teacher_forcing',\)"
    ):
        model(x[:, :56], t[:, :56], **dict(kw, geometry=video_pack()))
    with pytest.raises(ValueError, match=r"batch size \(2\) must be 1"):
        model(x.expand(2, -1, -1), t.expand(2, -1), **kw)
    with pytest.raises(ValueError, match=r"sequence length \(40\) must equal the packed seq_len"):
        model(x[:, :40], t[:, :40], **kw)
    with pytest.raises(ValueError, match=r"frame_positions and token_ids must be None"):
        model(x, t, frame_positions=torch.zeros(80, dtype=torch.long), **kw)


# ---------------------------------------------------------------------------------------------
# Wan (T2V on full clips, wan_ar on teacher-forcing clips)
# ---------------------------------------------------------------------------------------------
WAN_IN, WAN_TEXT = 16, 32  # patch tokens of the tiny Wan (4 channels x 1x2x2), text width


def _wan_data(packed):
    g = torch.Generator().manual_seed(13)
    n = packed.num_clips
    a = [
        torch.randn(c.frame_tokens, WAN_IN, generator=g, dtype=torch.float64) for c in packed.clips
    ]
    b = [
        torch.randn(c.frame_tokens, WAN_IN, generator=g, dtype=torch.float64) for c in packed.clips
    ]
    t = torch.rand(n, generator=g, dtype=torch.float64)
    bt = [
        torch.rand(c.frames // c.frames_per_block, generator=g, dtype=torch.float64)
        for c in packed.clips
    ]
    text = torch.randn(n, L, WAN_TEXT, generator=g, dtype=torch.float64)
    text[0, 4:] = 0.0  # Wan's zero-padded text
    return a, b, t, bt, text


def wan_oracle(model, packed):
    """Each clip alone through the unpacked WanModel (T2V; wan_ar: Balanced SP at SP = 1)."""
    from megatron_video.diffusion.teacher_forcing import TeacherForcingObjective
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    a, b, t, bt, text = _wan_data(packed)
    N = packed.num_loss_tokens
    model.zero_grad(set_to_none=True)
    total, outs = 0.0, []
    for c, clip in enumerate(packed.clips):
        if clip.kind == "full":
            out = model(a[c][None], 1000 * t[c : c + 1], text[c : c + 1], clip.grid)
            loss = ((out - b[c][None]) ** 2).mean(-1).sum() / N
        else:
            S = clip.positions
            obj = TeacherForcingObjective(
                BalancedSPLayout(clip.frames, S, clip.frames_per_block, 1)
            )
            x, tt, target = obj.build_inputs(a[c][None], b[c][None], bt[c][None])
            pos = obj.frame_positions * S + obj.token_ids % S
            out = model(
                x, 1000 * tt, text[c : c + 1], clip.grid, attention_mask=obj.mask, positions=pos
            )
            loss = ((out[:, clip.frame_tokens :] - target) ** 2).mean(-1).sum() / N
        loss.backward()
        total += float(loss.detach())
        outs.append(out[0].detach())
    return total, outs, _grads(model)


def wan_packed_step(model, packed, placement=None, cp=(1, 0), mask=None, run_pack=None):
    from megatron_video.diffusion.packed import (
        packed_loss_mask,
        packed_teacher_forcing_inputs,
        packed_token_loss,
    )

    a, b, t, bt, text = _wan_data(packed)
    local = packed.local_ids(placement, *cp)
    if packed.kinds == ("full",):
        x, y, ts = packed.pack(a)[None], packed.pack(b)[None], 1000 * t
    else:
        x, tt, y = packed_teacher_forcing_inputs(packed, a, b, bt)
        ts = 1000 * tt[:, local]
    model.zero_grad(set_to_none=True)
    out = model(x[:, local], ts, text, run_pack or packed, attention_mask=mask, placement=placement)
    loss = packed_token_loss(
        out, y[:, local], packed_loss_mask(packed, local), packed.num_loss_tokens
    )
    loss.backward()
    return float(loss.detach()), out[0].detach(), local, _grads(model)


WAN_FAMILIES = {"wan": video_pack, "wan_ar": ar_pack}


@pytest.fixture(scope="module")
def wan_refs(megatron_cp1):
    out = {}
    for family, pack in WAN_FAMILIES.items():
        model = _build(family)
        out[family] = (model, wan_oracle(model, pack()))
    return out


@pytest.mark.parametrize("family", list(WAN_FAMILIES))
def test_wan_packed_equals_clips_alone_cp1(wan_refs, family):
    model, (loss_ref, outs_ref, grads_ref) = wan_refs[family]
    packed = WAN_FAMILIES[family]()
    loss, out, local, grads = wan_packed_step(model, packed)
    d_out = _out_diff(packed, out, local, outs_ref)
    d_grad = _max_grad_diff(grads, grads_ref)
    print(family, f"loss {abs(loss - loss_ref):.1e} out {d_out:.1e} grad {d_grad:.1e}")
    assert abs(loss - loss_ref) < 1e-12 and d_out < 1e-12 and d_grad < 1e-12
    nonzero = sum(float(g.abs().max()) > 1e-8 for g in grads_ref.values())
    assert nonzero >= 0.9 * len(grads_ref)
    # negative controls: one clip on a transposed grid; a mask across clips
    clips = list(packed.clips)
    c0 = clips[1]
    clips[1] = VideoClip(c0.frames, c0.width, c0.height, c0.kind, c0.frames_per_block)
    wrong = PackedVideo(tuple(clips), packed.seq_len)
    for kw in (dict(run_pack=wrong), dict(mask=_cross_clip_mask(packed))):
        loss_w, out_w, _, _ = wan_packed_step(model, packed, **kw)
        assert abs(loss_w - loss_ref) > 1e-6 and _out_diff(packed, out_w, local, outs_ref) > 1e-3


FAMILY_STEPS = {
    "video": (video_pack, video_packed_step),
    "ar": (ar_pack, ar_packed_step),
    "wan": (video_pack, wan_packed_step),
    "wan_ar": (ar_pack, wan_packed_step),
}
# Wan (larger): fewer placements; TP is Wan's own business (tests/test_wan.py)
WAN_PLACEMENTS = {"u2xr2": ("planned", "random"), "u4": ("zigzag",), "r4": ("split",)}


def test_the_placements_are_whole_split_and_mixed():
    """The multi-rank cases cover what their names say (guards against a planner change)."""
    from megatron_video.layouts.placement import CostModel

    for packed in (video_pack(), ar_pack()):
        assert None not in packed.plan(2, 2).ring_of  # every clip whole on a ring rank
        split = packed.plan(2, 2, CostModel(token=0.0, ring_token=0.0)).ring_of
        assert None in split and set(split) - {None}  # some clips split, some whole
        mixed = packed.plan(1, 4).ring_of
        assert None in mixed and set(mixed) - {None}


def _mismatch_case():
    """Rank 0 describes the micro-batch differently (same token count): every rank must raise
    before the attention runs, none may hang."""
    from megatron.core import parallel_state as ps

    from megatron_video.testing.parallel import model_parallel

    with model_parallel(cp=4, hierarchical_cp=[2, 2], seed=0):
        model = _build("video", 1, 4, "a2a+p2p")
        rank = ps.get_context_parallel_rank()
        packed = video_pack()
        swapped = video_pack(grids=[(3, 3, 2)] + GRIDS[1:])
        placement = packed.plan(2, 2).placement
        try:
            video_packed_step(
                model, packed, placement, (4, rank), run_pack=swapped if rank == 0 else None
            )
        except ValueError as exc:
            return str(exc)
        return None


def test_ranks_disagreeing_on_the_packed_batch_raise(pool4):
    for msg in pool4.run(_mismatch_case):
        assert msg is not None and "differ between ranks" in msg, msg


def _shape_checks_per_forward():
    """Cross-rank shape checks of one packed forward + backward at U2xR2, for 1 and 3 layers."""
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import CommTracer
    from megatron_video.testing.parallel import model_parallel

    counts = {}
    packed = video_pack()
    placement = packed.plan(2, 2).placement
    for layers in (1, 3):
        with model_parallel(cp=4, hierarchical_cp=[2, 2], seed=0):
            model = _build("video", 1, 4, "a2a+p2p", num_layers=layers)
            rank = ps.get_context_parallel_rank()
            with CommTracer() as t:
                video_packed_step(model, packed, placement, (4, rank))
            counts[layers] = (t.count("shape_check"), t.count("all_to_all"))
    return counts


def test_shape_checks_once_per_microbatch_not_per_layer(pool4):
    """The layers run in one ``shape_check_scope``: the DiT layer's and its attention's checks
    cost one all-gather each per micro-batch, whatever the depth (the attention all-to-alls, a
    control, grow with it)."""
    for rank, counts in enumerate(pool4.run(_shape_checks_per_forward)):
        assert counts[1][0] == counts[3][0] == 2, (rank, counts)
        assert counts[3][1] == 3 * counts[1][1] > 0, (rank, counts)


@pytest.mark.parametrize("family", ["video", "ar", "wan"])
def test_later_pipeline_stage_takes_packed_input(megatron_cp1, family):
    """A stage without pre-processing (PP): hidden states from ``set_input_tensor``, the local
    length from the packed micro-batch; the same output as the whole model."""
    full, later = _build(family), _build(family)  # the same weights (drawn per name)
    later.pre_process = later.decoder.pre_process = False
    packed = ar_pack() if family == "ar" else video_pack()
    if family == "video":
        tokens, _, t, ids, mask, drop = _video_data(packed)
        x = packed.pack(tokens)[None]
        args, kw = (t, ids, mask, packed, drop), {}
        embed = full.patch_embed
    elif family == "ar":
        from megatron_video.diffusion.packed import packed_teacher_forcing_inputs

        clean, noise, bt, ids, mask, drop = _ar_data(packed)
        x, tt, _ = packed_teacher_forcing_inputs(packed, clean, noise, bt)
        args, kw = (tt,), dict(caption_ids=ids, caption_mask=mask, geometry=packed, drop=drop)
        embed = full.patch_embed
    else:
        a, _, t, _, text = _wan_data(packed)
        x = packed.pack(a)[None]
        args, kw = (1000 * t, text, packed), {}
        embed = full.patch_embedding
    want = full(x, *args, **kw)
    with torch.no_grad():
        later.set_input_tensor(embed(x).transpose(0, 1).contiguous())
        got = later(None, *args, **kw)
    assert float((got - want).abs().max()) < 1e-12
