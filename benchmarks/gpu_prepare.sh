#!/usr/bin/env bash
# Before a GPU loan, HERE (with network): download the cp312 wheels the GPU check installs on the
# bare GPU machine (benchmarks/gpu_wheels.txt; never torch) into .gpu_wheels/ (git-ignored). Carry
# .gpu_wheels to the GPU machine with the working tree; `bash benchmarks/gpu_check.sh env` there
# installs them with pip --no-index --no-deps --target .gpu_site.
# Usage: bash benchmarks/gpu_prepare.sh          (PYTHON=/path/to/python to choose the pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .gpu_wheels
"$PY" -m pip download --no-deps --only-binary=:all: --dest .gpu_wheels \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -r benchmarks/gpu_wheels.txt
ls -l .gpu_wheels
echo "gpu_prepare: $(ls .gpu_wheels/*.whl | wc -l) wheels in .gpu_wheels/ ($(du -sh .gpu_wheels | cut -f1))"
