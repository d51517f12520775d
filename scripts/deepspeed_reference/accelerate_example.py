"""DeepSpeed itself running Accelerate's own DeepSpeed example shape (tests/launch_scripts/
accelerate_deepspeed_example.py: ``DummyOptim`` / ``DummyScheduler`` chosen from
``accelerator.state.deepspeed_plugin``) under ``accelerate launch`` with an Accelerate YAML of ``distributed_type:
DEEPSPEED`` naming a DeepSpeed config with ``optimizer`` and ``scheduler`` sections
(tests/fixtures/deepspeed/accelerate_example/); writes tests/fixtures/deepspeed/accelerate_example.json, which the
main CI compares the same launch under ``hf-zeropp launch`` with (tests/interop/test_deepspeed_training.py).

Two runs on 2 CPU ranks: the config as it is (DeepSpeed's own Adam kernel), and with ``torch_adam: true`` (DeepSpeed
steps torch's AdamW, as hf_zeropp does); each records the learning rate applied at every optimizer step, the
losses, the evaluation loss and what the script saw (``distributed_type``, the plugin, the classes it built).

    bash scripts/benchmarks/deepspeed_env.sh   # once: .venv-deepspeed
    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -m scripts.deepspeed_reference.accelerate_example   # ~2 min

Accelerate's DeepSpeed path counts one process on a machine without GPUs unless the CPU process group exists before
the ``Accelerator`` (tests/launch_scripts/deepspeed_accelerate.py says why); the example has no such line, so each
worker runs this module with ``--on_cpu SCRIPT ARGS``, which sets that group up and then runs the script unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from .training_runs import FIXTURES, ROOT, _port

FOLDER = FIXTURES / "accelerate_example"
FIXTURE = FIXTURES / "accelerate_example.json"
SCRIPT = "tests/launch_scripts/accelerate_deepspeed_example.py"
# the example's command line: 16 optimizer steps of 2 sequences per rank, the scheduler's warmup 3 of them
ARGUMENTS = ["--max_train_steps", "16", "--num_warmup_steps", "3", "--learning_rate", "1e-2", "--weight_decay", "0.1",
             "--per_device_train_batch_size", "2", "--seed", "0"]


def run(work: Path, torch_adam: bool) -> dict:
    """One ``accelerate launch`` of the example under DeepSpeed; its record."""
    name = "torch_adam" if torch_adam else "deepspeed_adam"
    config = json.loads((FOLDER / "ds_config.json").read_text())
    if torch_adam:
        config["optimizer"]["params"]["torch_adam"] = True
    (work / f"{name}.json").write_text(json.dumps(config))
    yaml_file = work / f"{name}.yaml"
    yaml_file.write_text((FOLDER / "accelerate.yaml").read_text().replace(
        "tests/fixtures/deepspeed/accelerate_example/ds_config.json", str(work / f"{name}.json")))
    record = work / f"{name}_record.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_file),
               "--main_process_port", _port(), "-m", "scripts.deepspeed_reference.accelerate_example", "--on_cpu",
               SCRIPT, *ARGUMENTS, "--record", str(record)]
    subprocess.run(command, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(record.read_text())


def on_cpu(argv: list[str]) -> None:
    """In a worker: the CPU process group first, then the script as ``python SCRIPT ARGS`` runs it."""
    from accelerate.state import PartialState

    PartialState(cpu=True)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if sys.argv[1:2] == ["--on_cpu"]:
        on_cpu(sys.argv[2:])
        return
    import accelerate
    import deepspeed
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(FIXTURE))
    output = Path(parser.parse_args().output)
    with tempfile.TemporaryDirectory() as scratch:
        runs = {name: run(Path(scratch), torch_adam=name == "torch_adam") for name in ("deepspeed_adam", "torch_adam")}
    fixture = {"versions": {"deepspeed": deepspeed.__version__, "accelerate": accelerate.__version__,
                            "torch": torch.__version__, "transformers": transformers.__version__},
               "script": SCRIPT, "arguments": ARGUMENTS, **runs}
    output.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
