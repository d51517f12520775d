#!/usr/bin/env bash
# The main job on a fresh CPU machine: set up, then train a small GPT-2 with ZeRO++ (qwZ + hpZ + qgZ) on
# 4 gloo processes emulating 2 nodes x 2 ranks. Extra arguments go to scripts/train_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 exec .venv/bin/torchrun --standalone --nproc_per_node 4 scripts/train_demo.py \
  --preset zeropp --node-size 2 "$@"
