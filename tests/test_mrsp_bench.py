"""benchmarks/mrsp.py does not rot: at a tiny size it prints both tables, and the deterministic
columns hold: the cached step calls the encoder once, the re-encoded one ``1 + 2 G`` times, and
a CP 4 rank holds less of the step's memory than a CP 1 rank; the KV-cache rollout gives the
recomputed one's tokens."""

import re

import pytest

from megatron_video.testing.scripts import run_script


@pytest.mark.process_launch
def test_mrsp_benchmark_runs_at_a_tiny_size():
    args = ("--frames", "8", "--group", "2", "--mem-frames", "16", "--iters", "1")
    args += ("--decode-tokens", "3")
    out = run_script("benchmarks/mrsp.py", *args)
    row = re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+1 vs 5\s", out, re.M)
    assert row, out
    mem = re.search(r"^\s+16\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", out, re.M)
    assert mem and float(mem[2]) < float(mem[1]), out
    dec = re.search(r"^\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+yes$", out, re.M)
    assert dec, out  # the KV-cache rollout samples the recomputed one's tokens
