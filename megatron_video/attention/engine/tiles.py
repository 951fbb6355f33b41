"""Kernels on ``[b, h, s, d]`` views of one call (fused SDPA, math, FlexAttention), the
log-sum-exp merge and the strided views the engine hands them."""

from __future__ import annotations

import torch

from ...ops.rules import PARTIAL
from .. import kernels
from .planning import CAUSAL, BlockPlan

# CUDA kernels' input rules the engine's strided views must meet (checked on CPU by
# tests/test_attention_flex_cpu.py through the seams ``_on_cuda`` / ``_aten``):
BIAS_ROW_ALIGN = 16  # elements: the memory-efficient kernel's bias rows 16-byte aligned (fp32: 4)
LSE_ALIGN = 32  # the memory-efficient kernel's LSE rows are padded to a multiple of 32


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _aten(name: str):
    return getattr(torch.ops.aten, name)


def _bias(m: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))[
        None, None
    ]


def _aligned_bias(m: torch.Tensor, dtype, b: int, h: int) -> torch.Tensor:
    """Additive bias ``[b, h, n_q, n_k]`` (broadcast) whose row stride is a multiple of
    ``BIAS_ROW_ALIGN`` (padded columns, sliced off), as the memory-efficient kernel requires."""
    n_q, n_k = m.shape
    store = torch.full(
        (n_q, n_k + (-n_k % BIAS_ROW_ALIGN)), float("-inf"), dtype=dtype, device=m.device
    )
    view = store[:, :n_k]
    view.masked_fill_(m, 0.0)
    return view[None, None].expand(b, h, n_q, n_k)


def _dense_lse(lse: torch.Tensor, align: int = 1) -> torch.Tensor:
    """``lse [b, h, n]`` as a dense float32 tensor (the kernels index it as ``[b, h, n]`` whatever
    its strides), its last dim padded to a multiple of ``align`` (+inf rows: no probability)."""
    n = lse.shape[-1]
    pad = -n % align
    if pad == 0:
        return lse.float().contiguous()
    out = torch.full(
        (*lse.shape[:-1], n + pad), float("inf"), dtype=torch.float32, device=lse.device
    )
    out[..., :n].copy_(lse)
    return out


def _fwd_sdpa(q, k, v, call, m, scale):
    causal = call.kind == CAUSAL
    if not _on_cuda(q):
        bias = _bias(m, q.dtype) if call.kind == PARTIAL else None
        return _aten("_scaled_dot_product_flash_attention_for_cpu")(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    if call.kind != PARTIAL and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = _aten("_scaled_dot_product_flash_attention")(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse
    bias = _aligned_bias(m, q.dtype, q.shape[0], q.shape[1]) if call.kind == PARTIAL else None
    out, lse = _aten("_scaled_dot_product_efficient_attention")(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]


def _bwd_sdpa(do, q, k, v, o, lse, call, m, scale):
    causal = call.kind == CAUSAL
    if not _on_cuda(q):
        bias = _bias(m, q.dtype) if call.kind == PARTIAL else None
        return _aten("_scaled_dot_product_flash_attention_for_cpu_backward")(
            do, q, k, v, o, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if call.kind != PARTIAL and q.dtype in (torch.float16, torch.bfloat16):
        sq, sk = q.shape[2], k.shape[2]
        return _aten("_scaled_dot_product_flash_attention_backward")(
            do,
            q,
            k,
            v,
            o,
            _dense_lse(lse),
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            zero,
            zero,
            scale=scale,
        )
    bias = _aligned_bias(m, q.dtype, q.shape[0], q.shape[1]) if call.kind == PARTIAL else None
    return _aten("_scaled_dot_product_efficient_attention_backward")(
        do,
        q,
        k,
        v,
        bias,
        o,
        _dense_lse(lse, LSE_ALIGN),
        zero,
        zero,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )[:3]


def _fwd_math(q, k, v, call, m, scale):
    acc = kernels.accumulation_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", p, v.to(acc)).to(q.dtype), lse


def _bwd_math(do, q, k, v, o, lse, call, m, scale):
    acc = kernels.accumulation_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    p = torch.exp(s - lse.to(acc)[..., None])
    do_ = do.to(acc)
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do_)
    dp = torch.einsum("bhqd,bhkd->bhqk", do_, v.to(acc))
    delta = (do_ * o.to(acc)).sum(-1)
    ds = p * (dp - delta[..., None])
    return (
        torch.einsum("bhqk,bhkd->bhqd", ds, k.to(acc)) * scale,
        torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)) * scale,
        dv,
    )


def _merge(out_acc, lse_acc, o, lse):
    """Online-softmax merge of a partial result into the accumulators (in place, [b, h, s, *])."""
    new = torch.logaddexp(lse_acc, lse)
    shift = torch.where(torch.isneginf(new), 0.0, new)  # rows still without keys stay 0 / -inf
    # The weights exp(lse_acc - new) and exp(lse - new) sum to 1, so the merge is one fused pass
    # out += w * (o - out) with no temporary of the output's size (w = 0 / 1 on rows without keys).
    out_acc.lerp_(o.to(out_acc.dtype), torch.exp(lse - shift)[..., None])
    lse_acc.copy_(new)


def _heads_first(x: torch.Tensor, heads: int, contiguous: bool) -> torch.Tensor:
    """``[b, s, hk, d] -> [b, h, s, d]`` with kv heads repeated to ``heads`` (GQA)."""
    x = kernels._expand_kv(x, heads).transpose(1, 2)
    return x.contiguous() if contiguous else x


def _rows(x: torch.Tensor, rows: slice, dim: int, batch: int = 1, step: int = 0) -> torch.Tensor:
    """``x`` narrowed to ``rows`` along ``dim``; with ``batch > 1`` the blocks ``rows + i * step``
    stacked along dim 0 (a strided view; ``x.shape[0]`` must be 1)."""
    if batch == 1:
        return x.narrow(dim, rows.start, rows.stop - rows.start)
    size, stride = list(x.shape), list(x.stride())
    size[dim] = rows.stop - rows.start
    size[0], stride[0] = batch, step * stride[dim]
    return x.as_strided(size, stride, x.storage_offset() + rows.start * stride[dim])


def _runnable(plan: BlockPlan, order, b: int):
    """``(index, call)`` in ``order``; batched calls split into single ones unless batch is 1."""
    for index in order:
        c = plan.calls[index]
        for one in [c] if c.batch == 1 or b == 1 else c.blocks():
            yield index, one
