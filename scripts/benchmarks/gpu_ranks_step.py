#!/usr/bin/env python3
"""One GPU, 4 ranks: the training step of GPT-2 355M (bf16) under ZeRO-3, ZeRO++ (qwZ INT8 + hpZ + qgZ INT4),
hybrid-q, and ZeRO++ with ``cpu_offload``, with the ranks as threads of one process
(:mod:`hf_zeropp.testing.threaded_ranks`, a CUDA stream each; 2 nodes x 2 ranks through ``node_size``, as
tests/testing/test_threaded_ranks.py does): step time, peak memory and the share of the step spent in hf_zeropp's
kernels.

    python -m scripts.benchmarks.gpu_ranks_step --out out/gpu_ranks_step      # on a GPU, kernels built (~1.5 min)
    python -m scripts.benchmarks.gpu_ranks_step --device cpu --hidden 64 --layers 2 --vocab 256 --seq 32 \
        --batch 2 --steps 2 --out /tmp/gpu_ranks_step                          # dry run

What the numbers are, and are not:

* step: median of ``--steps`` steps (after ``--warmup``) of forward, backward and AdamW on every rank, from a
  barrier to a barrier once the device is synchronized. The four ranks share one GPU, and the threaded process group
  copies each collective's data in one thread and returns only once it is written, so communication never overlaps
  compute: a step here is four ranks' compute on one device plus those copies, not the step of 4 GPUs.
* device peak: ``torch.cuda.max_memory_allocated`` over the warm-up and timed steps; one device, so the four ranks
  together. rank state: the most any rank holds on the device between steps as its own shards of the parameters,
  gradients and AdamW state (exact, from its local tensors; gathered weights, activations and buffers excluded).
* kernel shares: ``--profile-steps`` more steps under ``torch.profiler``, started on rank 0 only; CUPTI records the
  CUDA kernels of every rank, so both shares are of the four ranks together: CUDA time of kernels whose name contains
  "hf_zeropp" over all CUDA kernel time (memcpy, memset and the record_function ranges drawn on the GPU's timeline
  excluded: hf_zeropp.comm.qgz.reduce_scatter spans a whole collective, not a kernel), and over the median step's wall
  time. On CPU
  the profiler records rank 0's thread alone: the second share is rank 0's CPU time in its outermost ``hf_zeropp::``
  ops over the step, and the first is n/a.

Every configuration runs on its own; one that fails is reported with its error and the others still run. Writes
``gpu_ranks_step.json`` and ``gpu_ranks_step.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import hf_zeropp
from hf_zeropp._compat import local_tensor
from hf_zeropp.testing.threaded_ranks import run_threaded

from . import breakdown
from .report import save
from .timing import synchronized_seconds

NODES, NODE_SIZE = 2, 2
WORLD = NODES * NODE_SIZE
GIB = 2**30
CONFIGURATIONS = {  # name: (preset, options beside it)
    "ZeRO-3": ("zero3", {}),
    "ZeRO++": ("zeropp", {}),
    "hybrid-q": ("hybrid-q", {}),
    "ZeRO++ cpu_offload": ("zeropp", {"cpu_offload": True}),
}


def template_model(args):
    """GPT-2 from config with seed 0 (hidden 1024 x 24 layers: 355M), built once; every rank shards a copy."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=max(args.seq, 1024), n_embd=args.hidden,
                                      n_layer=args.layers, n_head=max(1, args.hidden // 64),
                                      bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def rank_run(template, preset: str, options: dict, args, device: torch.device) -> dict:
    """On one rank thread: shard, warm up, time the steps, then profile steps (rank 0 holds the profiler)."""
    rank = dist.get_rank()
    config = hf_zeropp.ZeroPPConfig.preset(preset, node_size=NODE_SIZE, mixed_precision="bf16",
                                           reduce_dtype="bf16", **options)  # as scripts/benchmarks/worker.py
    model = hf_zeropp.shard_model(copy.deepcopy(template), config, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=tokens).to(device)
               for _ in range(args.warmup + args.steps + args.profile_steps)]
    losses = []

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)  # first, so the gradients of the last step stay to be counted
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    dist.barrier()
    if rank == 0 and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids in batches[:args.warmup]:
        step(ids)
    seconds = []
    for ids in batches[args.warmup:args.warmup + args.steps]:
        dist.barrier()
        seconds.append(synchronized_seconds(lambda ids=ids: (step(ids), dist.barrier()), device))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    state = rank_state_bytes(model, optimizer, device)
    profiled = profiled_kernel_seconds(lambda: [step(ids) for ids in batches[args.warmup + args.steps:]], device, rank)
    return {"step_seconds": seconds, "device_peak_bytes": peak, "rank_state_bytes": state,
            "profile": profiled, "last_loss": float(losses[-1]),
            "implementations": hf_zeropp.comm_stats(model)["implementations"]}


def rank_state_bytes(model, optimizer, device: torch.device) -> int:
    """Bytes of this rank's own parameter, gradient and optimizer-state shards that live on ``device``."""
    tensors = [local_tensor(p) for p in model.parameters()]
    tensors += [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local_tensor(value) for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)


def activities(device: torch.device) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")


def start_the_profiler_here(device: torch.device) -> None:
    """One short profile in the main thread: Kineto registers with the thread of the first profiler, and one first
    started in a rank thread says "External init callback must run in same thread as registerClient"."""
    from torch.profiler import profile

    with profile(activities=activities(device)):
        torch.ones(1, device=device).add_(1)


def profiled_kernel_seconds(run, device: torch.device, rank: int) -> dict | None:
    """``run()`` on every rank, under torch.profiler on rank 0 (one profiler per process); rank 0 returns the
    kernel seconds, or the profiler's error: a profiler that fails leaves the steps and collectives to run."""
    from torch.profiler import profile

    dist.barrier()
    profiler, failure = None, None
    if rank == 0:
        try:
            profiler = profile(activities=activities(device))
            profiler.start()
        except Exception as error:  # noqa: BLE001 -- reported in the results instead of the shares
            profiler, failure = None, f"{type(error).__name__}: {error}"
    synchronized_seconds(lambda: (run(), dist.barrier()), device)
    if rank != 0:
        return None
    if profiler is None:
        return {"error": failure}
    try:
        profiler.stop()
        return kernel_seconds(profiler.events(), device)
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}"}


def kernel_seconds(events, device: torch.device) -> dict:
    """hf_zeropp's kernel seconds (per kernel and in all) and, on CUDA, all CUDA kernel seconds."""
    if device.type != "cuda":  # CPU: the outermost hf_zeropp:: ops, as the cluster benchmark's breakdown counts them
        ours = breakdown.attribute(events)["kernels"]
        return {"hf_zeropp_seconds": sum(ours.values()), "all_kernel_seconds": None, "hf_zeropp_kernels": ours}
    from torch.autograd import DeviceType

    # a record_function range shown on the GPU's timeline (hf_zeropp.comm.qgz.*), no kernel
    def annotation(event) -> bool:
        return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("hf_zeropp.")

    cuda = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in cuda if not annotation(e)]
    by_name: dict[str, float] = {}
    for event in kernels:
        short = re.split(r"[<(]", re.sub(r"^void |\(anonymous namespace\)::", "", event.name))[0]
        by_name[short] = by_name.get(short, 0.0) + event.time_range.elapsed_us() / 1e6
    ours = {name: seconds for name, seconds in by_name.items() if "hf_zeropp" in name}
    largest = dict(sorted(by_name.items(), key=lambda item: -item[1])[:12])
    return {"hf_zeropp_seconds": sum(ours.values()), "all_kernel_seconds": sum(by_name.values()),
            "hf_zeropp_kernels": ours, "largest_kernels": largest, "kernel_events": len(kernels),
            "annotation_events_left_out": len(cuda) - len(kernels),
            "streams": len({e.device_resource_id for e in kernels})}


def summary(ranks: list[dict], args) -> dict:
    rank0 = ranks[0]
    step = statistics.median(rank0["step_seconds"])
    profile = rank0["profile"]
    result = {"step_ms": 1e3 * step, "step_ms_each": [1e3 * s for s in rank0["step_seconds"]],
              "device_peak_gib": None if rank0["device_peak_bytes"] is None else rank0["device_peak_bytes"] / GIB,
              "rank_state_gib": [r["rank_state_bytes"] / GIB for r in ranks],
              "last_loss": [r["last_loss"] for r in ranks], "implementations": rank0["implementations"],
              "profile": profile}
    if "error" not in profile:
        per_step = profile["hf_zeropp_seconds"] / args.profile_steps
        result["share_of_kernel_time"] = (profile["hf_zeropp_seconds"] / profile["all_kernel_seconds"]
                                          if profile["all_kernel_seconds"] else None)
        result["share_of_step"] = per_step / step
    return result


def markdown(report: dict) -> str:
    a = report["args"]
    header = (f"Device: {report['device_name']}; torch {report['torch']}; kernels: {report['kernel_backend']}; "
              f"GPT-2 {report['parameters'] / 1e6:.1f}M (hidden {a['hidden']} x {a['layers']} layers), bf16, AdamW; "
              f"{WORLD} ranks as threads ({NODES} nodes x {NODE_SIZE}); batch {a['batch']} x {a['seq']} tokens per "
              f"rank; median of {a['steps']} steps after {a['warmup']}")
    columns = ("| configuration | step ms | device peak GiB (4 ranks) | largest rank state GiB | hf_zeropp / CUDA "
               "kernel time | hf_zeropp kernels / step |")
    lines = [header, "", columns, "|---|---:|---:|---:|---:|---:|"]
    errors = []

    def share(value) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    for name, r in report["results"].items():
        if "error" in r:
            lines.append(f"| {name} | failed | | | | |")
            errors.append(f"* {name}: {r['error']}")
            continue
        peak = "n/a" if r["device_peak_gib"] is None else f"{r['device_peak_gib']:.2f}"
        lines.append(f"| {name} | {r['step_ms']:.1f} | {peak} | {max(r['rank_state_gib']):.3f} | "
                     f"{share(r.get('share_of_kernel_time'))} | {share(r.get('share_of_step'))} |")
        if "error" in r["profile"]:
            errors.append(f"* {name}: profiler: {r['profile']['error']}")
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated, from the defaults")
    parser.add_argument("--out", default="out/gpu_ranks_step")
    args = parser.parse_args()
    if args.profile_steps < 1:
        parser.error("--profile-steps must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    backend = hf_zeropp.kernels.active_backend(device)  # built here once, not in four rank threads
    start_the_profiler_here(device)
    template = template_model(args)
    report = {"device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "kernel_backend": backend, "args": vars(args),
              "parameters": sum(p.numel() for p in template.parameters()), "results": {}}
    for name in args.configs.split(","):
        preset, options = CONFIGURATIONS[name]
        try:
            ranks = run_threaded(rank_run, WORLD, template, preset, options, args, device,
                                 own_streams=device.type == "cuda")
            result = summary(ranks, args)
            print(f"{name}: {result['step_ms']:.1f} ms per step", flush=True)
        except Exception as error:  # noqa: BLE001 -- one configuration's failure is its row; the others still run
            text = str(error).strip()
            result = {"error": text.splitlines()[-1], "traceback": text}
            print(f"{name}: failed: {text}", flush=True)
        report["results"][name] = result
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save(Path(args.out), "gpu_ranks_step", report, markdown(report))


if __name__ == "__main__":
    main()
