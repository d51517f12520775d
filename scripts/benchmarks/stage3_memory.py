#!/usr/bin/env python3
"""Per-rank peak memory of ZeRO-3 for a live-weights budget, DeepSpeed's engine against hf_zeropp given the same
DeepSpeed config, on CPU (gloo): the high-water mark of each rank's resident set (``VmHWM``, reset after the first
step so that the full model built before sharding does not count) over the training steps after the first, minus
its resident set just before the model is built, so the interpreter and the imports (DeepSpeed's are larger) do not
count.

    python -m scripts.benchmarks.stage3_memory --python .venv-deepspeed/bin/python

Each (engine, budget) runs in a launch of its own (``torch.distributed.run``, ``--ranks`` processes), so no run
inherits another's high-water mark. The model is the cluster benchmark's GPT-2 (fp32, AdamW). Prints a markdown
table: the budget, each engine's peak per rank (MB, the largest over ranks) and hf_zeropp's over DeepSpeed's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> the zero_optimization keys of the budget (the rest: DeepSpeed's defaults, in both engines)
BUDGETS = {
    "DeepSpeed's defaults (1e9, 1e9)": {},
    "root + 2 blocks (max_live 5.2e6)": {"stage3_max_live_parameters": 5_200_000},
    "regather (0, 0)": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
}
ENGINES = ("DeepSpeed", "hf_zeropp")


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _high_water_mb() -> float:
    """VmHWM: the resident set's high-water mark since the last reset (``clear_refs`` 5)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1e3


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, **BUDGETS[args.budget]}}
    if args.engine == "DeepSpeed":
        import deepspeed  # noqa: F401  (imported before the baseline: its import is not the model's memory)
    before = _rss_mb()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=320, n_layer=6, n_head=4))
    if args.engine == "DeepSpeed":
        import deepspeed

        model, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                         config={**config, "zero_allow_untested_optimizer": True,
                                                 "steps_per_print": 10**9})
    else:
        hf_zeropp.shard_model(model, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        if step == 1:  # from here the high-water mark is training's, not the full model built before sharding
            Path("/proc/self/clear_refs").write_text("5")
        ids = torch.randint(0, 8192, (1, 128), generator=generator)
        if args.engine == "DeepSpeed":
            model.backward(model(input_ids=ids, labels=ids).loss)
            model.step()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = _high_water_mb() - before
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(peaks))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="an interpreter with deepspeed (deepspeed_env.sh)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--budget", choices=list(BUDGETS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rows = ["| budget | DeepSpeed MB/rank | hf_zeropp MB/rank | hf_zeropp / DeepSpeed |", "|---|---:|---:|---:|"]
    for budget in BUDGETS:
        peaks = {}
        for engine in ENGINES:
            with tempfile.TemporaryDirectory() as folder:
                result = Path(folder) / "peaks.json"
                subprocess.run([args.python, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={args.ranks}", "-m", "scripts.benchmarks.stage3_memory", "--worker",
                                "--engine", engine, "--budget", budget, "--steps", str(args.steps), "--result",
                                str(result)], env=env, check=True)
                peaks[engine] = max(json.loads(result.read_text()))
        rows.append(f"| {budget} | {peaks['DeepSpeed']:.0f} | {peaks['hf_zeropp']:.0f} | "
                    f"{peaks['hf_zeropp'] / peaks['DeepSpeed']:.2f} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
