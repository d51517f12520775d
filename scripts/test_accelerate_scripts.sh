#!/usr/bin/env bash
# Accelerate's own distributed test scripts under hf-zeropp launch (scripts/accelerate_scripts.py: every script the
# installed Accelerate ships, zero3 on 2 CPU processes and ZeRO++ on 2 x 2, the scripts that fail under stock on CPU
# left out and the few DDP-only checks skipped by name, both listed with the reason there and in docs/design.md). It
# runs on the newest Accelerate: the newest-versions venv where scripts/test_newest_versions.sh built it (a release
# newer than the lock), else .venv, whose locked versions are then the newest. scripts/test.sh runs it in the
# background at the lowest priority once the newest versions are resolved. Extra arguments go to the runner.
set -euo pipefail
cd "$(dirname "$0")/.."
newest=${VENV_NEWEST:-.venv-newest}
venv=.venv
if [ -n "$(cat "$newest.newer" 2>/dev/null)" ] && [ -x "$newest/bin/python" ]; then
  venv=$newest
fi
exec "$venv/bin/python" scripts/accelerate_scripts.py "$@"
