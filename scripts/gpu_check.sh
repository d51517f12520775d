#!/usr/bin/env bash
# Everything a GPU machine checks, in one run (about 6 min on an H200 with the kernels compiled ahead, CUDA_OBJECTS;
# building them there adds 4.5):
# - build the CPU and CUDA kernels, and run every CUDA test (bit-identical to the reference on CPU);
# - run the 4-rank ZeRO++ step on the one GPU (ranks as threads, a CUDA stream each), plainly and under torch's CUDA
#   stream sanitizer;
# - time the kernels beside a copy, beside other versions of the kernels and beside torchao's blockwise quantization;
# - time a GPT-2 355M training step on 4 threaded ranks under ZeRO-3, ZeRO++ and hybrid-q;
# - profile three kernels with Nsight Compute where it is installed.
# Results land in $OUT (default out/gpu_check): log.txt, every pytest run whole, and the benchmark files.
# docs/results/2026-11-26-gpu-h200.md, 2026-11-27-gpu-kernels-multirank.md and 2026-11-28-gpu-kernels-loads-ahead.md
# hold one machine's results.
#
#   bash scripts/gpu_check.sh                 # from the repository root, with the python that holds CUDA torch
#   PYTHON=.venv/bin/python OUT=/tmp/x bash scripts/gpu_check.sh
#
# Other versions of the kernels are timed side by side when named: KERNEL_VERSIONS="name=folder ..." (a folder of
# kernel sources, e.g. an earlier commit's cuda/). Where the folder holds objects/, compiled ahead with
# `HF_ZEROPP_KERNEL_SOURCES=folder python -m scripts.cuda_objects compile folder/objects`, they are linked instead of
# built. A torchao wheel in TORCHAO_WHEELS (a folder) is installed for the anchor. CUDA_OBJECTS (a folder from
# `python -m scripts.cuda_objects compile`, run ahead on any machine with nvcc) links the kernels compiled ahead
# instead of compiling them here: seconds instead of minutes of GPU time.
# SIZES (default 1M,16M,256M) and COMPILED_ONLY=1 (skip timing the plain-torch reference) shorten the run; REPS
# (default 5) is the timed calls per op, TEST_WORKERS (default 8) the CUDA tests' processes; SKIP names steps to
# leave out (any of: sanitizer ncu model). The model step times a GPT-2 355M training step on 4 threaded
# ranks (scripts/benchmarks/gpu_ranks_step.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-out/gpu_check}
KERNEL_VERSIONS=${KERNEL_VERSIONS:-}
TORCHAO_WHEELS=${TORCHAO_WHEELS:-}
CUDA_OBJECTS=${CUDA_OBJECTS:-}
SKIP=${SKIP:-}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_ZEROPP_KERNEL_CACHE=${HF_ZEROPP_KERNEL_CACHE:-/tmp/hf_zeropp_kernels}
exec > >(tee -a "$OUT/log.txt") 2>&1

step() { echo; echo "=== $(date +%T) $*"; }
skipped() { [[ " $SKIP " == *" $1 "* ]] && echo "skipped (SKIP)"; }
build() {  # extension [source folder]
    HF_ZEROPP_KERNEL_SOURCES=${2:-} $PYTHON -c "from hf_zeropp.kernels import _build
_build.load(_build.$1, raise_on_failure=True); print('$1 built from', _build.source_dir())"
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
nvcc --version | tail -2 || true
$PYTHON -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"

versions=()  # name=folder of every other version of the kernels
for version in $KERNEL_VERSIONS; do versions+=("$version"); done

step "build the CPU and CUDA kernels, and every other version named (in parallel)"
pids=()  # waited for by pid: a bare `wait` would also wait for the tee above
build CPU_EXTENSION & cpu_build=$!  # only the CPU side of the 4-rank test needs it: waited for there
for version in "${versions[@]}"; do
    folder=${version#*=}
    if [ -f "$folder/objects/manifest.json" ]; then
        HF_ZEROPP_KERNEL_SOURCES=$folder $PYTHON -m scripts.cuda_objects link "$folder/objects" & pids+=($!)
    else
        build CUDA_EXTENSION "$folder" & pids+=($!)
    fi
done
if [ -n "$CUDA_OBJECTS" ]; then
    $PYTHON -m scripts.cuda_objects link "$CUDA_OBJECTS" || { echo "linking $CUDA_OBJECTS failed"; exit 1; }
fi
build CUDA_EXTENSION || { echo "CUDA build failed"; exit 1; }
for pid in "${pids[@]}"; do wait "$pid" || echo "a build failed (pid $pid); its version is not timed"; done

step "CUDA tests"
timeout 200 $PYTHON -m pytest -q -p no:cacheprovider -rfEs -n ${TEST_WORKERS:-8} -k cuda \
    tests/kernels/test_kernels.py tests/kernels/test_hadamard.py tests/kernels/test_kernel_fuzz.py \
    > "$OUT/tests_kernels.txt" 2>&1
tail -25 "$OUT/tests_kernels.txt"

step "4 ranks (2 nodes x 2) of ZeRO++ on the one GPU, a CUDA stream per rank, against the same ranks on CPU"
wait "$cpu_build" || echo "the CPU kernels failed to build"
timeout 150 $PYTHON -m pytest -q -p no:cacheprovider -rfEs tests/testing/test_threaded_ranks.py \
    > "$OUT/tests_ranks.txt" 2>&1
grep -E "passed|failed|^(FAILED|ERROR|SKIPPED)" "$OUT/tests_ranks.txt"

step "kernel bandwidth"
timeout 240 $PYTHON -m scripts.benchmarks.kernels --device cuda --sizes "${SIZES:-1M,16M,256M}" --reps ${REPS:-5} \
    ${COMPILED_ONLY:+--compiled-only} --check --out "$OUT"
for version in "${versions[@]}"; do
    HF_ZEROPP_KERNEL_SOURCES=${version#*=} timeout 120 $PYTHON -m scripts.benchmarks.kernels --device cuda \
        --sizes 16M,256M --reps ${REPS:-5} --compiled-only --check --label "${version%%=*}" --out "$OUT" | tail -16
done

step "the same 4 ranks under torch's CUDA stream sanitizer"
skipped sanitizer || {
    TORCH_CUDA_SANITIZER=1 timeout 150 $PYTHON -m pytest -q -p no:cacheprovider -rfEs \
        tests/testing/test_threaded_ranks.py -k sanitizer > "$OUT/tests_sanitizer.txt" 2>&1
    grep -E "passed|failed|^(FAILED|ERROR|SKIPPED)|CUDASanitizer|data race" "$OUT/tests_sanitizer.txt" | head -20
}

step "anchor: torchao's blockwise quantization beside ours"
if [ -n "$TORCHAO_WHEELS" ]; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao_site "$TORCHAO_WHEELS"/*.whl \
        && PYTHONPATH="$PYTHONPATH:/tmp/torchao_site" timeout 150 $PYTHON -m scripts.benchmarks.kernels \
            --device cuda --sizes 16M,256M --reps ${REPS:-5} --compiled-only --torchao --label torchao --out "$OUT" \
            | tail -16
else
    echo "TORCHAO_WHEELS not set"
fi

step "a real-model step: GPT-2 355M in bf16 on 4 threaded ranks (2 nodes x 2), ZeRO-3 / ZeRO++ / hybrid-q"
skipped model || timeout 240 $PYTHON -m scripts.benchmarks.gpu_ranks_step --out "$OUT" 2>&1 | tail -25

step "Nsight Compute: quantize int8, dequantize int8, swizzle_quantize int4 + Hadamard 64 at 256M bf16 elements"
if skipped ncu; then
    :
elif command -v ncu >/dev/null; then
    probe=$(mktemp --suffix .py)
    cat > "$probe" <<'EOF'
import torch
import hf_zeropp.kernels as K
x = torch.randn(256 << 20, device="cuda").to(torch.bfloat16).view(-1, 1 << 16)
q8 = K.quantize(x, 8, 256)
K.dequantize(*q8, bits=8, block_size=256, dtype=torch.bfloat16, out=torch.empty_like(x))
K.swizzle_quantize(x.reshape(-1), 2, 4, 2, 4, 256, hadamard=64)
torch.cuda.synchronize()
EOF
    timeout 100 ncu --clock-control none --kernel-name-base demangled -k "regex:hf_zeropp" --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis $PYTHON "$probe" > "$OUT/ncu.txt" 2>&1
    echo "ncu exit $?"
    grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers|stalled" \
        "$OUT/ncu.txt" | head -60
else
    echo "ncu not installed"
fi
step "done"
