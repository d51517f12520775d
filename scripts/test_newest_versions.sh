#!/usr/bin/env bash
# The newest-versions lane. pip resolves the newest release of every dependency without installing (CPU torch stays
# at the installed build: PyPI's newest torch is a multi-GB CUDA build). Where any is newer than the lock
# (hf_zeropp/_compat/locked-versions.txt), a venv (.venv-newest) gets them and the compat, conformance, launch and
# loading tests run there: a release that breaks them fails here, at the next landing, with the package and version
# named. Where the newest releases are exactly the locked ones, the main suite has tested them and nothing more runs.
# scripts/test.sh runs this in the background (with --collect-only) while the main suite runs, then again with
# LANE_INSTALLED=1 after it. LANE_FULL=1 runs the tests even where nothing is newer (scripts/refresh_lock.sh).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_NEWEST:-.venv-newest}
NEWER=$VENV.newer  # what the resolution found, kept for the run after the main suite
if [ "${LANE_INSTALLED:-0}" != 1 ]; then
  keep_torch=$(.venv/bin/python -c "import torch; print('torch==' + torch.__version__)")
  .venv/bin/python -m pip install --disable-pip-version-check -q --dry-run --upgrade --upgrade-strategy eager \
      --report - -e ".[dev,rlhf]" -c <(echo "$keep_torch") 2>/dev/null | .venv/bin/python -c '
import importlib.metadata, json, sys
newer = []
for item in json.load(sys.stdin)["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        installed = "none"
    if name != "hf_zeropp" and installed != version:
        newer.append(f"{name} {version} (locked {installed})")
print(", ".join(newer))' >"$NEWER"
  if [ -s "$NEWER" ] && [ "$(cat "$NEWER")" != "" ] || [ "${LANE_FULL:-0}" = 1 ]; then
    VENV=$VENV VERSIONS=newest bash scripts/setup.sh >/dev/null
  fi
fi
newer=$(cat "$NEWER")
if [ -z "$newer" ] && [ "${LANE_FULL:-0}" != 1 ]; then
  echo "newest versions: the locked ones (the main suite tested them)"
  exit 0
fi
echo "newest versions: ${newer:-the locked ones}; the compat, conformance, launch and loading tests on them"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/compat/test_compat.py tests/conformance/test_conformance.py \
    tests/integrations/test_launch.py tests/interop/test_hf_checkpoint.py tests/engine/test_large_models.py "$@" || {
  echo "the newest-versions lane failed with ${newer:-the locked versions} (hf_zeropp/_compat/locked-versions.txt)"
  exit 1
}
