#!/usr/bin/env bash
# Every mini Table 5 recipe on 4 CPU processes (2 emulated nodes x 2), then the report.
#   bash scripts/run_mini_convergence.sh [extra train_gpt.py flags, e.g. --max_steps 50]
set -euo pipefail
cd "$(dirname "$0")/.."
for recipe in zero3 zeropp zeropp_qgz_half zeropp_no_qgz zeropp_nonblocked; do
  rm -rf "out/gpt_mini/$recipe"
  ZEROPP_NODE_SIZE=2 OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 \
    scripts/train_gpt.py "recipes/gpt350m_pile/mini/$recipe.yaml" "$@"
done
.venv/bin/python scripts/report_convergence.py out/gpt_mini --baseline zero3
