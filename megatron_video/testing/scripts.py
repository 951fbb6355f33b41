"""Run a repository script as documented (e.g. a benchmark's smoke test): its own process, one
thread per rank, the checkout on ``PYTHONPATH``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["run_script"]

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str, timeout: int = 600) -> str:
    """``python script args`` from the repository root; its stdout, or ``AssertionError`` with
    the output's tail when it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
