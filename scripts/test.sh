#!/usr/bin/env bash
# Set up with the locked versions (scripts/setup.sh), build the kernels once, run the whole test suite, then the
# minimum-versions lane (scripts/test_min_versions.sh: the declared lowest torch/transformers/accelerate/peft/trl),
# the newest-versions lane (scripts/test_newest_versions.sh), Accelerate's own test scripts under hf-zeropp launch
# (scripts/test_accelerate_scripts.sh) and the installed wheel (scripts/test_wheel.sh).
# `.ci/run` calls this.
# pytest lists the 30 slowest tests at the end, to keep the suite's time (docs/versions.md) in view.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every process writes the bytecode of what it imports (the first import compiles it, the others read it): with
# PYTHONDONTWRITEBYTECODE=1 each of the run's hundreds of processes would compile torch and transformers again.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
# The kernels build (about 25 s where nothing is cached) while pytest collects and the first tests run; a test that
# needs them first waits for that build on cpp_extension's lock in the build folder, as ranks starting together do.
kernel_log=$(mktemp)
{ .venv/bin/python -m hf_zeropp.kernels build || echo "kernel build failed (see above)"
  .venv/bin/python -m hf_zeropp.kernels check; } >"$kernel_log" 2>&1 &
kernels=$!
# The lane's .venv-min is built (pip: downloads, unpacking) at the lowest CPU priority while the main suite runs, with
# the lane's tests only collected; they run after the suite, when the lane's installs find everything in place.
lane_log=$(mktemp)
setsid -w sh scripts/lowest_priority.sh bash scripts/test_min_versions.sh --collect-only -q >"$lane_log" 2>&1 &
lane_setup=$!
# The newest-versions lane resolves (and, where a release is newer than the lock, installs) the same way; then
# Accelerate's test scripts run on the newest Accelerate (their launches' workers lowered too, as tests/background.py
# lowers them); the wheel is built, installed alone and run from outside the checkout. All at the lowest priority, one
# after the other.
newest_log=$(mktemp) scripts_log=$(mktemp) wheel_log=$(mktemp)
{ if setsid -w sh scripts/lowest_priority.sh bash scripts/test_newest_versions.sh --collect-only -q >"$newest_log" 2>&1
  then echo 0; else echo 1; fi >"$newest_log.rc"
  if PYTHONPATH="$PWD/tests/lowest_priority" setsid -w sh scripts/lowest_priority.sh bash scripts/test_accelerate_scripts.sh \
      >"$scripts_log" 2>&1
  then echo 0; else echo 1; fi >"$scripts_log.rc"
  setsid -w sh scripts/lowest_priority.sh bash scripts/test_wheel.sh >"$wheel_log" 2>&1; } &
others=$!
trap 'kill "$lane_setup" "$kernels" "$others" 2>/dev/null || true' EXIT
.venv/bin/python -m pytest -q --durations=30 "$@"
wait "$kernels" || { cat "$kernel_log"; echo "the kernels' check failed (see above)"; exit 1; }
grep -v '^\[' "$kernel_log" || true  # what was built and the check's table, without the compiler's command lines
wait "$lane_setup" || { cat "$lane_log"; echo "building the minimum-versions lane failed (see above)"; exit 1; }
grep '^minimum versions' "$lane_log" || true
LANE_INSTALLED=1 bash scripts/test_min_versions.sh
wait "$others" || { cat "$wheel_log"; echo "the installed wheel failed (see above)"; exit 1; }
[ "$(cat "$newest_log.rc")" = 0 ] || { cat "$newest_log"; echo "resolving the newest versions failed (see above)"; exit 1; }
grep -v '^WARNING: Location' "$wheel_log" | grep -E '^(wheel:|the wheel)' || true
[ "$(cat "$scripts_log.rc")" = 0 ] || { cat "$scripts_log"; echo "Accelerate's test scripts failed (see above)"; exit 1; }
cat "$scripts_log"  # each script x preset, and the lane's time
LANE_INSTALLED=1 bash scripts/test_newest_versions.sh
