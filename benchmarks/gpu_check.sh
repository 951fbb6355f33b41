#!/usr/bin/env bash
# GPU check as separate commands of at most ~4 minutes each (a loan is ~15 minutes in all). HERE,
# with network, first:  bash benchmarks/gpu_prepare.sh   (wheels into .gpu_wheels/, carried along).
# Then, on the GPU machine (Python 3.12, torch with CUDA, no megatron-core, no network), one command
# per section, in this order:
#   bash benchmarks/gpu_check.sh env        install .gpu_wheels (pip --no-index --no-deps --target
#                                           .gpu_site); GPU, torch; imports (nothing imports megatron)
#   bash benchmarks/gpu_check.sh attention  kernels + dist_attention vs float64, TE, throughput
#   bash benchmarks/gpu_check.sh engine     tiled engine: flex / sdpa parity, memory, time
#   bash benchmarks/gpu_check.sh build      megatron_video._C with CUDA kernels (a failure is reported;
#                                           attention and engine need no extension)
#   bash benchmarks/gpu_check.sh ops        CUDA op tests + halo bandwidth (needs build)
#   bash benchmarks/gpu_check.sh pretrain   Megatron-LM pretrain(), only with MEGATRON_LM set
# `all` runs every section and prints the table. `--device cpu` (before the sections) runs them on
# CPU at tiny sizes (tests/test_gpu_check.py); what needs a GPU then says SKIPPED. Every section
# ends in one line "gpu_check <section>: PASS | FAIL | SKIPPED (why)"; exit 0 PASS, 1 FAIL, 3 SKIPPED.
# PYTHON=/path/to/python chooses the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEVICE=cuda
if [[ "${1:-}" == "--device" ]]; then DEVICE="$2"; shift 2; fi
[[ "$DEVICE" == cuda || "$DEVICE" == cpu ]] || { echo "--device ($DEVICE) must be cuda or cpu"; exit 2; }
export PYTHONUNBUFFERED=1
if [[ -d .gpu_site ]]; then export PYTHONPATH="$PWD/.gpu_site:$PWD:${PYTHONPATH:-}"; else export PYTHONPATH="$PWD:${PYTHONPATH:-}"; fi
LIMIT=230  # seconds per section (a command may run ~4 minutes)

verdict() {  # section rc [why]
    local s=$1 rc=$2 why=${3:-}
    case $rc in
        0) echo "gpu_check $s: PASS" ;;
        3) echo "gpu_check $s: SKIPPED (${why:-see above})" ;;
        124|137) echo "gpu_check $s: FAIL (over ${LIMIT}s)"; rc=1 ;;
        *) echo "gpu_check $s: FAIL${why:+ ($why)}"; rc=1 ;;
    esac
    return $rc
}

sec_env() {
    local pyv
    pyv="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if [[ $pyv != 3.12 ]] && compgen -G ".gpu_wheels/*.whl" >/dev/null; then
        echo "the .gpu_wheels are for Python 3.12, this is $pyv: not installed; using what is installed"
    elif compgen -G ".gpu_wheels/*.whl" >/dev/null; then
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --upgrade --target .gpu_site .gpu_wheels/*.whl \
                || { verdict env 1 "pip install of .gpu_wheels failed"; return; }
        else  # no pip: a wheel is a zip of its files (entry-point scripts are not needed here)
            "$PY" -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('.gpu_site') for w in glob.glob('.gpu_wheels/*.whl')]" \
                || { verdict env 1 "unpacking .gpu_wheels failed"; return; }
            chmod +x .gpu_site/ninja/data/bin/* 2>/dev/null || true
        fi
        export PYTHONPATH="$PWD/.gpu_site:$PYTHONPATH"
        echo "installed $(ls .gpu_wheels/*.whl | wc -l) wheels into .gpu_site"
    else
        echo "no .gpu_wheels/ (run benchmarks/gpu_prepare.sh here first); using what is installed"
    fi
    timeout $LIMIT "$PY" - "$DEVICE" <<'EOF'
import sys
import torch
dev = sys.argv[1]
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device")
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
import hypothesis, pytest, tqdm  # noqa: E401,F401  the tests' and benchmarks' own needs
import megatron_video.attention, megatron_video.diffusion.teacher_forcing, megatron_video.layouts  # noqa: E401,F401
import megatron_video.ops  # noqa: F401
bad = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
if bad:
    sys.exit(f"these modules imported megatron-core: {bad}")
print("imports ok; megatron-core not imported")
EOF
    verdict env $?
}

sec_attention() {
    local args=(--device "$DEVICE" --budget 150)
    [[ $DEVICE == cpu ]] && args+=(--small --budget 25 --seqs 128)
    timeout -k 5 $LIMIT "$PY" benchmarks/gpu_attention.py "${args[@]}"
    verdict attention $? "no CUDA device"
}

sec_engine() {
    timeout -k 5 $LIMIT "$PY" benchmarks/gpu_engine.py --device "$DEVICE" --seqs 8192,16384,32768
    verdict engine $? "no CUDA device"
}

sec_build() {
    if [[ $DEVICE == cpu ]]; then verdict build 3 "needs a GPU: builds the CUDA kernels"; return; fi
    local arch
    arch="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")" \
        || { verdict build 1 "no CUDA device"; return; }
    TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" timeout -k 5 $LIMIT "$PY" setup.py -q build_ext --inplace \
        && "$PY" -c "import megatron_video._C as e; assert e.has_cuda(), 'CUDA kernels were not built'"
    verdict build $? "extension build for sm_${arch/./}"
}

sec_ops() {
    if [[ $DEVICE == cpu ]]; then
        # the benchmark's imports are checked (no megatron-core); the CUDA tests and timings need a GPU
        "$PY" -c "import runpy, sys; sys.argv = ['ops', '--help']; runpy.run_path('benchmarks/ops.py', run_name='__main__')" >/dev/null \
            || { verdict ops 1 "benchmarks/ops.py does not import"; return; }
        verdict ops 3 "needs a GPU: CUDA op tests and bandwidth"
        return
    fi
    "$PY" -c "import megatron_video._C as e; assert e.has_cuda()" 2>/dev/null \
        || { verdict ops 3 "extension without CUDA kernels: run the build section first"; return; }
    # --noconftest: these tests need no worker pool
    timeout -k 5 150 "$PY" -m pytest tests/test_ops_cuda.py -m cuda -q -rs --noconftest -p no:cacheprovider \
        && timeout -k 5 80 "$PY" benchmarks/ops.py --device cuda --repeat 10 --dense-frames 32 --ref-rows 32
    verdict ops $?
}

sec_pretrain() {
    if [[ $DEVICE == cpu || -z "${MEGATRON_LM:-}" ]]; then
        verdict pretrain 3 "needs a GPU and MEGATRON_LM (a Megatron-LM checkout)"; return
    fi
    PYTHONPATH="${MEGATRON_LM}:${PYTHONPATH}" timeout -k 10 $LIMIT "$PY" -m torch.distributed.run \
        --nproc-per-node 1 examples/pretrain_video_dit.py \
        --video-config examples/configs/video_dit_cp.yaml --video-override train.sample=false \
        --tensor-model-parallel-size 1 --context-parallel-size 1 \
        --num-layers 4 --hidden-size 96 --num-attention-heads 4 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 2 \
        --train-iters 20 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 2 \
        --clip-grad 1.0 --bf16 --qk-layernorm --norm-epsilon 1e-6 --hidden-dropout 0 \
        --attention-dropout 0 --transformer-impl transformer_engine --eval-iters 0 \
        --log-interval 5 --tokenizer-type NullTokenizer --vocab-size 64
    verdict pretrain $?
}

SECTIONS=(env attention engine build ops pretrain)
[[ $# -ge 1 ]] || { sed -n '2,18p' "$0"; exit 2; }
if [[ "$1" == all ]]; then set -- "${SECTIONS[@]}"; fi
declare -A STATUS
worst=0
for s in "$@"; do
    [[ " ${SECTIONS[*]} " == *" $s "* ]] || { echo "unknown section ($s): one of ${SECTIONS[*]} or all"; exit 2; }
    echo "== $s ($DEVICE) =="
    SECONDS=0
    out="$(sec_"$s" 2>&1 | tee /dev/stderr | tail -n 1)"
    STATUS[$s]="${out#gpu_check $s: } [${SECONDS}s]"
    if [[ "$out" == *": FAIL"* ]]; then worst=1; elif [[ "$out" == *": SKIPPED"* && $worst == 0 ]]; then worst=3; fi
done
if [[ $# -gt 1 ]]; then
    echo "== gpu_check summary ($DEVICE) =="
    printf '  %-10s %-9s %s\n' section "needs GPU" result
    for s in "$@"; do
        case $s in env|attention|engine) need="to time" ;; *) need="yes" ;; esac
        printf '  %-10s %-9s %s\n' "$s" "$need" "${STATUS[$s]}"
    done
fi
exit $worst
