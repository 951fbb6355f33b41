#!/usr/bin/env bash
# GPU check, one command on a CUDA machine (about 4-8 minutes):
#   1. builds megatron_video._C with its CUDA kernels for this GPU's architecture (in place);
#   2. runs the CUDA op tests (tests/test_ops_cuda.py) against the pure-PyTorch references;
#   3. prints halo-scatter bandwidth against a plain device copy, and mask-construction throughput.
# Usage: bash benchmarks/gpu_check.sh          (PYTHON=/path/to/python to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
SECONDS=0

"$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

ARCH="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")"
echo "== 1/3 build megatron_video._C for ${ARCH} =="
TORCH_CUDA_ARCH_LIST="${ARCH}" MAX_JOBS="$(nproc)" "$PY" setup.py -q build_ext --inplace
"$PY" -c "import megatron_video._C as ext; assert ext.has_cuda(), 'CUDA kernels were not built'"
echo "build done at ${SECONDS}s"

echo "== 2/3 CUDA op tests against the references =="
# --noconftest: these tests need no worker pool, so the check runs where megatron-core is absent.
"$PY" -m pytest tests/test_ops_cuda.py -m cuda -q -rs --noconftest -p no:cacheprovider
echo "tests done at ${SECONDS}s"

echo "== 3/3 bandwidth and throughput =="
"$PY" benchmarks/ops.py --device cuda --repeat 10 --dense-frames 32 --ref-rows 32

# ---------------------------------------------------------------------------------------------
echo "== attention: kernels and dist_attention vs a float64 oracle, TransformerEngine baseline, throughput =="
# Budget: what is left of ~255s (at most 110s); the script stops starting new cases past it and a
# hard timeout backs it up, so the whole check stays inside 5 minutes. TE a2a+p2p needs >1 GPU: CP=1.
ATTN_BUDGET=$(( 255 - SECONDS )); if (( ATTN_BUDGET > 110 )); then ATTN_BUDGET=110; fi
if (( ATTN_BUDGET < 20 )); then ATTN_BUDGET=20; fi
ATTN_RC=0
timeout -k 5 $(( ATTN_BUDGET + 30 )) "$PY" benchmarks/gpu_attention.py --device cuda --budget "${ATTN_BUDGET}" || ATTN_RC=$?
echo "attention done at ${SECONDS}s (exit ${ATTN_RC})"
if (( ATTN_RC != 0 )); then exit "${ATTN_RC}"; fi
# ---------------------------------------------------------------------------------------------

echo "== tiled attention engine: float64 parity (flex / sdpa, fp32 / bf16), memory and throughput =="
timeout -k 5 240 "$PY" benchmarks/gpu_engine.py
echo "engine done at ${SECONDS}s"

echo "gpu_check: done in ${SECONDS}s"
