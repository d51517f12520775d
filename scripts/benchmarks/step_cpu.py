#!/usr/bin/env python3
"""CPU time per training step and rank of hf_zeropp presets, side by side, with no network shaping.

    .venv/bin/python -m scripts.benchmarks.step_cpu --presets hybrid,hybrid-q --world 8 --node-size 4   # ~1 min
    .venv/bin/python -m scripts.benchmarks.step_cpu --presets hybrid,hybrid-q --profile                  # + hot spots
    .venv/bin/python -m scripts.benchmarks.step_cpu --presets zero3,zeropp --world 4 --node-size 2 --precision fp32 \
        --compile inductor                                            # each preset eager and compiled, side by side

On the emulated cluster every rank shares the machine's cores, so a preset's step can only be as short as the CPU
time all ranks spend in it divided by the cores; a collective's bytes cost CPU there too (gloo's threads). This
measures that cost: each preset trains the cluster bench's default GPT-2 (n_embd 320, 6 layers, vocab 8192, 1 x
128 tokens per rank, bf16 unless ``--precision fp32``) on ``--world`` gloo processes on this machine,
``--node-size`` ranks per emulated node. After 2 warm-up steps it reports, per rank, the process CPU time per step (every thread: compute, hf_zeropp's own
work and gloo's) and the wall time per step, over ``--steps`` steps. ``--profile`` also prints rank 0's top
functions by main-thread CPU time (``cProfile`` with ``time.thread_time``). ``--compile BACKEND`` also runs every
preset with its FSDP units compiled by ``hf_zeropp.compile_units`` (what ``--torch_compile`` does), right after the
eager run of the same preset, and reports each run's first step (wall, slowest rank), which holds the compile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from hf_zeropp import ZeroPPConfig, shard_model
from hf_zeropp.testing.spawn import run_distributed

from .compiled import add_compile_option, compile_if_asked, eager_and_compiled, run_name


def _measure(runs: list[tuple[str, str | None]], node_size: int, steps: int, profile: bool,
             precision: str) -> dict[str, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    results = {}
    for preset, backend in runs:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=320, n_layer=6, n_head=4,
                                           bos_token_id=0, eos_token_id=0))
        model = shard_model(model, ZeroPPConfig.preset(preset, node_size=node_size, reduce_dtype=precision,
                                                       mixed_precision="no" if precision == "fp32" else precision))
        compile_if_asked(model, backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 8192, (1, 128), generator=torch.Generator().manual_seed(dist.get_rank()))

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        dist.barrier()
        first = time.perf_counter()
        step()
        first = _slowest(time.perf_counter() - first)
        step()
        dist.barrier()
        profiler = cProfile.Profile(time.thread_time) if profile and dist.get_rank() == 0 else None
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            step()
        if profiler is not None:
            profiler.disable()
        cpu = (time.process_time() - cpu) / steps
        dist.barrier()
        hot = None
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            hot = text.getvalue()
        results[run_name(preset, backend)] = {"cpu": cpu, "wall": (time.perf_counter() - wall) / steps, "first": first,
                                           "hot": hot}
    return results


def _slowest(seconds: float) -> float:
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="hybrid,hybrid-q", help="comma list of presets")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--node-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="rank 0's hot spots (makes rank 0 slower)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="compute and gradient reduction dtype; default %(default)s")
    add_compile_option(parser)
    args = parser.parse_args()
    runs = eager_and_compiled(args.presets.split(","), args.compile)
    names = [run_name(*run) for run in runs]
    ranks = run_distributed(_measure, args.world, runs, args.node_size, args.steps, args.profile, args.precision,
                            node_size=args.node_size, timeout=1800)
    print("| run | CPU ms per step, median of ranks (min-max) | wall ms per step | first step, s |")
    print("|---|---:|---:|---:|")
    for name in names:
        cpu = [rank[name]["cpu"] * 1e3 for rank in ranks]
        print(f"| {name} | {statistics.median(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | "
              f"{ranks[0][name]['wall'] * 1e3:.0f} | {ranks[0][name]['first']:.1f} |")
    for name in names:
        if ranks[0][name]["hot"]:
            print(f"\n{name}, rank 0, main-thread CPU:\n{ranks[0][name]['hot']}")


if __name__ == "__main__":
    main()
