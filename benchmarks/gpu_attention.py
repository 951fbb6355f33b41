#!/usr/bin/env python
"""Attention on a GPU: every local backend and ``dist_attention`` against a float64 oracle, the
TransformerEngine baseline, and a throughput table. Part of ``benchmarks/gpu_check.sh``.

Sections (each bounded by a share of ``--budget`` seconds; cases that do not fit are listed as
"not run (time budget)", never silently dropped):

  1. local  ``local_attention`` for every backend ``kernels.available_backends()`` reports (math,
            sdpa, flex, flash_attn where importable; flash_attn falls back for masked / fp32 blocks
            and the line says to what) x bf16 / fp32 / fp16 x masks full, causal, block-causal,
            packed documents (uneven, with padding) and a predicate with fully masked rows, GQA,
            plus a ragged length (not a multiple of 128). Checked: output, LSE (and -inf exactly on
            rows without keys), dq, dk, dv; no NaN anywhere.
  2. dist   ``dist_attention(q, k, v, groups=None, mask=...)`` (one process, N = 1: the ring path
            with one step), forward and backward, same oracle.
  3. te     where ``transformer_engine`` imports: ``te.pytorch.DotProductAttention`` (bshd, CP = 1)
            on the same inputs; prints max |ours - TE| for out, dq, dk, dv and TE's own error.
            TE's ``a2a+p2p`` context parallelism needs several GPUs, so it is not run here.
            A TE deviation or TE raising is a WARN; our kernel raising or deviating is a failure.
  4. bench  forward and forward+backward time per backend at b=1, h=16, d=128, bf16, causal,
            s = 8192 and 32768 (``--seqs``), next to the fused kernels themselves (torch SDPA,
            flash-attn, compiled FlexAttention, TE) with TFLOP/s (causal FLOPs, the flash-attn
            convention: fwd 2*b*h*s^2*d, fwd+bwd 3.5x that) and the time ratio to the fastest.
            Our forward and backward run by tile pairs (linear memory in s); entries whose
            estimated memory (``est_ours_bytes``) does not fit are skipped and say so (SKIPPED),
            and the math backend is capped at ``--math-max-seq``.

Errors are max |ours - oracle| / max(1, max |oracle|); tolerances per dtype: fp32 2e-3 (room for
TF32 in Triton kernels), fp16 5e-3, bf16 2.5e-2 (the documented bf16 bound).

    python benchmarks/gpu_attention.py                        # CUDA (SKIPPED, exit 3, without a GPU)
    python benchmarks/gpu_attention.py --device cpu --small   # the same checks on CPU, tiny sizes
    python benchmarks/gpu_attention.py --sections local,dist --json /tmp/attn.json

Exit status: 0 on PASS, 3 when SKIPPED (no CUDA device), 1 when any correctness check fails or errors,
or when our own code raises anywhere (the TE section and the bench included).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.attention import dist_attention, kernels, local_attention, masks  # noqa: E402

DTYPES = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
TOL = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
SECTIONS = ("local", "dist", "te", "bench")
# Cumulative share of the budget at which each section must stop starting new cases.
SHARE = {"local": 0.45, "dist": 0.55, "te": 0.65, "bench": 1.0}


@dataclass(frozen=True)
class Shape:
    b: int
    s: int
    h: int
    hkv: int
    d: int

    def __str__(self):
        return f"b{self.b} s{self.s} h{self.h}/{self.hkv} d{self.d}"


SHAPES = {  # (main, ragged) for correctness
    "full": (Shape(2, 1024, 8, 4, 128), Shape(1, 1000, 4, 2, 128)),
    "small": (Shape(2, 64, 4, 2, 16), Shape(1, 50, 4, 2, 16)),
}
LOCAL_MASKS = ("full", "causal", "block_causal", "packed", "predicate")
DIST_MASKS = ("none", "full", "causal", "block_causal", "packed", "predicate")
TE_MASKS = ("full", "causal", "block_causal")


@dataclass
class Result:
    section: str
    name: str
    status: str  # PASS | FAIL | ERROR | WARN | INFO | SKIP
    errors: Dict[str, float] = field(default_factory=dict)
    tol: Optional[float] = None
    seconds: float = 0.0
    note: str = ""

    def line(self) -> str:
        errs = " ".join(f"{k} {v:.1e}" for k, v in self.errors.items())
        tol = f"  tol {self.tol:.1e}" if self.tol is not None else ""
        note = f"  ({self.note})" if self.note else ""
        return f"  {self.status:<5} {self.name:<44} {errs}{tol}  [{self.seconds:.2f}s]{note}"


# ----------------------------------------------------------------------------------------------
# Optional packages (every import guarded: a broken install is reported, never fatal)
# ----------------------------------------------------------------------------------------------
def _try_import(what: str):
    try:
        if what == "te":
            import transformer_engine  # noqa: F401
            import transformer_engine.pytorch as te

            return te, getattr(transformer_engine, "__version__", "?")
        if what == "flash_attn":
            import flash_attn
            from flash_attn import flash_attn_func

            return flash_attn_func, getattr(flash_attn, "__version__", "?")
        if what == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            return (flex_attention, create_block_mask), torch.__version__
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (missing .so), RuntimeError
        return (
            None,
            f"not importable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
        )
    raise ValueError(f"what ({what!r}) must be 'te', 'flash_attn' or 'flex'")


def our_backends() -> List[str]:
    return list(kernels.available_backends())  # raising here is our failure: the run fails


# ----------------------------------------------------------------------------------------------
# Inputs, masks and the float64 oracle
# ----------------------------------------------------------------------------------------------
def _sparse_window(q, k):
    """Predicate on global ids: a strided local window with every 17th row (q % 17 == 5) dead."""
    return ((q - k) % 3 != 1) & (k <= q + 7) & (q % 17 != 5)


def make_mask(name: str, s: int) -> Optional[masks.AttentionMask]:
    if name == "none":
        return None
    if name == "full":
        return masks.full()
    if name == "causal":
        return masks.causal()
    if name == "block_causal":
        return masks.block_causal(max(1, s // 8))
    if name == "packed":  # uneven documents, a one-token document, trailing padding (dead rows)
        a, c, e = (3 * s) // 10, (3 * s) // 4, s - max(1, s // 16)
        return masks.packed([0, a, a + 1, c, e], inner=masks.causal())
    if name == "predicate":
        return masks.predicate(_sparse_window)
    raise ValueError(f"mask name ({name!r}) must be one of {DIST_MASKS}")


def dense_mask(name: str, s: int, device) -> Optional[torch.Tensor]:
    m = make_mask(name, s)
    if m is None or name == "full":
        return None
    ids = torch.arange(s, device=device)
    return m.dense(ids, ids)


def make_inputs(shape: Shape, dtype, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *sz: torch.randn(*sz, generator=g, dtype=torch.float32).to(
        device=device, dtype=dtype
    )  # noqa: E731
    b, s, h, hk, d = shape.b, shape.s, shape.h, shape.hkv, shape.d
    return mk(b, s, h, d), mk(b, s, hk, d), mk(b, s, hk, d), mk(b, s, h, d)


def oracle(q, k, v, dout, allow: Optional[torch.Tensor], scale: float):
    """Explicit softmax in float64 with autograd: ``(out, lse [b,h,s], dq, dk, dv)``.

    Rows without a visible key give out = 0, lse = -inf and zero gradients (no NaN: the LSE of
    such rows is taken over zeros and their probabilities are exp(-inf) = 0).
    """
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    h = q.shape[2]
    ke = k64.repeat_interleave(h // k.shape[2], dim=2)
    ve = v64.repeat_interleave(h // v.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, ke) * scale
    dead = None
    if allow is not None:
        m4 = allow if allow.dim() == 4 else allow[None, None]
        s = s.masked_fill(~m4, float("-inf"))
        dead = ~m4.any(-1)  # [1|b, 1|h, sq]
        lse = torch.logsumexp(s.masked_fill(dead[..., None], 0.0), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    out.backward(dout.double())
    lse = lse.detach()
    if dead is not None:
        lse = lse.masked_fill(dead, float("-inf"))
    lse = lse.expand(q.shape[0], h, q.shape[1])
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def norm_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(1, max |ref|); inf for NaN or a shape mismatch."""
    if tuple(x.shape) != tuple(ref.shape):
        return float("inf")
    if x.numel() == 0:
        return 0.0
    x = x.detach().double()
    if bool(torch.isnan(x).any()):
        return float("inf")
    return float((x - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Error on rows with keys; inf unless rows without keys are exactly -inf (and others finite)."""
    if tuple(lse.shape) != tuple(ref.shape):
        return float("inf")
    lse = lse.detach().double()
    live = torch.isfinite(ref)
    if (
        bool(torch.isnan(lse).any())
        or not bool(torch.isneginf(lse[~live]).all())
        or not bool(torch.isfinite(lse[live]).all())
    ):
        return float("inf")
    return norm_err(lse[live], ref[live])


def _grads(fn: Callable, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    res = fn(q, k, v)
    out, lse = res if isinstance(res, tuple) else (res, None)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), (None if lse is None else lse.detach()), dq, dk, dv


def _judge(errs: Dict[str, float], tol: float) -> str:
    return "PASS" if all(e <= tol for e in errs.values()) else "FAIL"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# 1. local_attention per backend
# ----------------------------------------------------------------------------------------------
def check_local(device, dtype, backend: str, mask_name: str, shape: Shape, seed: int = 0) -> Result:
    t0 = time.perf_counter()
    label = backend
    name = f"local {_dname(dtype)} {mask_name} {backend}"
    try:
        q, k, v, dout = make_inputs(shape, dtype, device, seed)
        allow = dense_mask(mask_name, shape.s, device)
        scale = shape.d**-0.5
        resolved = kernels.resolve_backend(backend, q, allow is not None)
        if resolved != backend:
            label = f"{backend}->{resolved}"
        out, lse, dq, dk, dv = _grads(
            lambda a, b_, c: local_attention(a, b_, c, mask=allow, backend=backend), q, k, v, dout
        )
        _sync(device)
        ro, rl, rdq, rdk, rdv = oracle(q, k, v, dout, allow, scale)
        errs = {
            "out": norm_err(out, ro),
            "lse": lse_err(lse, rl),
            "dq": norm_err(dq, rdq),
            "dk": norm_err(dk, rdk),
            "dv": norm_err(dv, rdv),
        }
        if allow is not None:  # rows without keys: exactly zero output
            dead = ~allow.any(-1)
            if bool(dead.any()) and not bool((out[:, dead] == 0).all()):
                errs["dead_rows"] = float("inf")
        tol = TOL[dtype]
        return Result(
            "local",
            f"local {_dname(dtype)} {mask_name} {label} [{shape}]",
            _judge(errs, tol),
            errs,
            tol,
            time.perf_counter() - t0,
        )
    except Exception as e:  # noqa: BLE001 - a crashing backend is a failed check, with its reason
        return Result(
            "local", f"{name} [{shape}]", "ERROR", seconds=time.perf_counter() - t0, note=_exc(e)
        )


# ----------------------------------------------------------------------------------------------
# 2. dist_attention, one process (N = 1)
# ----------------------------------------------------------------------------------------------
def check_dist(
    device, dtype, mask_name: str, shape: Shape, backend: str = "auto", seed: int = 1
) -> Result:
    t0 = time.perf_counter()
    name = f"dist N=1 {_dname(dtype)} {mask_name} {backend} [{shape}]"
    try:
        q, k, v, dout = make_inputs(shape, dtype, device, seed)
        mask = make_mask(mask_name, shape.s)
        out, _, dq, dk, dv = _grads(
            lambda a, b_, c: dist_attention(a, b_, c, None, mask=mask, backend=backend),
            q,
            k,
            v,
            dout,
        )
        _sync(device)
        allow = dense_mask(mask_name, shape.s, device)
        ro, _, rdq, rdk, rdv = oracle(q, k, v, dout, allow, shape.d**-0.5)
        errs = {
            "out": norm_err(out, ro),
            "dq": norm_err(dq, rdq),
            "dk": norm_err(dk, rdk),
            "dv": norm_err(dv, rdv),
        }
        tol = TOL[dtype]
        return Result("dist", name, _judge(errs, tol), errs, tol, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001
        return Result("dist", name, "ERROR", seconds=time.perf_counter() - t0, note=_exc(e))


# ----------------------------------------------------------------------------------------------
# 3. TransformerEngine DotProductAttention as the numerical baseline (CP = 1)
# ----------------------------------------------------------------------------------------------
def _te_attention(te, shape: Shape, mask_name: str, device):
    """A callable ``(q, k, v) -> [b, s, h, d]`` through TE's DotProductAttention (bshd)."""
    te_type = {"full": "no_mask", "causal": "causal", "block_causal": "arbitrary"}[mask_name]
    # softmax scale: TE's default 1/sqrt(kv_channels), the same as ours
    mod = te.DotProductAttention(
        shape.h,
        shape.d,
        num_gqa_groups=shape.hkv,
        attention_dropout=0.0,
        qkv_format="bshd",
        attn_mask_type=te_type,
    ).to(device)
    blocked = None
    if te_type == "arbitrary":  # TE's convention: True = masked OUT
        blocked = ~dense_mask(mask_name, shape.s, device)[None, None]

    def fn(q, k, v):
        kw = {"attention_mask": blocked} if blocked is not None else {}
        out = mod(q, k, v, **kw)  # [b, s, h*d]
        return out.reshape(shape.b, shape.s, shape.h, shape.d)

    return fn


def check_te(te, device, dtype, mask_name: str, shape: Shape, seed: int = 2) -> Result:
    """Ours and TE against the oracle. Our kernel raising or deviating is an ERROR / FAIL of this
    check; only TE raising or deviating (TE refusing a configuration is not our failure) is a WARN."""
    t0 = time.perf_counter()
    name = f"te CP=1 {_dname(dtype)} {mask_name} [{shape}]"
    try:
        q, k, v, dout = make_inputs(shape, dtype, device, seed)
        allow = dense_mask(mask_name, shape.s, device)
        ours = _grads(lambda a, b_, c: local_attention(a, b_, c, mask=allow)[0], q, k, v, dout)
        _sync(device)
        ref = oracle(q, k, v, dout, allow, shape.d**-0.5)
    except Exception as e:  # noqa: BLE001 - our side (inputs, our kernel, the oracle) crashed
        return Result(
            "te", name, "ERROR", seconds=time.perf_counter() - t0, note="ours raised: " + _exc(e)
        )
    keys, idx = ("out", "dq", "dk", "dv"), (0, 2, 3, 4)
    errs = {"ours-vs-oracle": max(norm_err(ours[i], ref[i]) for i in idx)}
    tol = TOL[dtype]
    if errs["ours-vs-oracle"] > tol:
        return Result("te", name, "FAIL", errs, tol, time.perf_counter() - t0)
    try:
        theirs = _grads(_te_attention(te, shape, mask_name, device), q, k, v, dout)
        _sync(device)
    except Exception as e:  # noqa: BLE001 - TE refusing a configuration is not our failure
        return Result(
            "te",
            name,
            "WARN",
            errs,
            tol,
            seconds=time.perf_counter() - t0,
            note="TE raised: " + _exc(e),
        )
    for key, i in zip(keys, idx):  # ours vs TE, absolute
        errs[f"ours-te.{key}"] = float((ours[i].double() - theirs[i].double()).abs().max())
    errs["te-vs-oracle"] = max(norm_err(theirs[i], ref[i]) for i in idx)
    status = "WARN" if errs["te-vs-oracle"] > tol else "PASS"
    return Result(
        "te",
        name,
        status,
        errs,
        tol,
        time.perf_counter() - t0,
        note="TE deviates from the oracle" if status == "WARN" else "",
    )


# ----------------------------------------------------------------------------------------------
# 4. Throughput
# ----------------------------------------------------------------------------------------------
def causal_flops(b, h, s, d, fwd_only=False) -> float:
    f = 2.0 * b * h * s * s * d  # 4*b*h*s^2*d / 2 for causal
    return f if fwd_only else 3.5 * f


def _time(fn: Callable, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def _try_time(fn: Callable, device, warmup: int, iters: int):
    """``(ms or None, why or "")``: out-of-memory and errors become a note, never a crash."""
    try:
        return 1e3 * _time(fn, device, warmup, iters), ""
    except torch.cuda.OutOfMemoryError:
        return None, "out of memory"
    except Exception as e:  # noqa: BLE001
        return None, "error: " + _exc(e)
    finally:
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def _free_bytes(device) -> float:
    if torch.device(device).type != "cuda":
        try:
            return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return float("inf")
    free, _ = torch.cuda.mem_get_info()
    return float(free)


def est_ours_bytes(resolved: str, device, b, h, s, masked: bool, d: int = 128, tile: int = 512):
    """Rough peak bytes of our (fwd, fwd+bwd) beyond the inputs, for today's tiled engine (forward
    and backward both by tile pairs): the dense [s, s] bool mask when one is given, the fp32
    accumulators (out and LSE; dq, dk, dv in the backward) and three tile pairs' fp32 scores per
    (batch, head) at a time (the math backend's explicit ones; the fused kernels' workspace)."""
    mask = float(s * s) if masked else 0.0
    tiles = 3 * 4.0 * b * h * tile * tile
    fwd = mask + 4.0 * b * h * s * (d + 1) + tiles
    bwd = fwd + 3 * 4.0 * b * h * s * d + tiles
    return fwd, bwd


@dataclass
class BenchRow:
    s: int
    entry: str
    fwd_ms: Optional[float] = None
    fb_ms: Optional[float] = None
    note: str = ""


def bench_entries(device, shape: Shape, dtype, math_max_seq: int, te, flash_attn_func, flex):
    """``[(entry, fwd_fn, fb_fn, (fwd_bytes, fb_bytes) or None, note)]``; fns take no arguments."""
    b, s, h, d = shape.b, shape.s, shape.h, shape.d
    q, k, v, dout = make_inputs(shape, dtype, device, 3)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    is_cuda = torch.device(device).type == "cuda"
    entries = []

    qd, kd, vd = (x.detach() for x in (q, k, v))

    def fb(call):  # call(q, k, v) -> [b, s, h, d]
        def run():
            torch.autograd.grad(call(q, k, v), (q, k, v), dout)

        return run

    def fwd(call):  # inputs without requires_grad (some kernels refuse them in forward-only use)
        def run():
            with torch.no_grad():
                call(qd, kd, vd)

        return run

    # the fused kernels themselves, for reference (first: they are cheap and anchor the ratios)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [b, s, h, d] <-> [b, h, s, d]
    call = lambda q_, k_, v_: t(
        torch.nn.functional.scaled_dot_product_attention(t(q_), t(k_), t(v_), is_causal=True)
    )
    entries.append(("torch SDPA is_causal", fwd(call), fb(call), None, ""))
    if flex is not None:
        flex_attention, create_block_mask = flex
        try:
            bm = create_block_mask(lambda bb, hh, qi, ki: ki <= qi, None, None, s, s, device=device)
            fx = torch.compile(flex_attention) if is_cuda else flex_attention
            call = lambda q_, k_, v_: t(fx(t(q_), t(k_), t(v_), block_mask=bm))
            entries.append(
                (
                    "FlexAttention causal" + (" (compiled)" if is_cuda else " (eager)"),
                    fwd(call),
                    fb(call),
                    None,
                    "",
                )
            )
        except Exception as e:  # noqa: BLE001
            entries.append(("FlexAttention causal", None, None, None, "error: " + _exc(e)))
    if flash_attn_func is not None and is_cuda and dtype in (torch.float16, torch.bfloat16):
        call = lambda q_, k_, v_: flash_attn_func(q_, k_, v_, causal=True)
        entries.append(("flash_attn_func causal", fwd(call), fb(call), None, ""))
    if te is not None and is_cuda:
        try:
            mod = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal").to(
                device
            )
            call = lambda q_, k_, v_: mod(q_, k_, v_).reshape(b, s, h, d)
            entries.append(("TE DotProductAttention causal", fwd(call), fb(call), None, ""))
        except Exception as e:  # noqa: BLE001
            entries.append(("TE DotProductAttention causal", None, None, None, "error: " + _exc(e)))

    # ours: local_attention per backend (dense causal mask), and dist_attention N=1
    allow = torch.ones(s, s, dtype=torch.bool, device=device).tril_()
    for be in our_backends():
        resolved = kernels.resolve_backend(be, q, True)
        label = f"ours local[{be}]" + (f"->{resolved}" if resolved != be else "")
        est = est_ours_bytes(resolved, device, b, h, s, True, d)
        note = ""
        if resolved == "math" and s > math_max_seq:
            entries.append(
                (
                    label,
                    None,
                    None,
                    None,
                    f"math capped at s <= {math_max_seq} (one call per tile pair: slow)",
                )
            )
            continue
        call = lambda q_, k_, v_, be=be: local_attention(q_, k_, v_, mask=allow, backend=be)[0]
        entries.append((label, fwd(call), fb(call), est, note))
    resolved = kernels.resolve_backend("auto", q, True)
    call = lambda q_, k_, v_: dist_attention(q_, k_, v_, None, mask=masks.causal())
    entries.append(
        (
            f"ours dist_attention N=1 (auto->{resolved})",
            fwd(call),
            fb(call),
            est_ours_bytes(resolved, device, b, h, s, False, d),
            "",
        )
    )
    return entries


def run_bench(
    device,
    shapes: Sequence[Shape],
    dtype,
    deadline: float,
    math_max_seq: int,
    warmup: int,
    iters: int,
    te,
    flash_attn_func,
    flex,
) -> List[BenchRow]:
    """Reference kernels at every length first, then ours: a tight budget still gives the table its
    anchors. Each entry is timed only if the deadline has not passed and its memory estimate fits."""
    rows: List[BenchRow] = []
    todo = []
    for shape in shapes:
        try:
            entries = bench_entries(device, shape, dtype, math_max_seq, te, flash_attn_func, flex)
        except Exception as e:  # noqa: BLE001
            rows.append(BenchRow(shape.s, "(setup)", note="error: " + _exc(e)))
            continue
        todo += [
            (0 if label.startswith("ours") else -1, shape.s, label, *rest)
            for label, *rest in entries
        ]
    todo.sort(key=lambda e: e[0])  # stable: references (-1) before ours (0), lengths in order
    for _, s, label, fwd_fn, fb_fn, est, note in todo:
        row = BenchRow(s, label, note=note)
        rows.append(row)
        if fwd_fn is None:
            continue
        if time.perf_counter() > deadline:
            row.note = "not run (time budget)"
            continue
        free = 0.7 * _free_bytes(device)
        notes = [note] if note else []
        if est is not None and est[0] > free:
            row.note = "; ".join(
                notes + [f"SKIPPED: needs ~{est[0] / 2**30:.0f} GiB, {free / 2**30:.0f} GiB usable"]
            )
            continue
        if est is None or est[1] <= free:
            ms, why = _try_time(fb_fn, device, warmup, iters)
            row.fb_ms = ms
            if why:
                notes.append("fwd+bwd " + why)
        else:
            notes.append(
                f"fwd+bwd SKIPPED: needs ~{est[1] / 2**30:.0f} GiB, {free / 2**30:.0f} GiB usable"
            )
        if time.perf_counter() <= deadline:
            ms, why = _try_time(fwd_fn, device, warmup if row.fb_ms is None else 0, iters)
            row.fwd_ms = ms
            if why:
                notes.append("fwd " + why)
        row.note = "; ".join(notes)
    del todo
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_bench(rows: List[BenchRow], shapes: Sequence[Shape]) -> None:
    by_s = {sh.s: sh for sh in shapes}
    print(
        f"  {'s':>6}  {'entry':<44} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8} {'x fastest':>9}  note"
    )
    for s in sorted({r.s for r in rows}):
        sub = [r for r in rows if r.s == s]
        sh = by_s[s]
        best = min((r.fb_ms for r in sub if r.fb_ms), default=None)
        for r in sub:
            tflops = (
                (causal_flops(sh.b, sh.h, s, sh.d) / (r.fb_ms * 1e-3) / 1e12) if r.fb_ms else None
            )
            ratio = r.fb_ms / best if (r.fb_ms and best) else None
            f = lambda x, fmt: format(x, fmt) if x is not None else "-"  # noqa: E731
            print(
                f"  {s:>6}  {r.entry:<44} {f(r.fwd_ms, '9.2f'):>9} {f(r.fb_ms, '11.2f'):>11} "
                f"{f(tflops, '8.3g'):>8} {f(ratio, '9.2f'):>9}  {r.note[:160]}"
            )


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------
def _dname(dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _exc(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"


def correctness_cases(
    sections: Sequence[str], small: bool, dtypes: Sequence, backends: Sequence[str], te_ok: bool
):
    """Ordered ``(section, thunk_args)``; the most informative cases come first within a section."""
    main, ragged = SHAPES["small" if small else "full"]
    cases = []
    if "local" in sections:
        # Tiers, so that a tight budget still covers every backend: first dtype, second dtype,
        # the ragged length (tile padding and alignment paths), then the remaining dtypes.
        tiers = [[(dt, be, m, main) for m in LOCAL_MASKS for be in backends] for dt in dtypes]
        ragged_tier = [
            (dtypes[0], be, m, ragged) for m in ("causal", "predicate") for be in backends
        ]
        tiers.insert(min(2, len(tiers)), ragged_tier)
        cases += [("local", args) for tier in tiers for args in tier]
    if "dist" in sections:
        for dt in dtypes[:2]:
            for m in DIST_MASKS:
                cases.append(("dist", (dt, m, main)))
        cases.append(("dist", (dtypes[0], "causal", ragged)))
        cases.append(("dist", (dtypes[0], "predicate", ragged)))
    if "te" in sections and te_ok:
        for dt in [d for d in dtypes if d in (torch.bfloat16, torch.float16)]:
            for m in TE_MASKS:
                cases.append(("te", (dt, m, main)))
    return cases


def run_correctness(
    device,
    small: bool,
    sections: Sequence[str],
    t_start: float,
    budget: float,
    te=None,
    dtypes: Optional[Sequence] = None,
    verbose: bool = True,
) -> List[Result]:
    dtypes = list(dtypes or (torch.bfloat16, torch.float32, torch.float16))
    backends = our_backends()
    results: List[Result] = []
    current = None
    for section, args in correctness_cases(sections, small, dtypes, backends, te is not None):
        if section != current:
            current = section
            if verbose:
                print(f"== {section} ==", flush=True)
                if section == "te":
                    print(
                        "  TE's a2a+p2p context parallelism needs several GPUs (this machine: "
                        f"{torch.cuda.device_count()}); TE is compared at CP=1 on one GPU.",
                        flush=True,
                    )
        if time.perf_counter() > t_start + SHARE[section] * budget:
            what = " ".join(_dname(a) if isinstance(a, torch.dtype) else str(a) for a in args)
            r = Result(section, f"{section} {what}", "SKIP", note="not run (time budget)")
        elif section == "local":
            r = check_local(device, *args)
        elif section == "dist":
            r = check_dist(device, *args)
        else:
            r = check_te(te, device, *args)
        results.append(r)
        if verbose and r.status != "SKIP":
            print(r.line(), flush=True)
    if verbose:
        skipped = [r for r in results if r.status == "SKIP"]
        if skipped:
            print(
                f"  {len(skipped)} cases not run (time budget), e.g. {skipped[0].name}", flush=True
            )
    return results


def summarize(results: List[Result]) -> Tuple[bool, str]:
    checked = [r for r in results if r.status in ("PASS", "FAIL", "ERROR")]
    bad = [r for r in checked if r.status != "PASS"]
    warn = [r for r in results if r.status == "WARN"]
    skipped = [r for r in results if r.status == "SKIP"]
    worst: Dict[str, float] = {}
    for r in checked:
        if r.status == "PASS" and r.section in ("local", "dist"):
            key = r.name.split()[1] if r.section == "local" else r.name.split()[2]
            worst[key] = max(worst.get(key, 0.0), max(r.errors.values(), default=0.0))
    ws = ", ".join(f"{k} {v:.1e}<={TOL[DTYPES[k]]:.1e}" for k, v in worst.items())
    extra = f"; {len(warn)} TE warnings" if warn else ""
    extra += f"; {len(skipped)} not run (time budget)" if skipped else ""
    if not results:
        return True, "gpu_attention: DONE - no correctness section requested" + extra
    if not checked:
        return False, "gpu_attention: FAIL - no correctness check ran" + extra
    if bad:
        names = "; ".join(
            f"{r.name}: "
            + (
                r.note[:90]
                if r.note
                else " ".join(f"{k}={v:.1e}" for k, v in r.errors.items() if v > r.tol)
            )
            for r in bad[:3]
        ) + ("; ..." if len(bad) > 3 else "")
        return (
            False,
            f"gpu_attention: FAIL - {len(bad)} of {len(checked)} checks failed ({names})" + extra,
        )
    return (
        True,
        f"gpu_attention: PASS - {len(checked)} checks against the float64 oracle (worst: {ws})"
        + extra,
    )


def bench_verdict(rows: List[BenchRow], ok: bool, line: str) -> Tuple[bool, str]:
    """Our own kernels raising in the throughput section fail the run (out-of-memory and the
    budget are notes); a reference kernel raising stays a note."""
    bad = [
        r
        for r in rows
        if (r.entry.startswith("ours") or r.entry == "(setup)") and "error:" in r.note
    ]
    if not bad:
        return ok, line
    names = "; ".join(f"{r.entry} s={r.s}: {r.note[:90]}" for r in bad[:3])
    return False, f"gpu_attention: FAIL - our kernels raised in the bench ({names})" + (
        "" if ok else f" | {line}"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--small", action="store_true", help="tiny sizes (CPU-friendly); also for a quick GPU run"
    )
    p.add_argument(
        "--budget", type=float, default=110.0, help="seconds for all sections (default 110)"
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument(
        "--seqs", default=None, help="bench sequence lengths (default 8192,32768; small 128,256)"
    )
    p.add_argument(
        "--math-max-seq", type=int, default=8192, help="cap of the math backend in the bench"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections ({bad}) must be among {SECTIONS}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_attention: SKIPPED - no CUDA device (torch %s sees none); run with --device cpu "
            "--small to exercise the checks on CPU" % torch.__version__,
            flush=True,
        )
        return 3
    t_start = time.perf_counter()
    faulthandler.dump_traceback_later(
        args.budget + 20, exit=True
    )  # a hung kernel still ends the run
    threads = torch.get_num_threads()
    if args.device == "cpu" and args.small:
        torch.set_num_threads(1)  # tiny tensors: threads only add contention
    try:
        return _run(args, t_start)
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)


def _run(args, t_start: float) -> int:
    device = torch.device(args.device)
    te, te_v = _try_import("te") if device.type == "cuda" else (None, "not used on CPU")
    fa, fa_v = _try_import("flash_attn")
    flex, flex_v = _try_import("flex")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        print(
            f"gpu_attention: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}",
            flush=True,
        )
        try:  # room for the dtype / mask / shape variants of the compiled FlexAttention
            cfg = torch._dynamo.config
            for key in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, key):
                    setattr(cfg, key, max(int(getattr(cfg, key)), 32))
        except Exception:  # noqa: BLE001
            pass
    else:
        warnings.filterwarnings("ignore", message=r".*flex_attention called without torch\.compile")
        print(
            f"gpu_attention: CPU mode ({'small' if args.small else 'full'} sizes), torch {torch.__version__}",
            flush=True,
        )
    print(
        f"  our backends: {our_backends()}; flash-attn {fa_v}; TransformerEngine {te_v}; "
        f"flex {'yes' if flex else flex_v}; budget {args.budget:.0f}s",
        flush=True,
    )

    results = run_correctness(device, args.small, args.sections, t_start, args.budget, te=te)
    if "te" in args.sections and te is None:
        print(f"== te ==\n  SKIP  TransformerEngine {te_v}", flush=True)

    bench_rows: List[BenchRow] = []
    if "bench" in args.sections:
        seqs = [
            int(x) for x in (args.seqs or ("128,256" if args.small else "8192,32768")).split(",")
        ]
        h, d = (2, 32) if args.small else (16, 128)
        shapes = [Shape(1, s, h, h, d) for s in seqs]
        print(
            f"== bench: fwd / fwd+bwd, b=1 h={h} d={d} bf16 causal, warm-up {args.warmup}, "
            f"{args.iters} iters ==",
            flush=True,
        )
        bench_rows = run_bench(
            device,
            shapes,
            torch.bfloat16,
            t_start + args.budget,
            args.math_max_seq,
            args.warmup,
            args.iters,
            te,
            fa if device.type == "cuda" else None,
            flex,
        )
        print_bench(bench_rows, shapes)

    ok, line = summarize(results)
    ok, line = bench_verdict(bench_rows, ok, line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ok": ok,
                    "summary": line,
                    "results": [asdict(r) for r in results],
                    "bench": [asdict(r) for r in bench_rows],
                },
                f,
                indent=1,
                default=str,
            )
    print(f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - an unexpected crash is a failure with its traceback
        traceback.print_exc()
        print("gpu_attention: FAIL - the script crashed (traceback above)", flush=True)
        sys.exit(1)
