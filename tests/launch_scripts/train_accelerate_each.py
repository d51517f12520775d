"""``scripts/train_accelerate.py``, unmodified, run once per argument string in one launch:

    accelerate launch ... tests/launch_scripts/train_accelerate_each.py "--zeropp zero1 --output A" "--zeropp ..."

Each string is that run's command line (``sys.argv`` as the script sees it; the script runs as ``__main__``). The
runs of tests/test_integrations.py share one launch's startup (4 workers importing torch, Accelerate and hf_zeropp,
more than most of the runs themselves) instead of paying it once per config. Between runs Accelerate's process-wide
state is reset, as separate launches would have it, and the process group is kept: the script's ``end_training``
destroys it, and gloo cannot form a new one on the launcher's store under the same name. It is destroyed after the
last run.
"""

from __future__ import annotations

import runpy
import shlex
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_accelerate.py"


def main() -> None:
    sys.path.insert(0, str(SCRIPT.parents[1]))  # the script imports hf_zeropp.testing.corpus from the checkout
    destroy = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None
    try:
        for run in sys.argv[1:]:
            sys.argv = [str(SCRIPT), *shlex.split(run)]
            runpy.run_path(str(SCRIPT), run_name="__main__")
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    finally:
        PartialState.destroy_process_group = destroy
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
