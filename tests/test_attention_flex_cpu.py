"""The GPU engine path through torch's real FlexAttention / SDPA machinery, on CPU.

``backend="flex"`` on CPU (the documented check path, docs/attention.md) runs the engine's flex path
with torch's unfused flex math path: the BlockMask built from our tile status, our mask_mods, the
LSE merge and the recompute backward, against a float64 oracle written from the masks' definitions
(``megatron_video.testing.masks``). Inductor's CPU flex lowering (the subgraph builder CUDA uses too)
compiles the forward of the mask_mods that gather; compilation is counted; the tensors the CUDA
SDPA kernels would be handed are checked on the exact call sequence of block-causal / packed /
ring blocks.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_video.attention import dist_attention, engine, kernels, local_attention, masks
from megatron_video.attention.engine import flex, tiles
from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
from megatron_video.layouts import BalancedSPLayout
from megatron_video.testing import masks as mask_oracles
from megatron_video.testing.oracles import random_qkv, rel_max_errors
from megatron_video.testing.oracles import softmax_attention as oracle

pytestmark = [
    pytest.mark.one_env,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

S = 200  # ragged: not a multiple of the 128 / 512 tiles
CU = [0, 1, 1, 60, 61, 190]  # a one-token document, an empty one; tokens past 190 are padding
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}


def _dead(q, k):
    return (k <= q) & (q % 7 != 3)  # rows q = 3 (mod 7) see no key


def _tf_layout():
    return BalancedSPLayout(num_latent_frames=4, tokens_per_frame=25, frames_per_block=2, sp_size=1)


def case(kind):
    """``(mask given to the engine, bool [S, S] oracle from first principles)``."""
    ids = torch.arange(S)
    q, k = ids[:, None], ids[None, :]
    if kind == "full":
        return masks.full(), torch.ones(S, S, dtype=torch.bool)
    if kind == "causal":
        return masks.causal(), k <= q
    if kind == "block_causal":
        return masks.block_causal(37), k // 37 <= q // 37
    if kind == "teacher_forcing":
        lay = _tf_layout()
        allow = mask_oracles.teacher_forcing_oracle(F=4, S=25, nb=2)
        return TeacherForcingMask(lay), allow
    if kind == "packed":
        return masks.packed(CU, inner=masks.causal()), mask_oracles.allowed(
            "packed_causal", ids, ids, cu=CU
        )
    if kind == "packed_predicate":
        allow = mask_oracles.allowed("packed", ids, ids, cu=CU)
        doc_start = torch.tensor(CU)[torch.searchsorted(torch.tensor(CU), ids, right=True) - 1]
        rel = (ids - doc_start)[:, None], (ids - doc_start)[None, :]
        inner = masks.predicate(lambda a, b: (a - b) % 3 == 0)
        return masks.packed(CU, inner=inner), allow & ((rel[0] - rel[1]) % 3 == 0)
    if kind == "predicate_dead_rows":
        return masks.predicate(_dead), _dead(q, k)
    if kind == "dense_2d":
        table = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) < 0.4
        table[5] = False  # a dead row
        return table, table
    raise AssertionError(kind)


KINDS = [
    "full",
    "causal",
    "block_causal",
    "teacher_forcing",
    "packed",
    "packed_predicate",
    "predicate_dead_rows",
    "dense_2d",
]


def _check(kind, tile, dtype, h=4, hk=2, d=8):
    mask, allow = case(kind)
    q, k, v, dout = random_qkv(1, S, h, hk, d, seed=len(kind) + tile)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))  # the oracle sees the rounded inputs
    scale = d**-0.5 * 1.3
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = oracle(q64, k64, v64, allow, scale, return_lse=True)
    ref = [ref_out, *torch.autograd.grad((ref_out * dout.double()).sum(), (q64, k64, v64))]
    qx, kx, vx = (x.clone().requires_grad_() for x in (q, k, v))
    if kind == "teacher_forcing":  # the ring path (one process): block_forward / _flex_backward
        out = dist_attention(
            qx, kx, vx, None, mask=mask, softmax_scale=scale, backend="flex", tile=tile
        )
        lse = None
    else:
        out, lse = local_attention(qx, kx, vx, mask, scale, backend="flex", tile=tile)
    got = [out, *torch.autograd.grad((out * dout).sum(), (qx, kx, vx))]
    assert all(bool(torch.isfinite(g).all()) for g in got), "NaN / inf in outputs or gradients"
    errs = rel_max_errors([g.double() for g in got], [r.detach() for r in ref])
    assert max(errs) <= TOL[dtype], f"{kind} tile {tile} {dtype}: out/dq/dk/dv errors {errs}"
    if lse is not None:
        dead = torch.isneginf(ref_lse)
        assert bool(torch.isneginf(lse[dead]).all()), "rows without keys must have lse = -inf"
        lerr = float((lse.double()[~dead] - ref_lse.detach()[~dead]).abs().max())
        assert lerr <= TOL[dtype], f"{kind} tile {tile} {dtype}: LSE error {lerr}"
        assert bool((out[dead.transpose(1, 2)] == 0).all()), "rows without keys must be zero"


@pytest.mark.parametrize("kind", KINDS)
def test_flex_engine_fp32_matches_float64_oracle(kind):
    for tile in (128, 512):
        _check(kind, tile, torch.float32)


@pytest.mark.parametrize("kind", ["causal", "teacher_forcing", "packed", "predicate_dead_rows"])
def test_flex_engine_bf16_matches_float64_oracle(kind):
    _check(kind, 128, torch.bfloat16)


def test_flex_is_an_option_not_a_fallback_on_cpu():
    q = torch.zeros(1, 4, 2, 8)
    assert engine.engine_backend("flex", q, masks.causal()) == "flex"
    assert engine.engine_backend("auto", q, masks.causal()) == "sdpa"


def _block_mask_wrong_pairs(mask, tile):
    ids = torch.arange(S)
    plan = engine.plan_for(ids, ids, mask, tile, "flex")
    bm = flex.block_mask(plan, torch.device("cpu"))
    truth = mask.dense(ids, ids)
    got = torch.zeros(S, S, dtype=torch.bool)
    nq = plan.status.shape[0]
    for kind, num, idx in (
        ("full", bm.full_kv_num_blocks, bm.full_kv_indices),
        ("partial", bm.kv_num_blocks, bm.kv_indices),
    ):
        for i in range(nq):
            for j in idx[0, 0, i, : int(num[0, 0, i])].tolist():
                qs, ks = slice(i * tile, (i + 1) * tile), slice(j * tile, (j + 1) * tile)
                qi, ki = ids[qs][:, None], ids[ks][None, :]
                got[qs, ks] = True if kind == "full" else bm.mask_mod(0, 0, qi, ki)
    return int((got != truth).sum())


@pytest.mark.parametrize("kind", KINDS)
def test_block_mask_block_lists_equal_the_mask(kind):
    mask, _ = case(kind)
    mask = masks.from_dense(mask) if isinstance(mask, torch.Tensor) else mask
    for tile in (16, 64, 128):
        assert _block_mask_wrong_pairs(mask, tile) == 0, f"{kind} tile {tile}"


# ------------------------------------------------------------------------------------------------
# Inductor's flex lowering (CPU forward, no LSE on CPU): the mask_mods must lower
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["predicate_dead_rows", "dense_2d"])
def test_mask_mods_lower_through_inductor(kind):
    mask, allow = case(kind)
    mask = masks.from_dense(mask) if isinstance(mask, torch.Tensor) else mask
    ids = torch.arange(S)
    plan = engine.plan_for(ids, ids, mask, 128, "flex")
    q, k, v, _ = random_qkv(1, S, 2, 2, 16, seed=5)
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    with torch.no_grad(), kernels.flex_compile_bound():
        out = kernels._compiled_flex("cpu", True)(
            qt, kt, vt, block_mask=flex.block_mask(plan, q.device), scale=0.25
        )
    live = allow.any(-1)
    ref = oracle(q, k, v, allow, 0.25).transpose(1, 2)
    err = float((out.double() - ref)[:, :, live].abs().max())
    assert err <= 1e-5, err


# ------------------------------------------------------------------------------------------------
# Bounded compilation: dynamic lengths, a raised limit that fails instead of falling back
# ------------------------------------------------------------------------------------------------
def test_flex_compilations_are_bounded_and_never_fall_back():
    """Dynamo's own tracing and guards (its ``eager`` backend: no Inductor codegen, same cache):
    2 "layers" over 4 lengths x 2 mask kinds compile at most 2 entries per (mask kind, dtype,
    grad mode) (the block count's first change makes one dynamic entry); a compile per shape fails."""
    compiled = kernels._compiled_flex("cuda", True, "eager")  # the CUDA path's compile options
    before = counters["stats"]["unique_graphs"]
    combos = 0
    for mask in (masks.causal(), masks.predicate(_dead)):
        for dtype in (torch.float32,):
            combos += 1
            for s in (130, 257, 390, 511):
                ids = torch.arange(s)
                plan = engine.plan_for(ids, ids, mask, 128, "flex")
                for _layer in range(2):
                    q = torch.randn(1, 2, s, 8, dtype=dtype)
                    with torch.no_grad(), kernels.flex_compile_bound():
                        assert torch._dynamo.config.fail_on_recompile_limit_hit
                        assert torch._dynamo.config.recompile_limit >= kernels.FLEX_COMPILE_LIMIT
                        compiled(q, q, q, block_mask=flex.block_mask(plan, q.device))
    graphs = counters["stats"]["unique_graphs"] - before
    assert 0 < graphs <= 2 * combos <= kernels.FLEX_COMPILE_LIMIT, graphs


# ------------------------------------------------------------------------------------------------
# What the CUDA SDPA kernels are handed (flash: dense LSE; memory-efficient: aligned bias rows)
# ------------------------------------------------------------------------------------------------
class KernelRecorder:
    """Stands in for ``torch.ops.aten`` on CUDA: checks every input the kernels read as dense
    memory, returns zeros of the kernels' output shapes."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):
        def op(*args, **kwargs):
            self.calls.append(name)
            q, k, v = args[1:4] if "backward" in name else args[:3]
            bias_at = {"attention": 3, "attention_backward": 4}.get(name.split("efficient_")[-1])
            for i, t in enumerate(args[:6]):
                if isinstance(t, torch.Tensor) and t.dim() == 4 and i != bias_at:
                    assert t.stride(-1) == 1, f"{name}: argument {i} inner dim not contiguous"
            b, h, sq = q.shape[:3]
            if name == "_scaled_dot_product_flash_attention":
                return torch.zeros_like(q), torch.zeros(b, h, sq)
            if name == "_scaled_dot_product_efficient_attention":
                bias = args[3]
                self._check_bias(name, bias, q)
                return torch.zeros_like(q), torch.zeros(b, h, -(-sq // 32) * 32)
            if name == "_scaled_dot_product_flash_attention_backward":
                lse = args[5]
                assert lse.is_contiguous() and tuple(lse.shape) == (b, h, sq), (
                    f"{name}: LSE {tuple(lse.shape)} strides {lse.stride()} not dense [b, h, s_q]"
                )
                assert lse.dtype == torch.float32
            elif name == "_scaled_dot_product_efficient_attention_backward":
                self._check_bias(name, args[4], q)
                lse = args[6]
                assert lse.is_contiguous() and lse.shape[-1] % 32 == 0 and lse.shape[-1] >= sq
                assert tuple(lse.shape[:2]) == (b, h)
            else:
                raise AssertionError(name)
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        return op

    @staticmethod
    def _check_bias(name, bias, q):
        if bias is None:
            return
        row = bias.stride(-2) * bias.element_size()
        assert bias.stride(-1) == 1 and row % 16 == 0, f"{name}: bias row stride {bias.stride()}"
        assert (bias.storage_offset() * bias.element_size()) % 16 == 0
        assert tuple(bias.shape[:2]) == tuple(q.shape[:2])


def _ring_ids(n):  # a zigzag shard of 2n chunks: rank 0 of 2 holds chunks 0 and 3
    c = n // 4
    return torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_sdpa_inputs_are_dense_and_aligned(monkeypatch, dtype):
    rec = KernelRecorder()
    monkeypatch.setattr(tiles, "_on_cuda", lambda t: True)
    monkeypatch.setattr(tiles, "_aten", rec)
    for mask, ids in (
        (masks.block_causal(97), torch.arange(390)),  # 390-token tiles: rows not 16-aligned
        (masks.packed([0, 130, 131, 390], inner=masks.causal()), torch.arange(390)),
        (masks.causal(), _ring_ids(520)),
        (masks.predicate(_dead), torch.arange(390)),
    ):
        for b in (1, 2):
            plan = engine.plan_for(ids, ids, mask, 130, "sdpa")
            q, k, v = (torch.randn(b, ids.numel(), 4, 8, dtype=dtype) for _ in range(3))
            dout = torch.randn(b, 4, ids.numel(), 8, dtype=dtype)  # [b, h, s, d] as the engine's
            out, lse = engine.block_forward(None, None, q, k, v, plan, 0.3, "sdpa", fresh=True)
            engine.block_backward(
                None, None, None, dout, q, k, v, out.to(dtype), lse, plan, 0.3, "sdpa", fresh=True
            )
    names = set(rec.calls)
    assert "_scaled_dot_product_efficient_attention_backward" in names
    if dtype == torch.bfloat16:
        assert "_scaled_dot_product_flash_attention_backward" in names
