"""Float64 references for tests: explicit softmax attention (outputs, LSE, gradients).

Written from the definition of attention, never from ``megatron_video.attention``; rows without a
visible key give exact zeros (and an LSE of -inf), never NaN.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "softmax_attention",
    "output_and_grads",
    "attention_with_grads",
    "rel_max_errors",
    "max_rel_error",
    "random_qkv",
]


def softmax_attention(
    q,
    k,
    v,
    allow=None,
    scale=None,
    *,
    layout="bshd",
    return_lse=False,
    dtype: Optional[torch.dtype] = torch.float64,
):
    """Explicit softmax attention; GQA by repeating kv heads.

    ``layout`` is ``"bshd"`` (q [b, s, h, d]) or ``"sbhd"`` (Megatron's [s, b, h, d]; the output is
    then [s, b, h * d]). ``allow`` (True = attend) broadcasts to [b, h, sq, sk]; ``scale`` defaults
    to 1/sqrt(d). Inputs are cast to ``dtype`` (float64) unless ``dtype`` is None.
    """
    if layout not in ("bshd", "sbhd"):
        raise ValueError(f"layout ({layout!r}) must be 'bshd' or 'sbhd'")
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    eq_in, eq_out = (
        ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")
        if layout == "bshd"
        else ("qbhd,kbhd->bhqk", "bhqk,kbhd->qbhd")
    )
    s = torch.einsum(eq_in, q, k) * scale
    if allow is not None:
        s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, -1)
    dead = torch.isneginf(lse)
    p = torch.softmax(s.masked_fill(dead[..., None], 0.0), -1) * (~dead)[..., None].to(s.dtype)
    out = torch.einsum(eq_out, p, v)
    if layout == "sbhd":
        out = out.reshape(out.shape[0], out.shape[1], -1)
    return (out, lse) if return_lse else out


def output_and_grads(fn: Callable, q, k, v, dout) -> list:
    """``[out, dq, dk, dv]`` (float64) of ``fn(q, k, v)`` for the loss ``(out * dout).sum()``."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (out * dout.to(out.dtype)).sum().backward()
    return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def attention_with_grads(q, k, v, dout, allow=None, scale=None) -> list:
    """``[out, dq, dk, dv]`` of the float64 oracle (``softmax_attention``, layout bshd)."""
    return output_and_grads(lambda a, b, c: softmax_attention(a, b, c, allow, scale), q, k, v, dout)


def rel_max_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list:
    """Per pair: max |got - ref| / max(1, max |ref|) (float64)."""
    return [
        float((g.double() - r.double()).abs().max() / max(1.0, float(r.abs().max())))
        for g, r in zip(got, ref)
    ]


def max_rel_error(got, ref) -> float:
    return max(rel_max_errors(got, ref))


def random_qkv(b, sq, h, hk, d, seed, sk=None, dtype=torch.float64):
    """Seeded float64 ``q [b, sq, h, d]``, ``k``, ``v [b, sk, hk, d]``, ``dout [b, sq, h, d]``."""
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)
