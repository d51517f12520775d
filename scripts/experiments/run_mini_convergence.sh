#!/usr/bin/env bash
# Every mini Table 5 recipe (or those of RECIPE_DIR) on 4 CPU processes (2 emulated nodes x 2), for each seed,
# then the report.
#   bash scripts/experiments/run_mini_convergence.sh [extra train_gpt.py flags, e.g. --max_steps 50]
# Environment: SEEDS (default "0 1 2"; each seed sets both the initialisation and the data order, identical
# across recipes), RECIPES (default: the five Table 5 rows; any recipe names under RECIPE_DIR), RECIPE_DIR
# (default recipes/gpt350m_pile/mini; the research variants of the mini are in recipes/experiments/gpt350m_mini,
# the other accuracy cases in recipes/experiments/llama_python_docs, llama_stdlib, llama_tied and opt_python_docs,
# each with RECIPES="zero3 zeropp zeropp_accurate"), OUT (default out/gpt_mini).
# A run whose metrics already hold its final evaluation is kept, so an interrupted sweep resumes where it stopped;
# delete its folder to redo it.
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"0 1 2"}
RECIPES=${RECIPES:-"zero3 zeropp zeropp_qgz_half zeropp_no_qgz zeropp_nonblocked"}
OUT=${OUT:-out/gpt_mini}
RECIPE_DIR=${RECIPE_DIR:-recipes/gpt350m_pile/mini}
for seed in $SEEDS; do
  for recipe in $RECIPES; do
    run="$OUT/seed$seed/$recipe"
    if grep -qs train_runtime "$run/metrics.jsonl"; then
      echo "kept $run"
      continue
    fi
    rm -rf "$run"
    ZEROPP_NODE_SIZE=2 OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 \
      scripts/train_gpt.py "$RECIPE_DIR/$recipe.yaml" \
      --seed "$seed" --data_seed "$seed" --output_dir "$run" "$@"
  done
done
# the paper's Table 5 column belongs to the GPT-350M study's rows only
paper=$([ "$RECIPE_DIR" = recipes/gpt350m_pile/mini ] && echo --paper || echo --no-paper)
.venv/bin/python -m scripts.experiments.report_convergence "$OUT" --baseline zero3 "$paper"
