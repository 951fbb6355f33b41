"""Dense local attention kernels that return the log-sum-exp (``attention_forward`` /
``attention_backward``, with the global ``out`` and ``lse`` so each KV block's gradient is exact on
its own) and ``dense_local_attention``, their autograd wrapper for a dense ``[b, h, sq, sk]`` mask.
Layouts ``q [b, sq, h, d]``, ``k, v [b, sk, h_kv, d]``; backends: ``BACKENDS``, ``"auto"`` chosen by
``resolve_backend``. Rows with no visible key give ``out = 0`` and ``lse = -inf`` (never NaN).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import Optional, Tuple

import torch

__all__ = [
    "BACKENDS",
    "available_backends",
    "resolve_backend",
    "attention_forward",
    "attention_backward",
    "dense_local_attention",
    "accumulation_dtype",
]

logger = logging.getLogger(__name__)

BACKENDS = ("math", "sdpa", "flex", "flash_attn")
_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Backend availability and choice
# ----------------------------------------------------------------------------------------------
def _has_cpu_flash() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


@functools.lru_cache(maxsize=None)
def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def available_backends() -> Tuple[str, ...]:
    out = ["math"]
    if _has_cpu_flash() or torch.cuda.is_available():
        out.append("sdpa")
    if _flex() is not None:
        out.append("flex")
    if _flash_attn_func() is not None and torch.cuda.is_available():
        out.append("flash_attn")
    return tuple(out)


_LOGGED = set()


def _log_once(name: str, why: str) -> None:
    if name not in _LOGGED:
        _LOGGED.add(name)
        logger.info("megatron_video attention kernel: %s (%s)", name, why)


def resolve_backend(backend: str, q: torch.Tensor, masked: bool) -> str:
    """The forward backend used for ``q`` (masked or not); ``ValueError`` for unknown/unavailable."""
    if backend == "auto":
        if q.dtype == torch.float64:
            name, why = "math", "float64 inputs"
        elif not q.is_cuda:
            name, why = (
                ("sdpa", "CPU flash kernel with LSE")
                if _has_cpu_flash()
                else ("math", "no CPU flash kernel")
            )
        elif (
            not masked
            and q.dtype in (torch.float16, torch.bfloat16)
            and _flash_attn_func() is not None
        ):
            name, why = "flash_attn", "CUDA, unmasked fp16/bf16 block"
        elif _flex() is not None:
            name, why = "flex", "CUDA with masks"
        else:
            name, why = "sdpa", "CUDA memory-efficient kernel"
        _log_once(name, why)
        return name
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be 'auto' or one of {BACKENDS}")
    if backend not in available_backends():
        raise ValueError(
            f"backend ({backend!r}) is not available here (available: {available_backends()})"
        )
    if backend == "flash_attn" and (masked or q.dtype not in (torch.float16, torch.bfloat16)):
        # flash-attn takes no arbitrary mask: masked (or fp32) blocks of a ring use the auto choice
        return resolve_backend("auto", q, masked)
    _log_once(backend, "requested")
    return backend


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Input checks and helpers
# ----------------------------------------------------------------------------------------------
def check_qkv_tensors(q, k, v, seq: str = "s") -> None:
    """``q``, ``k``, ``v`` are 4-D tensors ``[b, <seq>, heads, head_dim]``; ``k`` and ``v`` have
    one shape."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} ({tuple(getattr(t, 'shape', ()))}) must be a 4-D tensor "
                f"[b, {seq}, heads, head_dim]"
            )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")


def _check(q, k, v, mask) -> None:
    check_qkv_tensors(q, k, v)
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head_dim")
    if h % k.shape[2]:
        raise ValueError(f"q heads ({h}) must be divisible by kv heads ({k.shape[2]}) (GQA)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes ({q.dtype}, {k.dtype}, {v.dtype}) must be equal")
    if mask is not None:
        if (
            not isinstance(mask, torch.Tensor)
            or mask.dtype != torch.bool
            or mask.dim() not in (2, 4)
        ):
            raise ValueError(
                f"mask must be None or a bool tensor [sq, sk] or [b, h, sq, sk] (got "
                f"{getattr(mask, 'dtype', type(mask).__name__)} "
                f"{tuple(getattr(mask, 'shape', ()))})"
            )
        if tuple(mask.shape[-2:]) != (sq, k.shape[1]):
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must end in (sq, sk) = ({sq}, {k.shape[1]})"
            )


def _mask4(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return mask if mask is None or mask.dim() == 4 else mask[None, None]


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // x.shape[2]
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.view(b, s, kv_heads, h // kv_heads, d).sum(3)


def _dead_rows(m4: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[b|1, h|1, sq]`` True where a query row sees no key, or None if there is none."""
    if m4 is None:
        return None
    dead = ~m4.any(-1)
    return dead if bool(dead.any()) else None


def _bias(m4: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    if m4 is None:
        return None
    return torch.zeros(m4.shape, dtype=dtype, device=m4.device).masked_fill(~m4, _NEG_INF)


# ----------------------------------------------------------------------------------------------
# math
# ----------------------------------------------------------------------------------------------
def _scores(q, k, m4, scale, acc):
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), _expand_kv(k, q.shape[2]).to(acc)) * scale
    return s if m4 is None else s.masked_fill(~m4, _NEG_INF)


def _math_fwd(q, k, v, m4, scale):
    acc = accumulation_dtype(q.dtype)
    s = _scores(q, k, m4, scale, acc)
    lse = torch.logsumexp(s, dim=-1)
    # Fully masked rows: lse = -inf; shift by 0 so that exp(-inf) = 0 gives a zero row.
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).to(acc))
    return out.to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, m4, scale):
    acc = accumulation_dtype(q.dtype)
    h, hk = q.shape[2], k.shape[2]
    s = _scores(q, k, m4, scale, acc)
    p = torch.exp(s - lse.to(acc)[..., None])  # lse of dead rows is +inf here -> p = 0
    do = dout.to(acc)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, _expand_kv(v, h).to(acc))
    delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, sq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, h).to(acc)) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc)) * scale
    return dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk)


# ----------------------------------------------------------------------------------------------
# sdpa (torch fused kernels with LSE)
# ----------------------------------------------------------------------------------------------
def _sdpa_fwd(q, k, v, m4, scale):
    h = q.shape[2]
    qt, kt, vt = (
        q.transpose(1, 2),
        _expand_kv(k, h).transpose(1, 2),
        _expand_kv(v, h).transpose(1, 2),
    )
    bias = _bias(m4, q.dtype)
    if q.is_cuda:
        if bias is not None:
            bias = bias.expand(q.shape[0], h, q.shape[1], k.shape[1])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True, 0.0, False, scale=scale
        )[:2]
        lse = lse[..., : q.shape[1]]  # the kernel pads the LSE's sequence dim
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, False, attn_mask=bias, scale=scale
        )
    out = out.transpose(1, 2)
    lse = lse.to(accumulation_dtype(q.dtype))
    dead = _dead_rows(m4)
    if dead is not None:  # the fused kernels report lse = 0 (or NaN) for rows without keys
        dead = dead.expand(lse.shape)
        lse = lse.masked_fill(dead, _NEG_INF)
        out = out.masked_fill(dead.transpose(1, 2)[..., None], 0.0)
    return out, lse


def _sdpa_cpu_bwd(dout, q, k, v, out, lse, m4, scale):
    h, hk = q.shape[2], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        t(dout.to(q.dtype)),
        t(q),
        t(_expand_kv(k, h)),
        t(_expand_kv(v, h)),
        t(out.to(q.dtype)),
        lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous(),
        0.0,
        False,
        attn_mask=_bias(m4, q.dtype),
        scale=scale,
    )
    dq, dk, dv = (x.transpose(1, 2).to(acc) for x in (dq, dk, dv))
    return dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk)


# ----------------------------------------------------------------------------------------------
# flex / flash_attn (optional, GPU-oriented)
# ----------------------------------------------------------------------------------------------
# Compiled FlexAttention entries a process may hold (Dynamo's recompile limit for the call,
# raised from its default 8 deliberately). Sequence lengths are dynamic, so entries grow with the
# (mask kind, dtype, grad mode) combinations a run uses, not with shapes; past the bound a call
# raises instead of silently running flex's unfused eager path (docs/attention.md).
FLEX_COMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def _compiled_flex(device_type: str, compiled: Optional[bool] = None, backend: str = "inductor"):
    """FlexAttention for ``device_type``, to be called inside ``flex_compile_bound()``: compiled (by
    default on CUDA only) with dynamic lengths on CUDA; Inductor's CPU flex template (forward
    only, no LSE) gets static shapes (its C++ codegen fails on dynamic ones in torch 2.13)."""
    flex_attention = _flex()[0]
    if compiled is None:
        compiled = device_type == "cuda"
    if not compiled:
        return flex_attention
    dynamic = device_type != "cpu" or backend != "inductor"
    return torch.compile(flex_attention, dynamic=dynamic, backend=backend)


def flex_compile_bound():
    """Context of every compiled flex call: recompile limit ``FLEX_COMPILE_LIMIT`` (or Dynamo's own
    if higher), and hitting it raises instead of falling back to eager."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    changes = {name: max(getattr(cfg, name), FLEX_COMPILE_LIMIT)}
    if hasattr(cfg, "fail_on_recompile_limit_hit"):  # feature-detected (torch >= 2.6)
        changes["fail_on_recompile_limit_hit"] = True
    return cfg.patch(**changes)


def _flex_fwd(q, k, v, m4, scale):
    _, create_block_mask = _flex()
    h = q.shape[2]
    block_mask = None
    if m4 is not None:
        dense = m4.expand(q.shape[0], h, q.shape[1], k.shape[1])
        block_mask = create_block_mask(
            lambda b, hh, qi, ki: dense[b, hh, qi, ki],
            q.shape[0],
            h,
            q.shape[1],
            k.shape[1],
            device=q.device,
        )
    with warnings.catch_warnings():  # eager (uncompiled) flex on CPU is expected, not a mistake
        warnings.simplefilter("ignore", UserWarning)
        # detached: our own autograd function owns the backward (flex has none on CPU)
        with flex_compile_bound():
            out, lse = _compiled_flex(q.device.type)(
                q.detach().transpose(1, 2),
                k.detach().transpose(1, 2),
                v.detach().transpose(1, 2),
                block_mask=block_mask,
                scale=scale,
                enable_gqa=k.shape[2] != h,
                return_lse=True,
            )
    out, lse = out.transpose(1, 2), lse.to(accumulation_dtype(q.dtype))
    dead = _dead_rows(m4)
    if dead is not None:
        dead = dead.expand(lse.shape)
        lse = lse.masked_fill(dead, _NEG_INF)
        out = out.masked_fill(dead.transpose(1, 2)[..., None], 0.0)
    return out, lse


def _flash_attn_fwd(q, k, v, m4, scale):
    out, lse, _ = _flash_attn_func()(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False, return_attn_probs=True
    )
    return out, lse.float()


_FWD = {"math": _math_fwd, "sdpa": _sdpa_fwd, "flex": _flex_fwd, "flash_attn": _flash_attn_fwd}


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


@torch.no_grad()
def attention_forward(q, k, v, mask=None, softmax_scale=None, backend="auto"):
    """``(out [b, sq, h, d], lse [b, h, sq])`` without autograd (the ring's block forward)."""
    _check(q, k, v, mask)
    name = resolve_backend(backend, q, mask is not None)
    return _FWD[name](q, k, v, _mask4(mask), _scale(softmax_scale, q.shape[-1]))


@torch.no_grad()
def attention_backward(dout, q, k, v, out, lse, mask=None, softmax_scale=None, backend="auto"):
    """``(dq, dk, dv)`` in the accumulation dtype, given the GLOBAL ``out`` and ``lse`` of the rows.

    Rows with ``lse = -inf`` (no visible key anywhere) get zero gradients.
    """
    _check(q, k, v, mask)
    name = resolve_backend(backend, q, mask is not None)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # exp(s - inf) = 0 for dead rows
    m4, scale = _mask4(mask), _scale(softmax_scale, q.shape[-1])
    if name in ("sdpa", "flex") and not q.is_cuda and _has_cpu_flash():
        return _sdpa_cpu_bwd(dout, q, k, v, out, lse, m4, scale)
    return _math_bwd(dout, q, k, v, out, lse, m4, scale)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, backend):
        out, lse = attention_forward(q, k, v, mask, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.backend = mask, scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.mask, ctx.scale, ctx.backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def dense_local_attention(q, k, v, mask=None, softmax_scale=None, backend="auto"):
    """Autograd-aware local attention with a dense (e.g. per-head) bool mask: ``(out, lse)``."""
    return _LocalAttention.apply(q, k, v, mask, softmax_scale, backend)
