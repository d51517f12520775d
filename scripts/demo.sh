#!/usr/bin/env bash
# The main job on a fresh CPU machine: set up, then run scripts/train_demo.py — a stock Trainer script with no
# hf_zeropp import — with ZeRO++ (qwZ + hpZ + qgZ) through `hf-zeropp launch` and one YAML file: 4 gloo processes
# emulating 2 nodes x 2 ranks. Extra arguments go to the script (TrainingArguments flags, e.g. --max_steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
# Every process writes the bytecode of what it imports (the first import compiles it, the others read it): with
# PYTHONDONTWRITEBYTECODE=1 each of the launch's processes would compile torch and transformers again.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
OMP_NUM_THREADS=1 exec .venv/bin/hf-zeropp launch --config_file recipes/accelerate/cpu_2x2.yaml \
  scripts/train_demo.py --output_dir out/demo --max_steps 40 --per_device_train_batch_size 4 \
  --learning_rate 3e-3 --lr_scheduler_type constant --weight_decay 0.01 --max_grad_norm 1.0 \
  --logging_steps 10 --logging_first_step --save_strategy no --report_to none --use_cpu --disable_tqdm true "$@"
