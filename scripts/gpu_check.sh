#!/usr/bin/env bash
# Everything a GPU machine checks, in one run (~4 min on an H200 once the kernels are built; the build adds a few
# minutes on a fresh machine): build the CPU and CUDA kernels, run every CUDA test (bit-identical to the reference
# on CPU), time the kernels, run the single-GPU end-to-end script, and profile three kernels at 256M elements with
# Nsight Compute where it is installed. Results land in $OUT (default out/gpu_check): log.txt, tests.txt,
# kernels_cuda.md/.json, gpu_e2e.md/.json, ncu.txt. docs/results/2026-11-26-gpu-h200.md holds one machine's results.
#
#   bash scripts/gpu_check.sh                 # from the repository root, with the python that holds CUDA torch
#   PYTHON=.venv/bin/python OUT=/tmp/x bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_ZEROPP_KERNEL_CACHE=${HF_ZEROPP_KERNEL_CACHE:-/tmp/hf_zeropp_kernels}
exec > >(tee -a "$OUT/log.txt") 2>&1

step() { echo; echo "=== $(date +%T) $*"; }
build() { $PYTHON -c "from hf_zeropp.kernels import _build; _build.load(_build.$1, raise_on_failure=True); print('$1 built')"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
nvcc --version | tail -2 || true
$PYTHON -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"

step "build the CPU and CUDA kernels (in parallel)"
build CPU_EXTENSION &
cpu_build=$!  # waited for by pid: a bare `wait` would also wait for the tee above, which never ends
build CUDA_EXTENSION || { echo "CUDA build failed"; exit 1; }
wait $cpu_build || { echo "CPU build failed"; exit 1; }

step "CUDA tests"
timeout 300 $PYTHON -m pytest -q -p no:cacheprovider -n 8 -k cuda \
    tests/test_kernels.py tests/test_hadamard.py tests/test_kernel_fuzz.py 2>&1 | tail -25 | tee "$OUT/tests.txt"

step "kernel bandwidth"
timeout 240 $PYTHON -m scripts.benchmarks.kernels --device cuda --sizes 1M,16M,256M --reps 5 --out "$OUT"

step "single-GPU end to end"
timeout 240 $PYTHON -m scripts.benchmarks.gpu_e2e --out "$OUT" --rounds 6

step "Nsight Compute: quantize int8, dequantize int8, swizzle_quantize int4 + Hadamard 64 at 256M bf16 elements"
if command -v ncu >/dev/null; then
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
    timeout 180 ncu --clock-control none --kernel-name-base demangled -k "regex:hf_zeropp" --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis $PYTHON "$probe" > "$OUT/ncu.txt" 2>&1
    echo "ncu exit $?"
    grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers|stalled" \
        "$OUT/ncu.txt" | head -60
else
    echo "ncu not installed"
fi
step "done"
