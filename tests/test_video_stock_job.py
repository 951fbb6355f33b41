"""Each video family as a stock Megatron job: parallel state set by Megatron alone
(``initialize_model_parallel`` with hierarchical CP sizes, no ``init_video_parallel``), the model
built from its layer spec (and from ``with_2d_attention`` applied to that spec), tokens cut the way
the family lays them out (contiguous CP split for VideoDiT / ST-DiT, Balanced SP for the AR DiT).

Acceptance for U2xR2 (``a2a+p2p``), U4 (``a2a``), R4 (``p2p``) and TP2xCP2: the loss and every
parameter gradient (summed over the CP group, what Megatron's DDP does) equal the CP=1 run of the
same spec at the same TP, within the fp32 tolerances of tests/test_megatron_stock_job.py. The CP=1
layers are themselves held to float64 oracles in tests/test_stdit.py and tests/test_dit_blocks.py.
The U x R each layer's core attention derived from Megatron is checked too.
"""

import zlib

import torch
import torch.distributed as dist

B, F, HH, WW, C, L = 2, 4, 2, 2, 4, 6
FAMILIES = ("video_dit", "stdit", "ar_dit")

# name -> (tensor_model_parallel_size, context_parallel_size, hierarchical sizes, cp_comm_type)
CASES = {
    "u2xr2": (1, 4, [2, 2], "a2a+p2p"),
    "u4": (1, 4, None, "a2a"),
    "r4": (1, 4, None, "p2p"),
    "tp2xcp2": (2, 2, None, "a2a"),
}
EXPECTED_UR = {"u2xr2": (2, 2), "u4": (4, 1), "r4": (1, 4), "tp2xcp2": (2, 1)}


def _config(family, tp, cp, comm):
    from megatron_video.models.video_dit import VideoDiTConfig

    return VideoDiTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=64,
        lora_rank=4,
        in_channels=C,
        patch_size=(1, 1, 1),
        text_max_len=L,
        layer_type="stdit" if family == "stdit" else "full",
        stdit_full_attention_layers=(1,),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        qk_layernorm=True,
        add_bias_linear=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        cp_comm_type=comm,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )


def _spec(family, config, use_2d):
    from megatron_video.models.ar_dit import get_ar_dit_layer_spec
    from megatron_video.models.dit_layer_specs import get_stdit_layer_spec
    from megatron_video.models.specs import with_2d_attention
    from megatron_video.models.video_dit import get_video_dit_layer_spec

    if family == "video_dit":
        spec = get_video_dit_layer_spec(config.lora_rank)
    elif family == "stdit":
        spec = get_stdit_layer_spec("hybrid", (1,), config.lora_rank)
    else:
        spec = get_ar_dit_layer_spec(config.lora_rank)
    return with_2d_attention(spec) if use_2d else spec


def _perturb(model):
    """Random weights everywhere (AdaLN-zero would make most gradients zero), drawn at full size per
    parameter name and sliced to this TP rank: every layout starts from the same full weights."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = list(p.shape)
            sharded = getattr(p, "tensor_model_parallel", False)
            if sharded:
                shape[p.partition_dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.2 * torch.randn(shape, generator=g) + (
                1.0 if name.endswith("layernorm.weight") else 0.0
            )
            p.copy_(full.chunk(tp, dim=p.partition_dim)[r] if sharded else full)


def _loss(family, model, cp, cp_rank, groups):
    """This rank's share of a linear loss on the model output (sums to the global loss over CP)."""
    from megatron_video.layouts.stdit import VideoGeometry

    geo = VideoGeometry(F, HH, WW)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, model.config.text_vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 4:] = False
    if family != "ar_dit":
        tokens = torch.randn(B, geo.tokens, C, generator=g)
        w = torch.randn(B, geo.tokens, C, generator=g)
        t = torch.rand(B, generator=g)
        s = geo.tokens // cp
        cut = slice(cp_rank * s, (cp_rank + 1) * s)
        out = model(tokens[:, cut], t, ids, mask, geo)
        return (out * w[:, cut]).sum()
    from megatron_video.diffusion.teacher_forcing import TeacherForcingObjective, local_frame_tokens
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    clean = torch.randn(B, geo.tokens, C, generator=g)
    noise = torch.randn(B, geo.tokens, C, generator=g)
    t_blocks = torch.rand(B, F, generator=g)
    layout = BalancedSPLayout(F, geo.positions, 1, cp)
    objective = TeacherForcingObjective(layout, groups)
    fn = lambda x, t, **kw: model(x, t, caption_ids=ids, caption_mask=mask, geometry=geo, **kw)  # noqa: E731
    res = objective(
        fn,
        local_frame_tokens(layout, cp_rank, clean),
        noise=local_frame_tokens(layout, cp_rank, noise),
        block_timesteps=t_blocks,
    )
    return res.loss


def _job(family, tp, cp, hier, comm, use_2d):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import destroy_model_parallel, ensure_cpu_mode
    from megatron_video.models.ar_dit import ARVideoDiT
    from megatron_video.models.video_dit import VideoDiT
    from megatron_video.parallel.topology import resolve_video_groups

    ensure_cpu_mode()
    kw = dict(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if hier is not None:
        kw["hierarchical_context_parallel_sizes"] = hier
    ps.initialize_model_parallel(**kw)
    try:
        model_parallel_cuda_manual_seed(123)
        torch.manual_seed(123)
        config = _config(family, tp, cp, comm)
        cls = ARVideoDiT if family == "ar_dit" else VideoDiT
        model = cls(config, layer_spec=_spec(family, config, use_2d))
        _perturb(model)
        cp_group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
        # (the AR objective cuts the Balanced SP layout by the CP rank Megatron's groups give)
        groups = resolve_video_groups(None, None, comm) if cp > 1 else None
        loss = _loss(family, model, cp, cp_rank, groups)
        loss.backward()
        total = loss.detach().clone()
        if cp > 1:  # what Megatron's DDP does over the dp x cp group
            dist.all_reduce(total, group=cp_group)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        # (None: a parameter this loss does not reach, e.g. the null caption without CFG drops)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        layer = model.decoder.layers[0]
        attn = layer.full_attention if family == "stdit" else layer.self_attention
        vg = attn.core_attention.video_groups()
        ur = (vg.ulysses_size, vg.ring_size) if vg is not None else (1, 1)
        return ps.get_tensor_model_parallel_rank(), float(total), grads, ur
    finally:
        destroy_model_parallel()


def _all_cases():
    out = {}
    for family in FAMILIES:
        for use_2d in (False, True):
            out[(family, use_2d, "ref_tp1")] = _job(family, 1, 1, None, None, use_2d)
            out[(family, use_2d, "ref_tp2")] = _job(family, 2, 1, None, None, use_2d)
            for name, args in CASES.items():
                out[(family, use_2d, name)] = _job(family, *args, use_2d)
    return out


def test_video_families_as_stock_megatron_jobs_match_cp1(pool8):
    per_rank = pool8.run(_all_cases)
    for rank, res in enumerate(per_rank):
        for family in FAMILIES:
            for use_2d in (False, True):
                for name in CASES:
                    label = (rank, family, "with_2d_attention" if use_2d else "spec", name)
                    tp = CASES[name][0]
                    ref_tp_rank, ref_loss, ref_grads, _ = res[(family, use_2d, f"ref_tp{tp}")]
                    tp_rank, loss, grads, ur = res[(family, use_2d, name)]
                    assert tp_rank == ref_tp_rank and ur == EXPECTED_UR[name], (label, ur)
                    assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (
                        label,
                        loss,
                        ref_loss,
                    )
                    assert grads.keys() == ref_grads.keys()
                    nonzero = 0
                    assert [n for n, g in grads.items() if g is None] == [
                        n for n, g in ref_grads.items() if g is None
                    ], label
                    grads = {n: g for n, g in grads.items() if g is not None}
                    for n, g in grads.items():
                        scale = float(ref_grads[n].abs().max())
                        nonzero += scale > 1e-6
                        rel = float((g - ref_grads[n]).abs().max()) / max(1e-3, scale)
                        assert rel < 1e-4, (label, n, rel)
                    assert nonzero >= 0.9 * len(grads), (label, nonzero, len(grads))
        # the spec and its with_2d_attention copy build the same model: same CP=1 loss
        for family in FAMILIES:
            assert (
                abs(res[(family, False, "ref_tp1")][1] - res[(family, True, "ref_tp1")][1]) < 1e-6
            )
