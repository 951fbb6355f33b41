"""The tiled attention engine on a GPU: float64-oracle parity, then memory and throughput.

1. Parity: ``dist_attention`` (one process) with each CUDA engine backend (``flex``: FlexAttention
   with the C++ tile status as ``BlockMask``, compiled, its backward recomputing the block; ``sdpa``:
   torch's flash / memory-efficient kernels with the global out/LSE in backward) in fp32 and bf16,
   causal / block-causal / teacher-forcing / packed-causal masks; outputs and dq/dk/dv against a
   float64 oracle. Any exception or error above tolerance fails the script (exit 1).
2. Memory and throughput (causal, fwd+bwd): peak CUDA memory growth as a multiple of q and time, for
   the engine and for torch SDPA (``is_causal=True``) at the same S.

Run on a GPU machine (``bash benchmarks/gpu_check.sh engine``); ``--device cpu`` runs the parity
part at S = 256 (flex through torch's flex math path) and reports memory / throughput SKIPPED.
Exit status 0 PASS, 1 FAIL, 3 SKIPPED (no CUDA device).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.attention import dist_attention, masks  # noqa: E402
from megatron_video.diffusion.teacher_forcing import TeacherForcingMask  # noqa: E402
from megatron_video.layouts import BalancedSPLayout  # noqa: E402


def _mask(kind, S):
    if kind == "causal":
        return masks.causal()
    if kind == "block_causal":
        return masks.block_causal(S // 8)
    if kind == "packed_causal":
        return masks.packed([0, S // 5, S // 2, S - 7], inner=masks.causal())
    lay = BalancedSPLayout(
        num_latent_frames=8, tokens_per_frame=S // 16, frames_per_block=2, sp_size=1
    )
    return TeacherForcingMask(lay)


def _oracle(q, k, v, allow, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    dead = ~allow.any(-1)
    s = s.masked_fill(~allow, float("-inf")).masked_fill(dead[:, None], 0.0)
    p = torch.softmax(s, -1) * (~dead)[:, None].to(s.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (out * dout.to(out.dtype)).sum().backward()
    return [x.detach().double().cpu() for x in (out, q.grad, k.grad, v.grad)]


def parity(device="cuda", S=1024, H=4, D=64) -> tuple:
    """``(passed, failed)`` counts; every case prints one line."""
    passed = failed = 0
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    ids = torch.arange(S)
    for kind in ("causal", "block_causal", "teacher_forcing", "packed_causal"):
        mask = _mask(kind, S)
        allow = mask.dense(ids, ids)
        ref = _grads(lambda a, b, c: _oracle(a, b, c, allow, D**-0.5), q, k, v, dout)
        for backend in ("flex", "sdpa"):
            for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2)):
                try:
                    got = _grads(
                        lambda a, b, c: dist_attention(a, b, c, None, mask=mask, backend=backend),
                        *(x.to(device, dtype) for x in (q, k, v)),
                        dout.to(device),
                    )
                    err = max(
                        float((g_ - r).abs().max() / max(1.0, float(r.abs().max())))
                        for g_, r in zip(got, ref)
                    )
                    status = "PASS" if err < tol else "FAIL"
                except Exception as exc:  # our code raising is a failure, never a warning
                    err, status = float("nan"), f"FAIL ({type(exc).__name__}: {exc})"
                passed += status == "PASS"
                failed += status != "PASS"
                print(
                    f"  {status[:4]:<5} parity {kind:<16}{backend:<6}{str(dtype):<16} "
                    f"max rel err {err:9.2e}{status[4:]}",
                    flush=True,
                )
    return passed, failed


def memory(seqs, H=8, D=64):
    print(f"causal fwd+bwd, bf16, H={H} D={D}: peak CUDA memory growth (multiple of q) and time")
    for S in seqs:
        row = [f"S={S:>6}"]
        for name in ("engine", "torch sdpa"):
            q, k, v = (
                torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            qbytes = q.numel() * q.element_size()
            fn = (
                (lambda q=q, k=k, v=v: dist_attention(q, k, v, None, mask=masks.causal()))
                if name == "engine"
                else (
                    lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                    )
                )
            )
            fn().sum().backward()  # warm-up / compile
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn().sum().backward()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() - base
            row.append(f"{name}: {peak / qbytes:5.1f}x q, {dt * 1e3:7.1f} ms")
            del q, k, v, fn
        print("   ".join(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seqs", default="8192,16384,32768,65536")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_engine: SKIPPED - torch sees no CUDA device", flush=True)
        sys.exit(3)
    cpu = a.device == "cpu"  # flex on CPU: torch's flex math path (the documented check path)
    print("== parity: dist_attention (flex / sdpa, fp32 / bf16) vs float64 ==", flush=True)
    passed, failed = parity(a.device, S=256 if cpu else 1024, D=16 if cpu else 64)
    if cpu:
        print("  SKIPPED memory and throughput: needs a GPU (CUDA peak memory)", flush=True)
    else:
        memory([int(s) for s in a.seqs.split(",")])
    verdict = "FAIL" if failed or not passed else "PASS"
    print(f"gpu_engine: {verdict} - {passed} parity checks passed, {failed} failed", flush=True)
    sys.exit(1 if verdict == "FAIL" else 0)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
