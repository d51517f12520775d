#!/usr/bin/env bash
# Flake hunt: the multi-process test modules that train, and the demo, run ROUNDS times (default 10) two at a time
# on this machine's cores: (conformance | engine rules), then (integrations | the demo under hf-zeropp launch).
# Every job's log and exit status go to OUT (default out/flake_hunt); the last line says how many jobs failed.
# Needs the environment scripts/setup.sh builds.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-10}
OUT=${OUT:-out/flake_hunt}
mkdir -p "$OUT"
job() {  # NAME COMMAND...: run it, keep its log and exit status
  local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?" >> "$OUT/$name.log"
}
for round in $(seq 1 "$ROUNDS"); do
  job "conformance_$round" .venv/bin/python -m pytest -q -p no:cacheprovider tests/conformance/test_conformance.py &
  job "engine_rules_$round" .venv/bin/python -m pytest -q -p no:cacheprovider tests/engine/test_engine_rules.py &
  wait
  job "integrations_$round" .venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_integrations.py &
  OMP_NUM_THREADS=1 job "demo_$round" .venv/bin/hf-zeropp launch --config_file recipes/accelerate/cpu_2x2.yaml \
    scripts/train_demo.py --output_dir "$OUT/demo" --max_steps 40 --per_device_train_batch_size 4 \
    --learning_rate 3e-3 --lr_scheduler_type constant --weight_decay 0.01 --max_grad_norm 1.0 --logging_steps 10 \
    --logging_first_step --save_strategy no --report_to none --use_cpu --disable_tqdm true &
  wait
  echo "round $round done $(date +%T)"
done
failed=$(grep -L "^exit 0$" "$OUT"/*_*.log | wc -l)
echo "flake hunt: $((ROUNDS * 4)) jobs, $failed failed (logs in $OUT)"
[ "$failed" -eq 0 ]
