"""ST-DiT on 4 gloo ranks: the A<->B transitions against a slicing oracle, and the layer (CP = U 2 x
R 2; TP 2 x CP 2) against a single-process float64 oracle. One worker pool for the whole module.

The oracle is written from first principles on the whole video ``[b, t, n, D]`` (explicit softmax
attention per frame / per position / over everything, explicit projections from the parameters),
so it shares no layout or communication code with the layer. Compared: outputs, input gradients
(hidden states, conditioning, text) and parameter gradients summed over ranks; plus the traced
communication per block and AdaLN-zero identity at initialisation.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_video.attention.stdit_transitions import frames_to_positions, positions_to_frames
from megatron_video.models.dit_blocks import apply_rope, rope_3d_angles
from megatron_video.parallel.comm import CommTracer
from megatron_video.testing.oracles import softmax_attention
from megatron_video.testing.parallel import model_parallel

D, H, HD, FFN, LORA, DC, L = 32, 4, 8, 64, 8, 24, 5


# ---------------------------------------------------------------------------------------------
# Transitions on gloo ranks (P = 2 and P = 4 in one pool run)
# ---------------------------------------------------------------------------------------------
def _oracle_b(video, rank, P):
    """Layout B by plain slicing: positions [r*m, (r+1)*m) x all frames, zero padded."""
    b, t, n = video.shape[:3]
    m = -(-n // P)
    out = torch.zeros((b, m, t) + tuple(video.shape[3:]), dtype=video.dtype)
    chunk = video[:, :, rank * m : (rank + 1) * m].transpose(1, 2)
    out[:, : chunk.shape[1]] = chunk
    return out


def _transition_cases():
    world = dist.get_world_size()
    me = dist.get_rank()
    results = []
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[me // 2], 4: dist.new_group(list(range(world)))}
    for P, group in groups.items():
        r = dist.get_rank(group)
        for t, n, extra, dtype in [
            (P, 6, (), torch.float64),
            (2 * P, 5, (3,), torch.float64),
            (P, 3, (2, 2), torch.bfloat16),
            (2 * P, 8, (4,), torch.float32),
            (P, 1, (), torch.float64),
        ]:
            gen = torch.Generator().manual_seed(1000 * P + 10 * t + n)  # same video on every rank
            video = torch.randn((2, t, n) + extra, generator=gen).to(dtype)
            tl = t // P
            xa = video[:, r * tl : (r + 1) * tl].clone().requires_grad_(True)
            weight = torch.randn(_oracle_b(video, r, P).shape, generator=gen.manual_seed(r)).to(
                dtype
            )
            with CommTracer() as tr:
                xb = frames_to_positions(xa, group, t, n)
                back = positions_to_frames(xb.detach(), group, t, n)
                (xb * weight).sum().backward()
            # the oracle gradient of sum_r <B_r(video), W_r> w.r.t. the video, sliced to layout A
            m = -(-n // P)
            gfull = torch.zeros_like(video)
            for q in range(P):
                wq = torch.randn(weight.shape, generator=gen.manual_seed(q)).to(dtype)
                k = min(m, max(0, n - q * m))
                gfull[:, :, q * m : q * m + k] += wq[:, :k].transpose(1, 2)
            results.append(
                dict(
                    case=(P, t, n, extra, str(dtype)),
                    b_ok=torch.equal(xb.detach(), _oracle_b(video, r, P)),
                    roundtrip_ok=torch.equal(back, xa.detach()),
                    grad_ok=torch.equal(xa.grad, gfull[:, r * tl : (r + 1) * tl]),
                    # one per transition forward; the backward of frames_to_positions is one more
                    a2a=(
                        tr.count("all_to_all", "fwd", tag="stdit.frames_to_positions"),
                        tr.count("all_to_all", "fwd", tag="stdit.positions_to_frames"),
                        tr.count("all_to_all", "bwd", tag="stdit.frames_to_positions"),
                        tr.count("all_to_all"),
                    ),
                    p2p=tr.count("send"),
                )
            )
        # images: sharded by sample, no communication
        img = torch.randn(2, 1, 5, 3)
        with CommTracer() as tr:
            ib = frames_to_positions(img, group, 1, 5)
            ia = positions_to_frames(ib, group, 1, 5)
        results.append(
            dict(
                case=(P, "image"),
                b_ok=torch.equal(ib, img.transpose(1, 2)),
                roundtrip_ok=torch.equal(ia, img),
                grad_ok=True,
                a2a=(0, 0, 0, tr.count("all_to_all")),
                p2p=len(tr.events),
            )
        )
    # errors: wrong local shape (ValueError before any collective); shapes differing across ranks
    errors = []
    try:
        frames_to_positions(torch.zeros(1, 3, 5), groups[4], 8, 5)
    except ValueError as e:
        errors.append(str(e))
    try:
        frames_to_positions(torch.zeros(1 + me, 2, 5), groups[4], 8, 5)
    except ValueError as e:
        errors.append(str(e))
    try:
        positions_to_frames(torch.zeros(1, 2, 8), groups[4], 6, 5)
    except ValueError as e:
        errors.append(str(e))
    return results, errors


def test_transitions_match_slicing_oracle_and_invert(pool4):
    out = pool4.run(_transition_cases)
    for rank, (results, errors) in enumerate(out):
        for res in results:
            image = res["case"][1] == "image"
            assert res["b_ok"] and res["roundtrip_ok"] and res["grad_ok"], (rank, res)
            assert res["p2p"] == 0, (rank, res)
            assert res["a2a"] == ((0, 0, 0, 0) if image else (1, 1, 1, 3)), (rank, res)
        assert len(errors) == 3, errors
        assert "x has shape (1, 3, 5)" in errors[0] and "[b, 2, 5, ...]" in errors[0]
        assert "shapes/dtypes differ between ranks" in errors[1]
        assert "num_frames (6) must be divisible by cp_size (4)" in errors[2]


# ---------------------------------------------------------------------------------------------
# Layer oracle
# ---------------------------------------------------------------------------------------------
def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# explicit softmax attention in the inputs' dtype; mask (True = attend) broadcasts to [B, H, S, Sk]
_softmax_attention = functools.partial(softmax_attention, dtype=None)


def oracle_block(P, x, c, ctx, ctx_mask, thw, has_full, hkv):
    """The ST-DiT block on the whole video x [b, t, n, D] with parameters P (a dict)."""
    b, t, n, _ = x.shape
    g = H // hkv
    subs = (["full"] if has_full else []) + ["spatial", "cross", "temporal", "mlp"]
    mods = (F.silu(c) @ P["modulation.linear_down.weight"].T) @ P[
        "modulation.linear_up.weight"
    ].T + P["modulation.linear_up.bias"]
    mods = mods.chunk(3 * len(subs), dim=-1)
    angles = rope_3d_angles(thw, HD)  # [t*n, HD/2]

    def qkv(pre, y):
        m = y.reshape(b, t * n, D) @ P[pre + ".linear_qkv.weight"].T + P[pre + ".linear_qkv.bias"]
        m = m.view(b, t * n, hkv, g + 2, HD)
        q, k, v = m[..., :g, :].reshape(b, t * n, H, HD), m[..., g, :], m[..., g + 1, :]
        q = apply_rope(_rms(q, P[pre + ".q_layernorm.weight"]), angles)
        k = apply_rope(_rms(k, P[pre + ".k_layernorm.weight"]), angles)
        return q, k, v

    def proj(pre, o):
        return (
            o.reshape(b, t, n, H * HD) @ P[pre + ".linear_proj.weight"].T
            + P[pre + ".linear_proj.bias"]
        )

    for i, name in enumerate(subs):
        shift, scale, gate = (m[:, None, None, :] for m in mods[3 * i : 3 * i + 3])
        y = F.layer_norm(x, (D,), eps=1e-5) * (1 + scale) + shift
        if name == "full":
            out = proj("full_attention", _softmax_attention(*qkv("full_attention", y)))
        elif name == "spatial":  # each frame on its own
            q, k, v = (z.reshape(b * t, n, z.shape[2], HD) for z in qkv("spatial_attention", y))
            out = proj("spatial_attention", _softmax_attention(q, k, v))
        elif name == "temporal":  # each position on its own
            q, k, v = (
                z.reshape(b, t, n, z.shape[2], HD).transpose(1, 2).reshape(b * n, t, z.shape[2], HD)
                for z in qkv("temporal_attention", y)
            )
            o = _softmax_attention(q, k, v).reshape(b, n, t, H, HD).transpose(1, 2)
            out = proj("temporal_attention", o)
        elif name == "cross":
            pre = "cross_attention"
            q = y.reshape(b, t * n, D) @ P[pre + ".linear_q.weight"].T + P[pre + ".linear_q.bias"]
            q = _rms(q.view(b, t * n, H, HD), P[pre + ".q_layernorm.weight"])
            kv = (ctx @ P[pre + ".linear_kv.weight"].T + P[pre + ".linear_kv.bias"]).view(
                b, L, hkv, 2, HD
            )
            k, v = _rms(kv[..., 0, :], P[pre + ".k_layernorm.weight"]), kv[..., 1, :]
            out = proj(pre, _softmax_attention(q, k, v, ctx_mask[:, None, None, :]))
        else:
            h1 = F.gelu(y @ P["mlp.linear_fc1.weight"].T + P["mlp.linear_fc1.bias"])
            out = h1 @ P["mlp.linear_fc2.weight"].T + P["mlp.linear_fc2.bias"]
        x = x + gate * out
    return x


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------
def _config(hkv, **kw):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kw.setdefault("num_layers", 1)
    kw.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    return TransformerConfig(
        **kw,
        hidden_size=D,
        num_attention_heads=H,
        num_query_groups=hkv,
        kv_channels=HD,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        qk_layernorm=True,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
    )


def _inputs(case):
    """The global batch, identical on every rank (seeded)."""
    b, t, h, w = case["b"], case["t"], case["h"], case["w"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(b, t, h * w, D, generator=gen, dtype=torch.float64)
    c = torch.randn(b, D, generator=gen, dtype=torch.float64)
    ctx = torch.randn(b, L, DC, generator=gen, dtype=torch.float64)
    ctx_mask = torch.ones(b, L, dtype=torch.bool)
    ctx_mask[0, 3:] = False  # padded text in sample 0
    upstream = torch.randn(b, t, h * w, D, generator=gen, dtype=torch.float64)
    return x, c, ctx, ctx_mask, upstream


def _build(case):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_video.models.dit_layer_specs import get_stdit_layer_spec

    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    spec = get_stdit_layer_spec(
        case["variant"],
        full_attention_layers=(1,) if case["full"] else (),
        lora_rank=LORA,
        context_dim=DC,
    )
    layer = build_module(spec, config=_config(case["hkv"]), layer_number=1)
    if case.get("perturb", True):
        # random parameters everywhere (so no gradient is trivially zero), drawn at full size and
        # sliced to this TP rank's shard: every TP degree gets the same full weights
        from megatron.core import parallel_state as ps

        tp_size, tp_rank = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
        )
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                sharded = getattr(p, "tensor_model_parallel", False)
                shape = list(p.shape)
                if sharded:
                    shape[p.partition_dim] *= tp_size
                full = (1.0 if name.endswith("layernorm.weight") else 0.0) + 0.3 * torch.randn(
                    shape, generator=gen
                )
                p.copy_(full.chunk(tp_size, dim=p.partition_dim)[tp_rank] if sharded else full)
    return layer.to(case["dtype"])


def _run_block(layer, case, groups_rank, cp_size):
    from megatron_video.layouts.stdit import VideoGeometry
    from megatron_video.models.dit_layer import DiTParams
    from megatron_video.parallel.comm import CommTracer

    dtype = case["dtype"]
    x, c, ctx, ctx_mask, up = _inputs(case)
    geo = VideoGeometry(case["t"], case["h"], case["w"])
    r, P = groups_rank, cp_size
    if geo.is_image:  # images: this rank's samples
        k = case["b"] // P
        sl = slice(r * k, (r + 1) * k)
        x, c, ctx, ctx_mask, up = x[sl], c[sl], ctx[sl], ctx_mask[sl], up[sl]
    else:  # layout A: this rank's frames
        tl = case["t"] // P
        x, up = x[:, r * tl : (r + 1) * tl], up[:, r * tl : (r + 1) * tl]
    b = x.shape[0]
    hidden = x.reshape(b, -1, D).transpose(0, 1).to(dtype).requires_grad_(True)
    cond = c.to(dtype).requires_grad_(True)
    text = ctx.transpose(0, 1).to(dtype).requires_grad_(True)
    with CommTracer() as tr:
        out = layer(
            hidden,
            params=DiTParams(conditioning=cond, geometry=geo),
            context=text,
            context_mask=ctx_mask,
        )
        out, ctx_out = (
            out if isinstance(out, tuple) else (out, text)
        )  # a layer returns (h, context)
        (out * up.reshape(b, -1, D).transpose(0, 1).to(dtype)).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in layer.named_parameters()}
    comm = {
        "a2a_fwd": tr.count("all_to_all", "fwd"),
        "a2a_bwd": tr.count("all_to_all", "bwd"),
        "transition_fwd": tr.count("all_to_all", "fwd", tag="stdit."),
        "transition_bwd": tr.count("all_to_all", "bwd", tag="stdit."),
        "p2p": tr.count("send"),
        "tags": sorted({e.tag for e in tr.events if e.op == "all_to_all"}),
    }
    return dict(
        out=out.detach().double().transpose(0, 1),
        dx=hidden.grad.double().transpose(0, 1),
        dc=cond.grad.double(),
        dctx=text.grad.double().transpose(0, 1),
        grads=grads,
        comm=comm,
        ctx_same=ctx_out is text,
        params={n: p.detach().double().clone() for n, p in layer.named_parameters()},
    )


def _cp4_case(case):
    from megatron_video.parallel.topology import init_video_parallel

    with model_parallel(tp=1, cp=4, hierarchical_cp=[2, 2]):
        groups = init_video_parallel(2)
        return _run_block(_build(case), case, groups.cp_rank, groups.cp_size)


def _cp4_stack_and_errors():
    from megatron_video.parallel.topology import init_video_parallel

    with model_parallel(tp=1, cp=4, hierarchical_cp=[2, 2]):
        groups = init_video_parallel(2)
        stack = {rc: _transformer_block_case(groups, rc) for rc in (False, True, "block")}
        return _layer_errors(), stack


STACK_CASE = dict(
    name="transformer_block",
    variant="hybrid",
    full=False,
    t=4,
    h=2,
    w=3,
    b=2,
    hkv=H,
    dtype=torch.float64,
    seed=11,
)


def _transformer_block_case(groups, recompute):
    """Two ST-DiT layers in a VideoTransformerBlock (Megatron's TransformerBlock), full attention in
    layer 2 only; with and without full activation recompute (the conditioning is a checkpoint
    argument, the rest of the DiTParams closed over)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.models.dit_layer import VideoTransformerBlock
    from megatron_video.models.dit_layer_specs import get_stdit_layer_spec

    model_parallel_cuda_manual_seed(1234)
    # recompute True: every layer checkpointed ("uniform"); "block": the first layer only
    extra = (
        dict(
            recompute_granularity="full",
            recompute_num_layers=1,
            recompute_method="block" if recompute == "block" else "uniform",
        )
        if recompute
        else {}
    )
    cfg = _config(H, num_layers=2, **extra)
    spec = get_stdit_layer_spec(
        "hybrid", full_attention_layers=(2,), lora_rank=LORA, context_dim=DC
    )
    block = VideoTransformerBlock(cfg, spec, post_layer_norm=False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(
                (1.0 if name.endswith("layernorm.weight") else 0.0)
                + 0.3 * torch.randn(p.shape, generator=gen)
            )
    block = block.double().train()
    return _run_block(block, STACK_CASE, groups.cp_rank, groups.cp_size)


def _layer_errors():
    """Bad inputs raise ValueError naming the parameter (before any collective)."""
    from megatron_video.layouts.stdit import VideoGeometry
    from megatron_video.models.dit_layer import DiTParams

    errors = []
    good = dict(CASES[0], seed=0)
    layer = _build(good)
    hidden, cond = torch.zeros(6, 2, D, dtype=torch.float64), torch.zeros(2, D, dtype=torch.float64)
    attempts = [
        dict(params=DiTParams(cond, VideoGeometry(6, 2, 3))),  # t % P != 0
        dict(params=DiTParams(cond, VideoGeometry(8, 2, 3))),  # wrong s
        dict(params=DiTParams(cond)),  # no geometry
        dict(params=None),  # no params
        dict(params=DiTParams(None, VideoGeometry(4, 2, 3))),  # no conditioning
        # the old convention: conditioning in Megatron's attention_mask slot is refused
        dict(params=DiTParams(cond, VideoGeometry(4, 2, 3)), attention_mask=cond),
    ]
    for kw in attempts:
        try:
            layer(hidden, **kw)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _tp2_cp2_case(case):
    """TP = 2 x CP = 2 (ring of 2 across the simulated nodes); full parameters / gradients gathered
    over TP from each sharded parameter's ``partition_dim``."""
    from megatron.core import parallel_state as ps

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.parallel.comm import all_gather_cat
    from megatron_video.parallel.topology import init_video_parallel

    initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    groups = init_video_parallel(1)
    layer = _build(case)
    res = _run_block(layer, case, groups.cp_rank, groups.cp_size)
    tp = ps.get_tensor_model_parallel_group()
    res["sharded"] = set()
    for n, p in layer.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            res["sharded"].add(n)
            res["params"][n] = all_gather_cat(p.detach().double(), tp, p.partition_dim)
            res["grads"][n] = all_gather_cat(p.grad.double(), tp, p.partition_dim)
    res["tp_rank"], res["cp_rank"] = ps.get_tensor_model_parallel_rank(), groups.cp_rank
    from megatron_video.models.dit_blocks import DiTSelfAttention

    cfg = _config(H)
    cfg.qk_layernorm = False  # Megatron would not sum the QK-norm gradients over TP
    try:
        DiTSelfAttention(cfg)
    except ValueError as e:
        res["qk_error"] = str(e)
    return res


def _single_process_cases(cases):
    """CP = 1 (DP = 4): rank i runs cases i, i+4, ... each on one process, no communication."""
    import torch.distributed as dist

    from megatron_video.compat import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    return [
        _run_block(_build(case), case, 0, 1)
        for case in cases[dist.get_rank() :: dist.get_world_size()]
    ]


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------
F64, BF16 = torch.float64, torch.bfloat16
CASES = [
    dict(
        name="hybrid_padded",
        variant="hybrid",
        full=False,
        t=4,
        h=2,
        w=3,
        b=2,
        hkv=H,
        dtype=F64,
        seed=1,
    ),
    dict(
        name="hybrid_full_gqa",
        variant="hybrid",
        full=True,
        t=8,
        h=2,
        w=2,
        b=2,
        hkv=2,
        dtype=F64,
        seed=2,
    ),
    dict(
        name="hybrid_full_bf16",
        variant="hybrid",
        full=True,
        t=4,
        h=2,
        w=3,
        b=2,
        hkv=H,
        dtype=BF16,
        seed=3,
    ),
    dict(
        name="hybrid_images",
        variant="hybrid",
        full=True,
        t=1,
        h=2,
        w=3,
        b=4,
        hkv=H,
        dtype=F64,
        seed=4,
    ),
    dict(
        name="cp_everywhere",
        variant="cp_everywhere",
        full=True,
        t=4,
        h=2,
        w=3,
        b=2,
        hkv=H,
        dtype=F64,
        seed=5,
    ),
    dict(
        name="ulysses_everywhere",
        variant="ulysses_everywhere",
        full=True,
        t=4,
        h=2,
        w=3,
        b=2,
        hkv=H,
        dtype=F64,
        seed=6,
    ),
    dict(
        name="hybrid_init",
        variant="hybrid",
        full=True,
        t=4,
        h=2,
        w=3,
        b=2,
        hkv=H,
        dtype=F64,
        seed=7,
        perturb=False,
    ),
]
SINGLE = [
    c
    for c in CASES
    if c["name"] in ("hybrid_padded", "hybrid_full_gqa", "hybrid_images", "hybrid_full_bf16")
]


def _oracle(case, params):
    x, c, ctx, ctx_mask, up = _inputs(case)
    P = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    x, c, ctx = (z.clone().requires_grad_(True) for z in (x, c, ctx))
    t, n, w = case["t"], case["h"] * case["w"], case["w"]
    gidx = torch.arange(t * n)
    thw = torch.stack([gidx // n, (gidx % n) // w, gidx % w], -1)
    out = oracle_block(P, x, c, ctx, ctx_mask, thw, case["full"], case["hkv"])
    (out * up).sum().backward()
    return out.detach(), x.grad, c.grad, ctx.grad, {n: p.grad for n, p in P.items()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _close(a, b, case, what, bf16_reference=None, partials=None):
    """float64: tight. bf16: the parallel result may be at most 2x (+0.01) as far from the float64
    oracle as the same block run in bf16 on one process (``bf16_reference``), i.e. distributing adds
    no error beyond bf16's own; outputs and input gradients also within 3% outright."""
    if case["dtype"] == torch.float64:
        torch.testing.assert_close(
            a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{case['name']} {what}: {m}"
        )
        return
    err = _rel(a, b)
    if bf16_reference is not None:
        ref_err = _rel(bf16_reference, b)
        # a parameter gradient summed over ranks is a sum of P partials, each rounded to bf16 on
        # its own rank: add that rounding (4 ulp of each partial's size), which the one-process
        # run, rounding only the total, does not have (it dominates when the partials cancel)
        extra = 0.0
        if partials is not None:
            size = sum(g.abs() for g in partials).norm() / b.norm().clamp_min(1e-30)
            extra = 4 * 2.0**-8 * size.item()
        assert err <= 2 * ref_err + 1e-2 + extra, (
            f"{case['name']} {what}: error {err:.3g} vs one-process bf16 {ref_err:.3g} "
            f"(+ {extra:.3g} for the per-rank rounding of the partials)"
        )
    if "grad of" not in what:
        assert err < 3e-2, f"{case['name']} {what}: relative error {err:.3g}"


def _check_against_oracle(case, per_rank, cat_dim, single=None):
    """Compare the per-rank results with the oracle; ``single``: the one-process run (bf16 bound)."""
    ref_out, ref_dx, ref_dc, ref_dctx, ref_grads = _oracle(case, per_rank[0]["params"])
    image = case["t"] == 1
    sr = single or {}
    _close(
        torch.cat([r["out"] for r in per_rank], dim=cat_dim),
        _flat(ref_out),
        case,
        "output",
        sr.get("out"),
    )
    _close(
        torch.cat([r["dx"] for r in per_rank], dim=cat_dim),
        _flat(ref_dx),
        case,
        "input grad",
        sr.get("dx"),
    )
    if image:  # conditioning and text are per sample: each rank's own samples
        _close(
            torch.cat([r["dc"] for r in per_rank]), ref_dc, case, "conditioning grad", sr.get("dc")
        )
        _close(
            torch.cat([r["dctx"] for r in per_rank]), ref_dctx, case, "text grad", sr.get("dctx")
        )
    else:  # replicated inputs: partial gradients summed over ranks
        _close(sum(r["dc"] for r in per_rank), ref_dc, case, "conditioning grad", sr.get("dc"))
        _close(sum(r["dctx"] for r in per_rank), ref_dctx, case, "text grad", sr.get("dctx"))
    assert set(ref_grads) == set(per_rank[0]["grads"])
    for name, ref in ref_grads.items():
        _close(
            sum(r["grads"][name] for r in per_rank),
            ref,
            case,
            f"grad of {name}",
            sr.get("grads", {}).get(name),
            partials=[r["grads"][name] for r in per_rank],
        )
        # (one-frame temporal attention ignores q and k: their norms' gradients are truly zero)
        trivially_zero = (
            case["t"] == 1 and name.startswith("temporal_attention.") and "layernorm" in name
        )
        if case.get("perturb", True) and case["dtype"] == torch.float64 and not trivially_zero:
            assert ref.abs().max() > 1e-6, (
                f"{case['name']}: oracle grad of {name} is zero; weak test"
            )


def _flat(x):
    return x.reshape(x.shape[0], -1, D)


@pytest.fixture(scope="module")
def single(pool4):
    """The SINGLE cases, each on one process (CP = 1), spread over the 4 ranks: name -> result."""
    single_runs = pool4.run(_single_process_cases, SINGLE)
    return {c["name"]: single_runs[i % 4][i // 4] for i, c in enumerate(SINGLE)}


def test_stdit_block_single_process_matches_oracle(single):
    for case in SINGLE:  # the layer on one process is the oracle too (float64; bf16 within 3%)
        _check_against_oracle(case, [single[case["name"]]], 0 if case["t"] == 1 else 1)
        assert single[case["name"]]["comm"]["a2a_fwd"] == single[case["name"]]["comm"]["p2p"] == 0


def test_stdit_transformer_block_and_layer_errors_on_4_ranks(pool4):
    out = pool4.run(_cp4_stack_and_errors)  # U=2 x R=2 over 2 simulated nodes
    for errors in (o[0] for o in out):
        assert len(errors) == 6, errors
        assert "num_frames (6) must be divisible by cp_size (4)" in errors[0]
        assert "hidden_states sequence length (6) must be frames per rank (2)" in errors[1]
        assert "params.geometry (NoneType) must be a VideoGeometry" in errors[2]
        assert "params (NoneType) must be a DiTParams" in errors[3]
        assert "params.conditioning must be the AdaLN conditioning vector [b, D]" in errors[4]
        assert "attention_mask must be None for STDiTLayer" in errors[5]
    _check_transformer_block([o[1] for o in out])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_stdit_block_on_4_ranks_matches_single_process_oracle(pool4, single, case):
    per_rank = pool4.run(_cp4_case, case)  # U=2 x R=2 over 2 simulated nodes
    cat_dim = 0 if case["t"] == 1 else 1
    if case.get("perturb", True):
        _check_against_oracle(case, per_rank, cat_dim, single.get(case["name"]))
    else:  # AdaLN-zero: the block is exactly the identity at initialisation
        x = _flat(_inputs(case)[0])
        assert torch.equal(torch.cat([r["out"] for r in per_rank], dim=cat_dim), x)
    for r in per_rank:
        assert r["ctx_same"]
        comm = r["comm"]
        if case["t"] == 1:  # images run data-parallel over the CP group: no communication
            assert comm["a2a_fwd"] == comm["a2a_bwd"] == comm["p2p"] == 0, (case["name"], comm)
        elif case["variant"] == "hybrid":
            # exactly 2 all-to-alls per block forward and backward outside the full attention,
            # whose 2D attention adds 4 (q, k, v, out) in the Ulysses group; spatial adds none
            assert (comm["transition_fwd"], comm["transition_bwd"]) == (2, 2), (case["name"], comm)
            full = 4 if case["full"] else 0
            assert comm["a2a_fwd"] == comm["a2a_bwd"] == 2 + full, (case["name"], comm)
            if not case["full"]:
                assert comm["p2p"] == 0 and comm["tags"] == [
                    "stdit.frames_to_positions",
                    "stdit.positions_to_frames",
                ], comm
        elif case["variant"] == "ulysses_everywhere":  # 4 per attention x 3 attentions
            assert comm["a2a_fwd"] == comm["a2a_bwd"] == 12 and comm["p2p"] == 0, comm
            assert comm["transition_fwd"] == 0
        else:  # cp_everywhere: 2D attention (4 a2a + ring P2P) for each of the 3 attentions
            assert comm["a2a_fwd"] == comm["a2a_bwd"] == 12 and comm["p2p"] > 0, comm
            assert comm["transition_fwd"] == 0


def _check_transformer_block(stacks):
    """Layer 1 (no full attention) then layer 2 (with): oracle applied twice; recompute identical."""
    plain = [s[False] for s in stacks]
    params = plain[0]["params"]
    layer_params = [
        {k[len(f"layers.{i}.") :]: v for k, v in params.items() if k.startswith(f"layers.{i}.")}
        for i in range(2)
    ]
    assert any(k.startswith("full_attention.") for k in layer_params[1])
    assert not any(k.startswith("full_attention.") for k in layer_params[0])
    x, c, ctx, ctx_mask, up = _inputs(STACK_CASE)
    P = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    x, c, ctx = (z.clone().requires_grad_(True) for z in (x, c, ctx))
    n, w = 6, 3
    gidx = torch.arange(4 * n)
    thw = torch.stack([gidx // n, (gidx % n) // w, gidx % w], -1)
    y = x
    for i in range(2):
        Pi = {k[len(f"layers.{i}.") :]: v for k, v in P.items() if k.startswith(f"layers.{i}.")}
        y = oracle_block(Pi, y, c, ctx, ctx_mask, thw, i == 1, H)
    (y * up).sum().backward()
    case = STACK_CASE
    _close(torch.cat([r["out"] for r in plain], 1), _flat(y.detach()), case, "block output")
    _close(torch.cat([r["dx"] for r in plain], 1), _flat(x.grad), case, "block input grad")
    _close(sum(r["dc"] for r in plain), c.grad, case, "block conditioning grad")
    _close(sum(r["dctx"] for r in plain), ctx.grad, case, "block text grad")
    for name, p in P.items():
        _close(sum(r["grads"][name] for r in plain), p.grad, case, f"block grad of {name}")
    for s in stacks:  # full activation recompute (uniform or block) changes nothing
        for rc in (True, "block"):
            for key in ("out", "dx", "dc", "dctx"):
                torch.testing.assert_close(s[rc][key], s[False][key], rtol=1e-12, atol=1e-12)
            for name in P:
                torch.testing.assert_close(
                    s[rc]["grads"][name], s[False]["grads"][name], rtol=1e-12, atol=1e-12
                )


def test_stdit_block_tp2_cp2_matches_oracle(pool4):
    case = dict(CASES[1], name="hybrid_full_tp2_cp2", hkv=H)
    out = pool4.run(_tp2_cp2_case, case)
    by_cp = {}
    for r in out:
        by_cp.setdefault(r["cp_rank"], []).append(r)
    per_cp = []
    for c in sorted(by_cp):
        a, b = sorted(by_cp[c], key=lambda r: r["tp_rank"])
        for key in ("out", "dx", "dc", "dctx"):  # activations are replicated over TP
            assert torch.equal(a[key], b[key]), (c, key)
        grads = {}
        for n in a["grads"]:
            if n in a["sharded"]:
                grads[n] = a["grads"][n]  # gathered over TP already
            elif "q_layernorm" in n or "k_layernorm" in n:
                grads[n] = a["grads"][n] + b["grads"][n]  # per-head partials; Megatron sums over TP
            else:
                torch.testing.assert_close(a["grads"][n], b["grads"][n], rtol=1e-12, atol=1e-12)
                grads[n] = a["grads"][n]
        per_cp.append(dict(a, grads=grads))
    assert len(per_cp) == 2 and "mlp.linear_fc1.weight" in per_cp[0]["sharded"]
    assert all(
        "config.qk_layernorm (False) must be True when tensor_model_parallel_size (2)"
        in r.get("qk_error", "")
        for r in out
    )
    _check_against_oracle(case, per_cp, 1)


def test_spec_rejects_unknown_variant():
    from megatron_video.models.dit_layer_specs import get_stdit_layer_spec

    with pytest.raises(ValueError, match=r"variant \('ring'\) must be one of"):
        get_stdit_layer_spec("ring")
