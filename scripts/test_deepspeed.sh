#!/usr/bin/env bash
# The DeepSpeed lane (opt-in, not part of .ci/run): DeepSpeed 0.19.8 itself, on CPU processes, beside hf_zeropp.
# It runs the tests marked `deepspeed` in .venv-deepspeed (scripts/benchmarks/deepspeed_env.sh: .venv plus
# DeepSpeed), which compare hf_zeropp with what DeepSpeed does live. The main suite checks the same numbers against
# the fixtures in tests/fixtures/deepspeed, written by DeepSpeed (python -m scripts.deepspeed_reference ...).
# The first run JIT-builds DeepSpeed's CPU ops (minutes on 2 cores). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-deepspeed/bin/python ] || bash scripts/benchmarks/deepspeed_env.sh
DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-deepspeed/bin/python -m pytest -q -m deepspeed "$@"
