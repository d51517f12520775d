#!/usr/bin/env bash
# The minimum-versions lane: a second venv (.venv-min) with the *declared minimum* versions of torch, transformers,
# accelerate, peft and trl (read from pyproject.toml's ">=" bounds, installed as "=="; CPU torch), then the
# conformance smoke subset (stock vs hf_zeropp zero3 and ZeRO++; Accelerate, Trainer and TRL patterns).
# scripts/test.sh runs it after the main suite, with LANE_INSTALLED=1 once it has built .venv-min in the background
# (the installs are then skipped: pip takes about 10 s to find them done). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_MIN:-.venv-min}

if [ "${LANE_INSTALLED:-0}" != 1 ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install --upgrade pip >/dev/null
  mapfile -t MINIMUMS < <("$VENV/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = project["dependencies"] + project["optional-dependencies"]["rlhf"]
for requirement in requirements:
    name, _, version = re.match(r"([A-Za-z0-9_.-]+)\s*(>=)\s*([^,;\s]+)", requirement).groups()
    if name in ("torch", "transformers", "accelerate", "peft", "trl"):
        print(f"{name}=={version}")
PY
  )
  echo "minimum versions: ${MINIMUMS[*]}"
  "${PIP[@]}" install "${MINIMUMS[@]}" pyyaml "pytest>=8" "pytest-timeout>=2.3" "tokenizers>=0.21" "ninja>=1.11"
  "${PIP[@]}" install --no-deps -e .
fi
"$VENV/bin/python" -m pytest -q tests/conformance/test_conformance.py \
    -k "(zero3 or zeropp) and not another_world_size" "$@"
