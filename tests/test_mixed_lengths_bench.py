"""benchmarks/mixed_lengths.py does not rot: the script as documented, at a tiny size (about 30 s),
prints its four methods, and the deterministic columns hold: our placement pads nothing and sends
fewer ring K/V bytes (tracer counts) than FFD packing split zigzag over the whole CP group."""

import re

import pytest

from megatron_video.testing.scripts import run_script


@pytest.mark.process_launch
def test_mixed_lengths_benchmark_runs_at_a_tiny_size():
    args = ("--clips", "8", "--budget", "4096", "--iters", "1", "--width", "32")
    out = run_script("benchmarks/mixed_lengths.py", *args)
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\((\w)\) .*?\s(\d+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)%\s+([\d,]+)\s", line)
        if m:
            rows[m[1]] = dict(pad=float(m[4]), ring=int(m[6].replace(",", "")))
    assert set(rows) == set("abcd"), out
    assert rows["d"]["pad"] == 0.0 and rows["a"]["pad"] > 0
    assert rows["d"]["ring"] < rows["c"]["ring"]
    assert "ours vs (c)" in out and "placement U2xR2" in out
