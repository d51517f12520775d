#!/usr/bin/env bash
# The package as users install it: build the wheel, install it with the locked versions and no extras into a clean
# venv (.venv-wheel), and from outside the checkout run `hf-zeropp env`, the kernels' check and a short
# `hf-zeropp launch` of the demo script (two steps on 2 emulated nodes x 2 ranks). Also checks that the wheel
# carries the kernel sources and nothing from tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv-wheel
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$ROOT/build" "$ROOT/hf_zeropp.egg-info"' EXIT  # setuptools builds in the checkout
LOCK=hf_zeropp/_compat/locked-versions.txt
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps . -w "$WORK/dist" 2>&1 | grep -v '^WARNING: Location' || true
wheel=$(ls "$WORK"/dist/hf_zeropp-*.whl)
.venv/bin/python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sources = [n for n in names if n.startswith("hf_zeropp/_csrc/") and n.endswith((".cu", ".cpp"))]
stray = [n for n in names if n.startswith(("tests/", "scripts/")) or "/tests/" in n]
assert sources, "the wheel carries no kernel sources (hf_zeropp/_csrc/)"
assert "hf_zeropp/_compat/locked-versions.txt" in names, "the wheel lacks the tested versions"
assert not stray, f"the wheel carries files from tests/ or scripts/: {stray[:5]}"
print(f"wheel: {len(names)} files, {len(sources)} kernel sources, nothing from tests/ or scripts/")
PY
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-compile)
"${PIP[@]}" "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"  # CPU build here
"${PIP[@]}" "uv==0.13.10" >/dev/null  # as scripts/setup.sh: uv for the locked wheels, pip for the CPU torch
grep -v '^torch==' "$LOCK" >"$WORK/lock.txt"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$WORK/lock.txt" "$wheel"
cd "$WORK"  # outside the checkout: only the installed package can be imported
# the kernel build cache is shared: it is keyed by the sources' hash, so the wheel's sources find the checkout's build
"$VENV/bin/hf-zeropp" env
"$VENV/bin/python" -m hf_zeropp.kernels check
cp "$ROOT/scripts/train_demo.py" "$ROOT/recipes/accelerate/cpu_2x2.yaml" "$WORK/"
port=$("$VENV/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
OMP_NUM_THREADS=1 "$VENV/bin/hf-zeropp" launch --config_file cpu_2x2.yaml --main_process_port "$port" train_demo.py \
  --output_dir out --max_steps 2 --per_device_train_batch_size 2 --logging_steps 1 --save_strategy no --report_to none \
  --use_cpu --disable_tqdm true --corpus_bytes 200000
echo "the wheel, installed alone, ran env, the kernels' check and the demo"
