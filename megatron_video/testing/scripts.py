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
    the output's tail when it exits non-zero or prints a warning (scripts hold the known
    environment warnings back, ``training.console.quiet_script``)."""
    proc = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "Warning: " in line]
    assert not warned, f"{script} printed warnings:\n" + "\n".join(warned)
    return proc.stdout
