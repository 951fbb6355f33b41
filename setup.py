"""megatron_video: long-video parallelism for Megatron-Core.

The C++ extension (``megatron_video._C``) is optional: it is built from ``csrc/`` when a compiler is
available (CPU kernels always; CUDA kernels only when torch has CUDA and ``nvcc`` is found). Set
``MEGATRON_VIDEO_BUILD_EXT=0`` to skip it; the package then uses its pure-PyTorch references.
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    if os.environ.get("MEGATRON_VIDEO_BUILD_EXT", "1") == "0":
        return [], {}
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not cpp:
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    use_cuda = bool(cu) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if os.environ.get("MEGATRON_VIDEO_BUILD_CUDA") == "0":
        use_cuda = False
    # torch's builder adds the C++ standard it was built with (C++20 for torch 2.13); -fopenmp makes
    # at::parallel_for run on torch's OpenMP pool.
    cxx = ["-O3"]
    if use_cuda:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch)
        ext = cpp_extension.CUDAExtension(
            "megatron_video._C",
            cpp + cu,
            define_macros=[("MEGATRON_VIDEO_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx + ["-fopenmp"], "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "megatron_video._C",
            cpp,
            extra_compile_args=cxx + ["-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron_video",
    version="0.1.0",
    description=(
        "Megatron-Core extension for long-video training: 2D attention, Balanced SP, "
        "ST-DiT hybrid CP/DP"
    ),
    packages=find_packages(include=["megatron_video", "megatron_video.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "einops",
        "psutil",
        "numpy",
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        "train": ["pillow", "matplotlib", "tensorboard", "webdataset"],
        "test": ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": ["megatron-video=megatron_video.training.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
