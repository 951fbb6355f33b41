"""Shared DiT blocks on one process against explicit float64 formulas."""

import functools
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_video.models import dit_blocks as B
from megatron_video.testing.oracles import softmax_attention
from megatron_video.testing.parallel import model_parallel

D, H, HD = 24, 4, 6


@pytest.fixture(scope="module")
def megatron_tp1():
    """One-process gloo group (torn down if created here) + Megatron parallel state (TP = 1)."""
    created_pg = not dist.is_initialized()
    if created_pg:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with model_parallel(tp=1, seed=0):
        yield
    if created_pg:
        dist.destroy_process_group()


def _config(hkv=H, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=D,
        num_attention_heads=H,
        num_query_groups=hkv,
        kv_channels=HD,
        ffn_hidden_size=2 * D,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        qk_layernorm=True,
        add_bias_linear=True,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        **kw,
    )


# explicit softmax attention in the inputs' dtype; mask (True = attend) broadcasts to [B, H, S, Sk]
_softmax_attention = functools.partial(softmax_attention, dtype=None)


def _randomise(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------
def test_timestep_embedding_formula():
    t = torch.tensor([0.0, 1.5, 999.0], dtype=torch.float64)
    e = B.timestep_embedding(t, 8)
    freqs = torch.tensor([10000 ** (-i / 4) for i in range(4)], dtype=torch.float64)
    expect = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], -1)
    torch.testing.assert_close(e, expect, rtol=1e-12, atol=1e-12)
    odd = B.timestep_embedding(t, 7)
    assert odd.shape == (3, 7) and (odd[:, -1] == 0).all()
    with pytest.raises(ValueError, match=r"dim \(1\) must be >= 2"):
        B.timestep_embedding(t, 1)


def test_modulate_and_gate_broadcast_per_sample():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    shift, scale, gate = (torch.randn(2, 4, dtype=torch.float64) for _ in range(3))
    y = B.modulate(x, shift, scale)
    for i in range(2):
        torch.testing.assert_close(y[i], x[i] * (1 + scale[i]) + shift[i])
        torch.testing.assert_close(B.gated(x, gate)[i], x[i] * gate[i])


def test_rope_3d_is_relative_and_norm_preserving():
    assert B.rope_3d_split(8) == (4, 2, 2) and B.rope_3d_split(64) == (24, 20, 20)
    with pytest.raises(ValueError, match=r"head_dim \(7\) must be even and >= 6"):
        B.rope_3d_split(7)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 5, 2, 16, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 9, (5, 3), generator=gen)
    shift = torch.tensor([3, 1, 4])

    def scores(p):
        a = B.rope_3d_angles(p, 16)
        return torch.einsum("bqhd,bkhd->bhqk", B.apply_rope(q, a), B.apply_rope(k, a))

    # q.k after RoPE depends only on the 3D offset between the tokens
    torch.testing.assert_close(scores(pos), scores(pos + shift), rtol=1e-10, atol=1e-10)
    # ...and does depend on each axis (every axis has its own channels)
    for axis in range(3):
        moved = pos.clone()
        moved[0, axis] += 1
        assert not torch.allclose(scores(pos), scores(moved))
    a = B.rope_3d_angles(pos, 16)
    torch.testing.assert_close(B.apply_rope(q, a).norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(B.apply_rope(q, B.rope_3d_angles(torch.zeros(5, 3), 16)), q)


def _explicit_rope_3d(x, thw, dims, theta=10000.0):
    """The 3D RoPE formula written out element by element (float64, Python loops): the rotation
    angles are ``[t-angles, h-angles, w-angles]`` with ``angle_j = pos_axis * theta^(-2j / n_axis)``
    for the ``n_axis`` channels of each axis (``dims``), and channel ``i`` rotates with channel
    ``i + d/2``: ``(x_i, x_{i+d/2}) -> (x_i cos a_i - x_{i+d/2} sin a_i, x_{i+d/2} cos a_i + x_i
    sin a_i)``."""
    b, s, h, d = x.shape
    out = torch.empty_like(x)
    for si in range(s):
        angles = []
        for axis, n in enumerate(dims):
            for j in range(n // 2):
                angles.append(float(thw[si, axis]) * theta ** (-2.0 * j / n))
        assert len(angles) == d // 2
        for bi in range(b):
            for hi in range(h):
                for i, a in enumerate(angles):
                    x1, x2 = float(x[bi, si, hi, i]), float(x[bi, si, hi, i + d // 2])
                    out[bi, si, hi, i] = x1 * math.cos(a) - x2 * math.sin(a)
                    out[bi, si, hi, i + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


@pytest.mark.parametrize("d, dims", [(16, (8, 4, 4)), (12, (4, 4, 4)), (64, (24, 20, 20))])
def test_rope_3d_equals_the_explicit_formula(d, dims):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(2, 6, 2, d, generator=gen, dtype=torch.float64)
    thw = torch.randint(0, 40, (6, 3), generator=gen)
    got = B.apply_rope(x, B.rope_3d_angles(thw, d))
    torch.testing.assert_close(got, _explicit_rope_3d(x, thw, dims), rtol=1e-12, atol=1e-12)


def test_attend_matches_softmax_with_gqa_and_mask():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 6, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 2, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 5, 7, generator=gen) < 0.6
    mask[..., 0] = True
    torch.testing.assert_close(B.attend(q, k, v, mask), _softmax_attention(q, k, v, mask))
    torch.testing.assert_close(B.attend(q, k, v), _softmax_attention(q, k, v))


# ---------------------------------------------------------------------------------------------
# Modules (Megatron linear layers; TP = 1 here, TP = 2 in tests/test_stdit.py)
# ---------------------------------------------------------------------------------------------
def test_adaln_lora_is_zero_at_init_and_low_rank(megatron_tp1):
    cfg = _config()
    mod = B.AdaLNLoRAModulation(cfg, num_chunks=9, lora_rank=4)
    c = torch.randn(3, D, dtype=torch.float64)
    chunks = mod(c)
    assert len(chunks) == 9 and all(ch.shape == (3, D) and (ch == 0).all() for ch in chunks)
    assert sum(p.numel() for p in mod.parameters()) == D * 4 + 4 * 9 * D + 9 * D  # vs 9 D^2 dense
    _randomise(mod)
    expect = (F.silu(c) @ mod.linear_down.weight.T) @ mod.linear_up.weight.T + mod.linear_up.bias
    torch.testing.assert_close(torch.cat(mod(c), -1), expect)
    with pytest.raises(ValueError, match=r"lora_rank \(0\) must be >= 1"):
        B.AdaLNLoRAModulation(cfg, lora_rank=0)


def test_timestep_embedder(megatron_tp1):
    emb = B.TimestepEmbedder(_config(), frequency_dim=16)
    t = torch.tensor([1.0, 250.0], dtype=torch.float64)
    e = emb(t)
    f = B.timestep_embedding(t, 16)
    expect = emb.linear_2(F.silu(f @ emb.linear_1.weight.T + emb.linear_1.bias))
    torch.testing.assert_close(e, expect)
    e.sum().backward()
    assert emb.linear_1.weight.grad.abs().sum() > 0


def test_head_rmsnorm_is_per_head(megatron_tp1):
    norm = B.HeadRMSNorm(_config(), HD)
    _randomise(norm)
    x = torch.randn(2, 3, H, HD, dtype=torch.float64)
    expect = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expect)
    x2 = x.clone()
    x2[:, :, 1] *= 7.0  # heads do not mix: the other heads are untouched, head 1 is scale-free
    others = [0, 2, 3]
    assert torch.equal(norm(x2)[:, :, others], norm(x)[:, :, others])
    # scale-free up to eps = 1e-5 in the rsqrt: |diff| 1.6e-5 measured (|out| <= 2.4)
    torch.testing.assert_close(norm(x2)[:, :, 1], norm(x)[:, :, 1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("hkv", [H, 2])
def test_self_attention_projections_use_megatron_group_layout(megatron_tp1, hkv):
    attn = B.DiTSelfAttention(_config(hkv))
    _randomise(attn)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    angles = B.rope_3d_angles(torch.randint(0, 4, (5, 3)), HD)
    q, k, v = attn.qkv(x, angles)
    g = H // hkv
    W = attn.linear_qkv.weight.view(hkv, g + 2, HD, D)  # per query group: [q_1..q_g, k, v]
    bias = attn.linear_qkv.bias.view(hkv, g + 2, HD)
    proj = torch.einsum("bsd,gjed->bsgje", x, W) + bias
    qe = proj[:, :, :, :g].reshape(2, 5, H, HD)
    rms = lambda z, w: z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
    torch.testing.assert_close(q, B.apply_rope(rms(qe, attn.q_layernorm.weight), angles))
    torch.testing.assert_close(
        k, B.apply_rope(rms(proj[:, :, :, g], attn.k_layernorm.weight), angles)
    )
    torch.testing.assert_close(v, proj[:, :, :, g + 1])
    o = torch.randn(2, 5, H, HD, dtype=torch.float64)
    torch.testing.assert_close(
        attn.project(o), o.reshape(2, 5, H * HD) @ attn.linear_proj.weight.T + attn.linear_proj.bias
    )


def test_cross_attention_sees_whole_text_and_respects_mask(megatron_tp1):
    dc, L = 10, 6
    cross = B.DiTCrossAttention(_config(2), context_dim=dc)
    _randomise(cross)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    ctx = torch.randn(2, L, dc, dtype=torch.float64)
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[1, 4:] = False
    out = cross(x, ctx, mask)
    rms = lambda z, w: z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
    q = rms(
        (x @ cross.linear_q.weight.T + cross.linear_q.bias).view(2, 5, H, HD),
        cross.q_layernorm.weight,
    )
    kv = (ctx @ cross.linear_kv.weight.T + cross.linear_kv.bias).view(2, L, 2, 2, HD)
    k, v = rms(kv[..., 0, :], cross.k_layernorm.weight), kv[..., 1, :]
    o = _softmax_attention(q, k, v, mask[:, None, None, :])
    torch.testing.assert_close(
        out, o.reshape(2, 5, H * HD) @ cross.linear_proj.weight.T + cross.linear_proj.bias
    )
    ctx2 = ctx.clone()
    ctx2[1, 4:] = 100.0  # masked (padding) text tokens do not matter
    torch.testing.assert_close(cross(x, ctx2, mask), out)
    with pytest.raises(ValueError, match=r"context batch \(1\) must equal the video batch \(2\)"):
        cross(x, ctx[:1])
    with pytest.raises(ValueError, match=r"context_mask shape \(2, 5\) must be \[b, L\]"):
        cross(x, ctx, mask[:, :5])


def test_head_divisibility_errors_name_the_parameter(megatron_tp1):
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be divisible by num_query_groups \(3\)"
    ):
        B.DiTSelfAttention(_config(3))


def test_stdit_layer_rejects_sequence_parallel(megatron_tp1):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_video.models.dit_layer_specs import get_stdit_layer_spec

    cfg = _config()
    cfg.sequence_parallel = True  # (Megatron only accepts it with TP > 1; the layer refuses it)
    with pytest.raises(ValueError, match=r"config.sequence_parallel \(True\) is not supported"):
        build_module(get_stdit_layer_spec(), config=cfg)
