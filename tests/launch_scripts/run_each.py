"""Training scripts, unmodified, run one after the other in one launch:

    accelerate launch ... tests/launch_scripts/run_each.py "scripts/train_accelerate.py --zeropp zero1 ..." "..."

Each string is one run's command line: the script (a path from the checkout's root; it runs as ``__main__``) or
``-m MODULE`` (run as ``python -m MODULE`` runs it), and its arguments (``sys.argv`` as the script sees it), after any
``NAME=VALUE`` words, which set environment variables for that run only. Runs of the launch tests share one
launch's startup (4 workers importing torch, Transformers, Accelerate and hf_zeropp, more than most of the runs
themselves) instead of paying it once per run. Between runs Accelerate's process-wide state is reset, as separate
launches would have it, and the process group is kept: the scripts' own ``end_training`` destroys it, and gloo
cannot form a new one on the launcher's store under the same name. It is destroyed after the last run.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    runs = sys.argv[1:]
    sys.path.insert(0, str(ROOT))  # the scripts import hf_zeropp.testing and scripts.* from the checkout
    destroy = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None
    try:
        for run in runs:
            words = shlex.split(run)
            environ = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                environ[name] = value
            before = {name: os.environ.get(name) for name in environ}
            os.environ.update(environ)
            if words[0] == "-m":
                sys.argv = words[1:]
                runpy.run_module(words[1], run_name="__main__", alter_sys=True)  # sys.argv[0]: the module's file
            else:
                script = str(ROOT / words[0])
                sys.argv = [script, *words[1:]]
                runpy.run_path(script, run_name="__main__")
            for name, value in before.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    finally:
        PartialState.destroy_process_group = destroy
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
