#!/usr/bin/env bash
# The interpreter the cluster benchmark's DeepSpeed configurations run in: .venv-deepspeed, layered over .venv (same
# torch, transformers and hf_zeropp) with DeepSpeed added (the `bench-deepspeed` extra's pin, no compiled ops). It is
# kept apart because DeepSpeed, once importable, changes what transformers and accelerate do; hf_zeropp never needs it.
#   bash scripts/benchmarks/deepspeed_env.sh
#   sudo .venv/bin/python -m scripts.benchmarks.cluster --python .venv-deepspeed/bin/python \
#       --configs "ZeRO-3,ZeRO++,DeepSpeed ZeRO-3,DeepSpeed hpZ,DeepSpeed qwZ,DeepSpeed qgZ" ...
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
.venv/bin/python -m venv --without-pip .venv-deepspeed 2>/dev/null || python3 -m venv .venv-deepspeed
layered=$(.venv-deepspeed/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$base" > "$layered/hf_zeropp_venv.pth"
pin=$(.venv/bin/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench-deepspeed'][0])")
DS_BUILD_OPS=0 .venv/bin/python -m pip --python .venv-deepspeed/bin/python install -q --no-deps "$pin" einops hjson \
  msgpack py-cpuinfo
DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'over torch', torch.__version__)"
