"""``benchmarks/gpu_check.sh`` runs as written where the GPU machine differs from CI: every section,
``--device cpu``, with ``megatron`` import-blocked (a ``sitecustomize`` meta-path blocker, as on a
machine without megatron-core), each within the time a command is allowed; what needs a GPU says
SKIPPED, never PASS."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_video.testing.doc_blocks import launch_blocks

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SECTION_LIMIT_S = 240  # a command on the GPU machine may run ~4 minutes

BLOCKER = """
import importlib.abc, sys

class _NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"{name} is blocked: the GPU machine has no megatron-core")

sys.meta_path.insert(0, _NoMegatron())
"""


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("no_megatron")
    (d / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=f"{d}{os.pathsep}{ROOT}")
    env.pop("MEGATRON_LM", None)
    return env


def test_the_blocker_blocks(blocked_env):
    r = subprocess.run(
        [sys.executable, "-c", "import megatron.core"], env=blocked_env, capture_output=True
    )
    assert r.returncode != 0 and b"blocked" in r.stderr


def _documented_sections():
    """The sections docs/benchmarks.md tells a GPU session to run, in its order."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        blocks = launch_blocks(f.read())
    assert blocks["gpu-prepare"] == ["bash", "benchmarks/gpu_prepare.sh"]
    tokens = blocks["gpu-check"]
    assert tokens[:2] == ["bash", "benchmarks/gpu_check.sh"]
    return [t for t in tokens if t not in ("bash", "benchmarks/gpu_check.sh")]


def test_every_documented_section_runs_on_cpu_without_megatron(blocked_env):
    sections = _documented_sections()
    assert sections == ["env", "attention", "engine", "build", "ops"]
    t0 = time.perf_counter()
    r = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--device", "cpu", *sections, "pretrain"],
        cwd=ROOT,
        env=blocked_env,
        capture_output=True,
        text=True,
        timeout=6 * SECTION_LIMIT_S,
    )
    log = r.stdout + r.stderr
    verdicts = dict(re.findall(r"^gpu_check (\w+): (PASS|FAIL|SKIPPED)", log, re.M))
    assert verdicts == {
        "env": "PASS",
        "attention": "PASS",
        "engine": "PASS",
        "build": "SKIPPED",
        "ops": "SKIPPED",
        "pretrain": "SKIPPED",
    }, log[-4000:]
    assert r.returncode == 3, log[-2000:]  # something SKIPPED: never reported as a pass
    assert "megatron-core not imported" in log
    assert "gpu_engine: PASS - 16 parity checks passed, 0 failed" in log
    table = re.findall(r"^  (\w+) +(yes|to time) +(PASS|SKIPPED.*) \[(\d+)s\]$", log, re.M)
    assert [row[0] for row in table] == [*sections, "pretrain"], log[-2000:]
    assert {row[0]: row[1] for row in table}["build"] == "yes"  # the table says what needs a GPU
    for s, _, _, secs in table:
        assert int(secs) < SECTION_LIMIT_S, f"section {s} took {secs}s"
    assert time.perf_counter() - t0 < 6 * SECTION_LIMIT_S


def test_ops_bench_vae_strides_agree_with_the_model():
    import importlib.util

    from megatron_video.models.vae import SPATIAL_STRIDE, TEMPORAL_STRIDE

    spec = importlib.util.spec_from_file_location(
        "ops_bench", os.path.join(ROOT, "benchmarks", "ops.py")
    )
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    assert (ops.VAE_TEMPORAL_STRIDE, ops.VAE_SPATIAL_STRIDE) == (TEMPORAL_STRIDE, SPATIAL_STRIDE)
