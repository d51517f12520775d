#!/usr/bin/env bash
# Set up (scripts/setup.sh), build the kernels once, run the whole test suite, then the minimum-versions lane
# (scripts/test_min_versions.sh: the declared lowest torch/transformers/accelerate/peft/trl). `.ci/run` calls this.
# pytest lists the 30 slowest tests at the end, to keep the suite's time (19 to 21 minutes on 2 cores) in view.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m hf_zeropp.kernels build >/tmp/hf_zeropp_kernel_build.log 2>&1 || {
  cat /tmp/hf_zeropp_kernel_build.log; echo "kernel build failed (see above)"; }
.venv/bin/python -m hf_zeropp.kernels check
# The lane's .venv-min is built (pip: downloads, unpacking) at the lowest CPU priority while the main suite runs, with
# the lane's tests only collected; they run after the suite, when the lane's installs find everything in place.
lane_log=$(mktemp)
nice -n 19 bash scripts/test_min_versions.sh --collect-only -q >"$lane_log" 2>&1 &
lane_setup=$!
trap 'kill "$lane_setup" 2>/dev/null || true' EXIT
.venv/bin/python -m pytest -q --durations=30 "$@"
wait "$lane_setup" || { cat "$lane_log"; echo "building the minimum-versions lane failed (see above)"; exit 1; }
bash scripts/test_min_versions.sh
