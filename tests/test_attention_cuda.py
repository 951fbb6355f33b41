"""Attention on CUDA against the float64 oracle: every local backend, dist_attention (N=1), and
TransformerEngine as a baseline. The checks live in benchmarks/gpu_attention.py (which
benchmarks/gpu_check.sh runs); these tests drive the same functions case by case.

Every test but the last needs a GPU and is skipped without one. The last one runs the script's
CPU mode (``--device cpu --small``) so the checking logic itself is exercised on any machine.
"""

import importlib.util
import os
import sys
import time

import pytest
import torch

_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gpu_attention.py"
)
_spec = importlib.util.spec_from_file_location("gpu_attention", _PATH)
ga = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_attention", ga)
_spec.loader.exec_module(ga)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="needs a CUDA device (torch.cuda.is_available() is "
    "False); run benchmarks/gpu_check.sh on a GPU machine",
)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MAIN, RAGGED = ga.SHAPES["full"]


def _require_backend(backend):
    if backend not in ga.our_backends():
        pytest.skip(f"backend {backend!r} is not available here ({ga.our_backends()})")


def _assert_ok(r):
    assert r.status == "PASS", r.line()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", ga.LOCAL_MASKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["math", "sdpa", "flex", "flash_attn"])
def test_local_attention_cuda_matches_oracle(backend, dtype, mask):
    """Output, LSE (-inf on rows without keys), dq, dk, dv; GQA; no NaN."""
    _require_backend(backend)
    _assert_ok(ga.check_local("cuda", dtype, backend, mask, MAIN))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", ["causal", "predicate"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "flex", "flash_attn"])
def test_local_attention_cuda_ragged_length(backend, mask):
    """A sequence length that is not a multiple of the kernels' tile sizes."""
    _require_backend(backend)
    _assert_ok(ga.check_local("cuda", torch.bfloat16, backend, mask, RAGGED))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", ga.DIST_MASKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dist_attention_cuda_single_process(dtype, mask):
    """dist_attention(q, k, v, groups=None, mask=...) on CUDA tensors, forward and backward."""
    _assert_ok(ga.check_dist("cuda", dtype, mask, MAIN))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mask", ga.TE_MASKS)
def test_transformer_engine_baseline_cuda(mask):
    """TE DotProductAttention at CP=1 on the same inputs (its a2a+p2p CP needs several GPUs).

    Ours must match the oracle; TE's own deviation is reported, not asserted.
    """
    te, why = ga._try_import("te")
    if te is None:
        pytest.skip(f"TransformerEngine {why}")
    r = ga.check_te(te, "cuda", torch.bfloat16, mask, MAIN)
    print(r.line())
    assert r.status in ("PASS", "WARN"), r.line()


def test_cpu_small_mode_correctness(monkeypatch, capsys):
    """The script's logic on CPU (tiny sizes): without CUDA the default run says SKIPPED (exit 3,
    never a pass); ``--device cpu --small`` local and dist checks all pass against the oracle."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ga.main([]) == 3
    assert "gpu_attention: SKIPPED - no CUDA device" in capsys.readouterr().out
    monkeypatch.undo()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is several times faster on a shared machine
    try:
        t0 = time.perf_counter()
        results = ga.run_correctness(
            "cpu",
            True,
            ("local", "dist"),
            t0,
            budget=60.0,
            dtypes=(torch.bfloat16, torch.float32),
            verbose=False,
        )
    finally:
        torch.set_num_threads(threads)
    bad = [r.line() for r in results if r.status not in ("PASS",)]
    assert not bad, "\n".join(bad)
    assert {r.section for r in results} == {"local", "dist"}
    assert len(results) >= 40
    ok, line = ga.summarize(results)
    assert ok and line.startswith("gpu_attention: PASS"), line


def test_check_fails_when_our_code_raises(monkeypatch, capfd):
    """The GPU check cannot pass while our code raises (checked on CPU with tiny shapes): our kernel
    raising in the TE comparison is an ERROR (only TE raising is a WARN), the whole script exits 1,
    and our entries raising in the bench fail the run."""
    shape = ga.Shape(1, 16, 2, 2, 8)

    class BrokenTE:  # TE itself raising: informative only
        pytorch = None

    r = ga.check_te(BrokenTE(), "cpu", torch.float32, "causal", shape)
    assert r.status == "WARN" and "TE raised" in r.note, r.line()

    def broken(*a, **k):
        raise RuntimeError("our kernel is broken")

    monkeypatch.setattr(ga, "local_attention", broken)
    r = ga.check_te(BrokenTE(), "cpu", torch.float32, "causal", shape)
    assert r.status == "ERROR" and "our kernel is broken" in r.note, r.line()
    ok, line = ga.summarize([r])
    assert not ok and line.startswith("gpu_attention: FAIL"), line
    assert ga.main(["--device", "cpu", "--small", "--sections", "local", "--budget", "30"]) == 1
    assert "gpu_attention: FAIL" in capfd.readouterr().out
    rows = [
        ga.BenchRow(128, "ours local[math]", note="fwd+bwd error: RuntimeError: boom"),
        ga.BenchRow(128, "torch SDPA causal", note="fwd error: RuntimeError: not ours"),
    ]
    ok, line = ga.bench_verdict(rows, True, "gpu_attention: PASS - ...")
    assert not ok and "ours local[math]" in line and "not ours" not in line
    assert ga.bench_verdict(rows[1:], True, "x") == (True, "x")
