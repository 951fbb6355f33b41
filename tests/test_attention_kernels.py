"""Local kernels with LSE: math / CPU flash (sdpa) / flex against an explicit float64 oracle,
the per-block backward with global out and lse (the ring identity), GQA, dead rows, errors."""

import functools

import pytest
import torch

from megatron_video.attention import (
    attention_backward,
    attention_forward,
    dist_attention,
    kernels,
    local_attention,
    masks,
)
from megatron_video.testing.oracles import softmax_attention

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

# float64 explicit softmax; returns (out, lse); rows without keys give 0 and -inf
oracle = functools.partial(softmax_attention, return_lse=True)


def inputs(b=2, sq=7, sk=9, h=4, hk=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    allow = torch.rand(sq, sk, generator=g) < 0.6
    allow[2] = False  # a row with no visible key
    return (
        mk(b, sq, h, d),
        mk(b, sq if sq == sk else sk, hk, d),
        mk(b, sk, hk, d),
        mk(b, sq, h, d),
        allow,
    )


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2.5e-2}


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_forward_matches_oracle(backend, dtype, hk):
    q, _, v, _, allow = inputs(hk=hk, dtype=dtype)
    k = v.flip(1)
    for m in (allow, None, allow[None, None].expand(2, 4, -1, -1)):
        out, lse = attention_forward(q, k, v, m, 0.4, backend)
        ref, ref_lse = oracle(q, k, v, m, 0.4)
        assert out.dtype == dtype and out.shape == q.shape
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out.double() - ref).abs().max() < TOL[dtype]
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() < max(TOL[dtype], 1e-6)
        if m is not None:
            assert (out[:, 2] == 0).all()  # the dead row is exactly zero


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_blockwise_backward_with_global_lse_is_exact(backend, dtype):
    """Splitting the keys into blocks and calling attention_backward on each block with the GLOBAL
    out and lse, the summed gradients equal autograd through the whole oracle (the ring identity)."""
    q, k, v, dout, allow = inputs(sq=9, sk=9, hk=2, dtype=dtype, seed=1)
    allow[:, 4:] &= torch.arange(9)[:, None] > 5  # second block: more rows fully masked
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref, lse = oracle(qd, kd, vd, allow, 0.5)
    (ref * dout.double()).sum().backward()
    out = ref.detach().to(dtype)
    dq = torch.zeros_like(qd)
    dk, dv = torch.zeros_like(kd), torch.zeros_like(vd)
    for ks in (slice(0, 4), slice(4, 9)):
        g = attention_backward(
            dout, q, k[:, ks], v[:, ks], out, lse.detach(), allow[:, ks], 0.5, backend
        )
        assert all(not torch.isnan(x).any() for x in g)
        dq += g[0].double()
        dk[:, ks] += g[1].double()
        dv[:, ks] += g[2].double()
    tol = 10 * TOL[dtype]
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert (got - want).abs().max() / max(1.0, float(want.abs().max())) < tol


def test_local_attention_autograd_and_dead_rows():
    q, k, v, dout, allow = inputs(sq=9, sk=9, hk=1, seed=2)
    for backend in ("math", "sdpa"):
        a = [x.clone().requires_grad_() for x in (q, k, v)]
        b = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = local_attention(*a, allow, 0.3, backend)
        (out * dout).sum().backward()
        ref, _ = oracle(*b, allow, 0.3)
        (ref * dout).sum().backward()
        assert (out - ref).abs().max() < 1e-12
        for x, y in zip(a, b):
            assert not torch.isnan(x.grad).any()
            assert (x.grad - y.grad).abs().max() < 1e-12
        assert (a[0].grad[:, 2] == 0).all()  # no key -> no gradient


def test_dist_attention_single_process_matches_oracle():
    """N = 1 (no groups) runs the same a2a/ring code path with no communication."""
    q, k, v, dout, _ = inputs(sq=10, sk=10, hk=2, seed=3)
    for mask, allow in (
        (masks.causal(), torch.ones(10, 10, dtype=torch.bool).tril()),
        (None, None),
    ):
        a = [x.clone().requires_grad_() for x in (q, k, v)]
        b = [x.clone().requires_grad_() for x in (q, k, v)]
        out = dist_attention(*a, None, mask=mask, softmax_scale=0.3)
        (out * dout).sum().backward()
        ref, _ = oracle(*b, allow, 0.3)
        (ref * dout).sum().backward()
        assert (out - ref).abs().max() < 1e-12
        assert all((x.grad - y.grad).abs().max() < 1e-12 for x, y in zip(a, b))


def test_flex_forward_matches_math():
    """FlexAttention (eager on CPU: forward only; its backward runs through the CPU flash kernel)."""
    if "flex" not in kernels.available_backends():
        pytest.fail("torch.nn.attention.flex_attention should exist in the pinned torch")
    q, _, v, dout, allow = inputs(b=1, sq=8, sk=8, hk=1, dtype=torch.float32, seed=4)
    k = v.flip(1)
    out, lse = attention_forward(q, k, v, allow, 0.5, "flex")
    ref, ref_lse = attention_forward(q, k, v, allow, 0.5, "math")
    assert (out - ref).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    g = attention_backward(dout, q, k, v, out, lse, allow, 0.5, "flex")
    g_ref = attention_backward(dout, q, k, v, ref, ref_lse, allow, 0.5, "math")
    assert all((x - y).abs().max() < 1e-5 for x, y in zip(g, g_ref))


def test_auto_backend_choice():
    x = torch.zeros(1, 2, 1, 4)
    assert kernels.resolve_backend("auto", x.double(), True) == "math"
    assert kernels.resolve_backend("auto", x, True) == "sdpa"
    assert kernels.resolve_backend("auto", x.bfloat16(), False) == "sdpa"


@pytest.mark.parametrize(
    "call,frag",
    [
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4)
            ),
            "q ((1, 2, 4)) must be a 4-D tensor",
        ),
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4)
            ),
            "q heads (3) must be divisible by kv heads (2)",
        ),
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 2, 4),
                torch.zeros(1, 3, 2, 4),
                torch.zeros(1, 3, 2, 4),
                torch.ones(2, 2, dtype=torch.bool),
            ),
            "must end in (sq, sk) = (2, 3)",
        ),
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 2, 4),
                torch.zeros(1, 2, 2, 4),
                torch.zeros(1, 2, 2, 4),
                torch.ones(2, 2),
            ),
            "mask must be None or a bool tensor",
        ),
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 2, 4),
                torch.zeros(1, 2, 2, 4),
                torch.zeros(1, 2, 2, 4),
                backend="cudnn",
            ),
            "backend ('cudnn')",
        ),
        (
            lambda: attention_forward(
                torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4).double()
            ),
            "dtypes",
        ),
    ],
)
def test_kernel_errors(call, frag):
    with pytest.raises(ValueError) as e:
        call()
    assert frag in str(e.value)
