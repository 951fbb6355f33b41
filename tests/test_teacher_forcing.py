"""Teacher-forcing objective under Balanced SP: SP=4 (2D attention) equals SP=1 in float64.

The oracle is written here from first principles: the single-GPU sequence ``[clean ; noisy]``, the
mask rules token by token, explicit softmax attention, and the loss as a plain mean over all noisy
tokens. A tiny plain-torch DiT (patch-token embed, time conditioning by adaLN, temporal RoPE,
attention through an injected function) is run once through the oracle and once per SP rank with
``dist_attention``; loss, per-rank predictions and SP-summed parameter gradients must agree.
"""

import math

import pytest
import torch
from torch import nn

from megatron_video.diffusion.teacher_forcing import (
    TeacherForcingMask,
    TeacherForcingObjective,
    local_frame_tokens,
)
from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.testing.masks import teacher_forcing_oracle
from megatron_video.testing.parallel import video_parallel

B, F, S, NB, D_IN = 2, 8, 4, 2, 6  # batch, latent frames, tokens/frame, frames/block, token dim


# ---------------------------------------------------------------------------------------------
# a tiny teacher-forced DiT
# ---------------------------------------------------------------------------------------------
def rope(x, pos):
    """Rotary embedding over head_dim pairs by the temporal position of each token."""
    d = x.shape[-1]
    freqs = 1.0 / (100.0 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
    ang = pos.to(x.dtype)[:, None] * freqs[None, :]  # [L, d/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 6 * dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, c, pos, mask, attention):
        b, L, dim = x.shape
        s1, sc1, g1, s2, sc2, g2 = self.mod(c).chunk(6, dim=-1)
        h = nn.functional.layer_norm(x, (dim,)) * (1 + sc1) + s1
        q, k, v = self.qkv(h).view(b, L, 3, self.heads, dim // self.heads).unbind(2)
        a = attention(rope(q, pos), rope(k, pos), v, mask)
        x = x + g1 * self.proj(a.reshape(b, L, dim))
        h = nn.functional.layer_norm(x, (dim,)) * (1 + sc2) + s2
        return x + g2 * self.mlp(h)


class TinyTFDiT(nn.Module):
    """``model(x [B, L, D], t [B, L], *, frame_positions, token_ids, mask)``; attention injected."""

    def __init__(self, in_dim=D_IN, dim=16, heads=4, depth=2, tokens_per_frame=S):
        super().__init__()
        self.tokens_per_frame = tokens_per_frame
        self.embed = nn.Linear(in_dim, dim)
        self.spatial = nn.Parameter(torch.randn(tokens_per_frame, dim) * 0.1)
        self.t_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.final_mod = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, in_dim)
        self.attention = None  # fn(q, k, v, mask) -> [B, L, H, d]; set by the caller

    def time_embedding(self, t):
        half = self.embed.out_features // 2
        f = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=t.dtype) / half)
        a = 1000.0 * t[..., None] * f
        return self.t_mlp(torch.cat([a.cos(), a.sin()], dim=-1))

    def forward(self, x, t, *, frame_positions, token_ids, mask):
        h = self.embed(x) + self.spatial[token_ids % self.tokens_per_frame]
        c = self.time_embedding(t)
        for blk in self.blocks:
            h = blk(h, c, frame_positions, mask, self.attention)
        shift, scale = self.final_mod(c).chunk(2, dim=-1)
        h = nn.functional.layer_norm(h, (h.shape[-1],)) * (1 + scale) + shift
        return self.out(h)


def make_model():
    torch.manual_seed(1234)
    return TinyTFDiT().double()


def make_data():
    g = torch.Generator().manual_seed(7)
    clean = torch.randn(B, F * S, D_IN, generator=g, dtype=torch.float64)
    noise = torch.randn(B, F * S, D_IN, generator=g, dtype=torch.float64)
    t_blocks = torch.rand(B, F // NB, generator=g, dtype=torch.float64)
    return clean, noise, t_blocks


# ---------------------------------------------------------------------------------------------
# the single-GPU oracle
# ---------------------------------------------------------------------------------------------
def oracle_mask():
    return teacher_forcing_oracle(F, S, NB)


def dense_attention(allow):
    def fn(q, k, v, mask):  # explicit softmax; ignores the mask object, uses the oracle's
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        p = torch.softmax(s.masked_fill(~allow, float("-inf")), dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", p, v)

    return fn


def oracle_loss_and_grads():
    model = make_model()
    clean, noise, t_blocks = make_data()
    model.attention = dense_attention(oracle_mask())
    frame = torch.arange(F).repeat_interleave(S)
    t_tok = t_blocks[:, frame // NB]  # [B, F*S]
    noisy = (1 - t_tok[..., None]) * clean + t_tok[..., None] * noise
    x = torch.cat([clean, noisy], dim=1)
    t = torch.cat([torch.zeros_like(t_tok), t_tok], dim=1)
    pred = model(
        x, t, frame_positions=frame.repeat(2), token_ids=torch.arange(2 * F * S), mask=None
    )
    loss = ((pred[:, F * S :] - (noise - clean)) ** 2).mean()  # mean over all loss tokens
    loss.backward()
    return loss.detach(), pred.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def oracle():
    return oracle_loss_and_grads()


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------
def test_sp1_objective_equals_oracle(oracle):
    loss_ref, pred_ref, grads_ref = oracle
    lay = BalancedSPLayout(F, S, NB, 1)
    obj = TeacherForcingObjective(lay)
    model = make_model()
    mask = obj.mask
    allow = mask.dense(torch.arange(2 * F * S), torch.arange(2 * F * S))
    assert torch.equal(allow, oracle_mask())
    model.attention = dense_attention(allow)
    clean, noise, t_blocks = make_data()
    out = obj(model, clean, noise=noise, block_timesteps=t_blocks)
    out.loss.backward()
    assert out.num_loss_tokens == B * F * S
    assert torch.allclose(out.loss, loss_ref, rtol=0, atol=1e-12)
    assert torch.allclose(out.prediction, pred_ref, rtol=0, atol=1e-12)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads_ref[n], rtol=0, atol=1e-12), n


def test_mask_object_matches_layout():
    lay = BalancedSPLayout(16, 2, 2, 4, ring_size=2)
    m = TeacherForcingMask(lay)
    N = 2 * 16 * 2
    ids = torch.arange(N)
    assert torch.equal(m.dense(ids, ids), lay.teacher_forcing_mask())
    dense = lay.teacher_forcing_mask()
    for q0, k0, n in [(0, 0, 8), (8, 0, 8), (0, 8, 8), (40, 16, 8), (3, 5, 11), (0, 0, 0)]:
        q, k = torch.arange(q0, min(N, q0 + n)), torch.arange(k0, min(N, k0 + n))
        sub = dense[q][:, k]
        want = 0 if sub.numel() == 0 or not bool(sub.any()) else (2 if bool(sub.all()) else 1)
        assert m.block_status(q, k) == want


def test_objective_validation():
    lay = BalancedSPLayout(F, S, NB, 1)
    obj = TeacherForcingObjective(lay)
    clean, noise, t_blocks = make_data()
    with pytest.raises(
        ValueError, match=r"clean shape \(\(2, 16, 6\)\) must be \[B, F/P\*S = 32, D\]"
    ):
        obj(make_model(), clean[:, :16], noise=noise, block_timesteps=t_blocks)
    with pytest.raises(
        ValueError, match=r"block_timesteps shape \(\(2, 3\)\) must be \[B, F/nb\] = \[2, 4\]"
    ):
        obj(make_model(), clean, noise=noise, block_timesteps=t_blocks[:, :3])
    with pytest.raises(ValueError, match=r"requires layout.sp_size == 1, got 4"):
        TeacherForcingObjective(BalancedSPLayout(F, S, NB, 4))


def test_sampled_draws_and_local_frames():
    lay = BalancedSPLayout(F, S, NB, 1)
    obj = TeacherForcingObjective(lay)
    model = make_model()
    model.attention = dense_attention(oracle_mask())
    clean = make_data()[0]
    out = obj(model, clean, generator=torch.Generator().manual_seed(0))
    assert out.block_timesteps.shape == (B, F // NB)
    assert bool(((out.block_timesteps > 0) & (out.block_timesteps < 1)).all())
    lay4 = BalancedSPLayout(F, S, NB, 4, ring_size=2)
    for r in range(4):
        want = torch.cat(
            [clean[:, f * S : (f + 1) * S] for f in lay4.rank_frames(r).tolist()], dim=1
        )
        assert torch.equal(local_frame_tokens(lay4, r, clean), want)


# ---------------------------------------------------------------------------------------------
# SP = 4 over gloo
# ---------------------------------------------------------------------------------------------
def _sp_case(U, R, balance, rpn):
    from megatron_video.attention import dist_attention
    from megatron_video.parallel import CommTracer, comm

    with video_parallel(U, R, ranks_per_node=rpn) as groups:
        lay = BalancedSPLayout(F, S, NB, U * R, ring_size=R, ring_balance=balance)
        obj = TeacherForcingObjective(lay, groups)
        model = make_model()
        model.attention = lambda q, k, v, mask: dist_attention(
            q, k, v, groups, mask=mask, scheme="contiguous"
        )
        clean, noise, t_blocks = make_data()
        r = groups.cp_rank
        with CommTracer() as tr:
            out = obj(
                model,
                local_frame_tokens(lay, r, clean),
                noise=local_frame_tokens(lay, r, noise),
                block_timesteps=t_blocks,
            )
            out.loss.backward()
        grads = {
            n: comm.all_reduce(p.grad.clone(), groups.cp_group) for n, p in model.named_parameters()
        }
        # sampled timesteps: SP rank 0's draw everywhere, whatever each rank's generator says
        t_sampled = obj.sample_block_timesteps(
            B, torch.Generator().manual_seed(100 + r), torch.float64
        )
        return dict(
            rank=r,
            loss=out.loss_value,
            share=out.loss.detach(),
            pred=out.prediction.detach(),
            ids=lay.local_global_ids(r),
            n=out.num_loss_tokens,
            grads=grads,
            a2a=tr.count("all_to_all"),
            ring=tr.count("send"),
            t_sampled=t_sampled,
        )


# (U, R, ring_balance, ranks_per_node): pure Ulysses in one node; 2 nodes x 2 with and without
# ring balancing; a pure ring
@pytest.mark.parametrize(
    "U,R,bal,rpn", [(4, 1, False, 4), (2, 2, True, 2), (2, 2, False, 2), (1, 4, False, 1)]
)
def test_sp4_equals_sp1(pool4, oracle, U, R, bal, rpn):
    loss_ref, pred_ref, grads_ref = oracle
    per_rank = pool4.run(_sp_case, U, R, bal, rpn)
    shares = 0.0
    for res in per_rank:
        assert res["n"] == B * F * S
        assert torch.allclose(res["loss"], loss_ref, rtol=0, atol=1e-12), (U, R, bal)
        # this rank's predictions are the oracle's at its tokens' single-GPU ids
        assert torch.allclose(res["pred"], pred_ref[:, res["ids"]], rtol=0, atol=1e-11), (U, R)
        for n, g in res["grads"].items():
            assert torch.allclose(g, grads_ref[n], rtol=0, atol=1e-11), (U, R, bal, n)
        assert res["a2a"] > 0 if U > 1 else res["a2a"] == 0
        assert res["ring"] > 0 if R > 1 else res["ring"] == 0
        shares = shares + res["share"]
    t0 = [rr["t_sampled"] for rr in per_rank if rr["rank"] == 0][0]
    assert all(torch.equal(rr["t_sampled"], t0) for rr in per_rank)
    # the per-rank shares sum to the global loss: normalised by the global loss-token count
    assert torch.allclose(shares, loss_ref, rtol=0, atol=1e-12)
    assert sorted(torch.cat([rr["ids"] for rr in per_rank]).tolist()) == list(range(2 * F * S))
