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
# ---------------------------------------------------------------------------------------------
# Optional: Megatron-LM pretrain() with the video entry, 20 iterations, bf16, on this GPU (CP = 1).
# Needs a Megatron-LM checkout at a pinned tag (the container has one at /opt/Megatron-LM, tag in
# docker/Dockerfile): MEGATRON_LM=/path/to/Megatron-LM bash benchmarks/gpu_check.sh. Never in CI.
if [[ -n "${MEGATRON_LM:-}" ]]; then
    echo "== Megatron-LM pretrain(): examples/pretrain_video_dit.py, 20 iterations, --bf16 =="
    PYTHONPATH="${MEGATRON_LM}:${PYTHONPATH:-}" timeout -k 10 600 "$PY" -m torch.distributed.run \
        --nproc-per-node 1 examples/pretrain_video_dit.py \
        --video-config examples/configs/video_dit_cp.yaml --video-override train.sample=false \
        --tensor-model-parallel-size 1 --context-parallel-size 1 \
        --num-layers 4 --hidden-size 96 --num-attention-heads 4 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 2 \
        --train-iters 20 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 2 \
        --clip-grad 1.0 --bf16 --qk-layernorm --norm-epsilon 1e-6 --hidden-dropout 0 \
        --attention-dropout 0 --transformer-impl transformer_engine --eval-iters 0 \
        --log-interval 5 --tokenizer-type NullTokenizer --vocab-size 64
    echo "pretrain done at ${SECONDS}s"
else
    echo "(Megatron-LM pretrain() check skipped: set MEGATRON_LM to a Megatron-LM checkout)"
fi

echo "gpu_check: done in ${SECONDS}s"
