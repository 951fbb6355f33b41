"""benchmarks/mixed_lengths.py does not rot: the script as documented, at a tiny size (about 30 s),
prints its four methods, and the deterministic columns hold: our placement pads nothing and sends
fewer ring K/V bytes (tracer counts) than FFD packing split zigzag over the whole CP group."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mixed_lengths_benchmark_runs_at_a_tiny_size():
    cmd = [sys.executable, "benchmarks/mixed_lengths.py", "--clips", "8", "--budget", "4096"]
    proc = subprocess.run(
        cmd + ["--iters", "1", "--width", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\((\w)\) .*?\s(\d+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)%\s+([\d,]+)\s", line)
        if m:
            rows[m[1]] = dict(pad=float(m[4]), ring=int(m[6].replace(",", "")))
    assert set(rows) == set("abcd"), proc.stdout
    assert rows["d"]["pad"] == 0.0 and rows["a"]["pad"] > 0
    assert rows["d"]["ring"] < rows["c"]["ring"]
    assert "ours vs (c)" in proc.stdout and "placement U2xR2" in proc.stdout
