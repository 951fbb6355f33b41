"""Every .cu file compiles with nvcc for sm_90 (and sm_80, the container's other target), and the
CUDA half of the bindings passes a syntax check against torch's headers. Compile-only: nothing
CUDA runs here. Skipped only when nvcc (the CUDA toolkit) is absent."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(
    NVCC is None,
    reason="nvcc not found on PATH (no CUDA toolkit): .cu files cannot be compile-checked here",
)


def cuda_include() -> Path | None:
    """The toolkit's include dir (nvcc may be a wrapper script, so try the usual homes too)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        homes.append(str(Path(os.path.realpath(NVCC)).parents[1]))
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    return None


def test_there_are_cuda_sources():
    assert {p.name for p in CU_FILES} >= {"halo_cuda.cu", "masks_cuda.cu"}


@pytest.mark.process_launch
@needs_nvcc
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_for_sm90(source, tmp_path):
    obj = tmp_path / (source.stem + ".o")
    cmd = [
        NVCC,
        "-c",
        "-std=c++17",
        "-O3",
        "--Werror",
        "all-warnings",
        "-I",
        str(CSRC),
        "-gencode",
        "arch=compute_90,code=sm_90",
        "-gencode",
        "arch=compute_80,code=sm_80",
        str(source),
        "-o",
        str(obj),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert obj.stat().st_size > 0


@pytest.mark.process_launch
@needs_nvcc
def test_bindings_cuda_path_syntax(tmp_path):
    """bindings.cpp with MEGATRON_VIDEO_WITH_CUDA: the CUDA dispatch code a CPU build never compiles."""
    include = cuda_include()
    if include is None:
        pytest.skip(
            "nvcc found but no CUDA include dir (cuda_runtime_api.h) to check the bindings against"
        )
    torch_includes = cpp_extension.include_paths()
    # CPU wheels omit the CMake-generated c10/cuda/impl/cuda_cmake_macros.h; supply its one define.
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in torch_includes):
        shim = tmp_path / "c10" / "cuda" / "impl"
        shim.mkdir(parents=True)
        (shim / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
        )
    cmd = [
        "g++",
        "-std=c++20",
        "-fsyntax-only",
        "-Wall",
        "-Werror",
        "-Wno-unused-function",
        "-DMEGATRON_VIDEO_WITH_CUDA=1",
        "-DTORCH_EXTENSION_NAME=_C",
        f"-I{tmp_path}",
        f"-I{CSRC}",
        f"-I{include}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    cmd += [f"-isystem{p}" for p in torch_includes]
    done = subprocess.run(
        cmd + [str(CSRC / "bindings.cpp")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_gpu_check_script_parses():
    done = subprocess.run(
        ["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
