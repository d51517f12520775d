"""DeepSpeed itself training the configs in tests/fixtures/deepspeed/configs through a stock Trainer script and a
stock Accelerate script (tests/launch_scripts/deepspeed_trainer.py, deepspeed_accelerate.py), on 4 CPU ranks and on
one process with the same global batch; writes tests/fixtures/deepspeed/training_runs.json, which the main CI
compares hf_zeropp's runs of the same scripts with (tests/interop/test_deepspeed_training.py).

Per path and config: the learning rate applied at every optimizer step, the logged learning rate (Trainer), the
losses and gradient norms, at world size 4 and 1, and at world size 4 once more with ``torch_adam: true`` in the
optimizer section (DeepSpeed then steps torch's Adam/AdamW, as hf_zeropp does, instead of its own fused kernel). How
far DeepSpeed's 4-rank run lies from its own single process and from its own torch-Adam run is the tolerance
hf_zeropp's 4-rank run is held to.

    bash scripts/benchmarks/deepspeed_env.sh   # once: .venv-deepspeed
    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -m scripts.deepspeed_reference.training_runs   # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed"
CONFIGS = FIXTURES / "configs"
SCRIPTS = ROOT / "tests" / "launch_scripts"
# The Transformers documentation's configs write "auto" optimizer betas and eps, which only the Trainer fills
# (Accelerate refuses them: tests/interop/test_deepspeed_training.py checks that hf_zeropp refuses them the same way)
TRAINER_ONLY = ("zero3_docs", "zero2_docs", "zero3_no_offload")
STEPS, WARMUP, LR, WEIGHT_DECAY, MICRO_BATCH = 12, 4, 1e-2, 0.01, 2


def trainer_arguments(world_size: int) -> list[str]:
    """The Trainer script's arguments for ``world_size`` processes: the same global batch at every world size."""
    return ["--max_steps", str(STEPS), "--warmup_steps", str(WARMUP), "--learning_rate", str(LR), "--weight_decay",
            str(WEIGHT_DECAY), "--per_device_train_batch_size", str(MICRO_BATCH * 4 // world_size),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--seed", "0"]


def accelerate_arguments(world_size: int) -> list[str]:
    return ["--batch_size", str(MICRO_BATCH * 4 // world_size)]


def configs(path: str) -> list[Path]:
    found = sorted(CONFIGS.glob("*.json"))
    return [c for c in found if path == "trainer" or c.stem not in TRAINER_ONLY]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def with_torch_adam(config_files: list[Path], work: Path) -> list[Path]:
    """The configs with ``torch_adam: true`` in their optimizer section, written under ``work`` by the same names."""
    folder = work / "torch_adam"
    folder.mkdir(exist_ok=True)
    written = []
    for path in config_files:
        config = json.loads(path.read_text())
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        (folder / path.name).write_text(json.dumps(config))
        written.append(folder / path.name)
    return written


def run(path: str, world_size: int, work: Path, torch_adam: bool = False) -> dict:
    record = work / f"{path}_{world_size}{'_torch_adam' if torch_adam else ''}.json"
    script = SCRIPTS / f"deepspeed_{path}.py"
    config_files = with_torch_adam(configs(path), work) if torch_adam else configs(path)
    extra = (["--output_dir", str(work / f"{path}_{world_size}")] + trainer_arguments(world_size) if path == "trainer"
             else accelerate_arguments(world_size))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--master_port",
               _port(), str(script), "--deepspeed_configs", *map(str, config_files), "--record", str(record), *extra]
    # ACCELERATE_USE_DEEPSPEED: what `accelerate launch` with a DeepSpeed YAML sets for its workers
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_DEEPSPEED": "true"}
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return json.loads(record.read_text())


def main() -> None:
    import deepspeed
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(FIXTURES / "training_runs.json"))
    output = Path(parser.parse_args().output)
    fixture = {"versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                            "transformers": transformers.__version__},
               "trainer_arguments": trainer_arguments(4), "steps": STEPS}
    with tempfile.TemporaryDirectory() as scratch:
        for path in ("trainer", "accelerate"):
            runs = {"world4": run(path, 4, Path(scratch)), "world1": run(path, 1, Path(scratch)),
                    "world4_torch_adam": run(path, 4, Path(scratch), torch_adam=True)}
            fixture[path] = {name: {key: records[name] for key, records in runs.items()} for name in runs["world4"]}
    output.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
