#!/usr/bin/env python3
"""The ZeRO++ paper's low-bandwidth result on one machine: 2 emulated nodes x 2 ranks over shaped links.

    sudo .venv/bin/python -m scripts.benchmarks.cluster --out out/bench_cluster          # ~12 min
    sudo .venv/bin/python -m scripts.benchmarks.cluster --out out/bench_cluster --quick  # ~5 min
    python -m scripts.benchmarks.cost_model out/bench_cluster   # the cost model, checked against it (see that file)

For each link rate (100mbit, 300mbit, 1gbit, 3gbit, unshaped) one emulated cluster is built with
hf_zeropp.testing.emulated_cluster (2 network namespaces, 2 gloo ranks each, veth links shaped with tc tbf) and, in that one launch, every
configuration is trained side by side (random token batches of the same shape):

* ``FSDP2``        stock ``torch.distributed.fsdp.fully_shard`` per GPT-2 block + root (FULL_SHARD), no hf_zeropp
* ``ZeRO-3``       ``hf_zeropp.ZeroPPConfig(stage=3)``
* ``+qwZ``         ``quantized_weights=True`` (INT8 block-quantized forward all-gather)
* ``+hpZ``         ``hpz_partition_size="node"`` (backward all-gather stays inside the node)
* ``+qgZ``         ``quantized_gradients=True`` (2-hop INT4 all-to-all instead of the reduce-scatter)
* ``ZeRO++``       ``ZeroPPConfig.preset("zeropp")`` (all three), compiled kernels
* ``ZeRO++ ref``   the same with ``kernel_backend="reference"`` (plain torch quantization; the paper's Table 3)

Named in ``--configs`` only: ``ZeRO-2`` (``stage=2``), and DeepSpeed's own ZeRO-3, its ZeRO-3 releasing every weight
after use (``DeepSpeed ZeRO-3 regather``), hpZ, qwZ and qgZ, run in ``--python``, an interpreter with DeepSpeed
(scripts/benchmarks/deepspeed_env.sh); those that raise on this machine are listed as not run. Each has an ``hf``
twin (``hf DeepSpeed ZeRO-3``, ...): the same ``zero_optimization`` dict given to hf_zeropp, its step divided by
DeepSpeed's in the table's ``÷ DeepSpeed`` column.

All run bf16 weights and bf16 gradient reduction (``mixed_precision="bf16", reduce_dtype="bf16"``; the stock
peer gets the same ``MixedPrecisionPolicy``), fp32 master weights, AdamW.

Model (default): GPT2LMHeadModel from config, n_embd 256, 6 layers, 4 heads, vocab 4096, 128 positions — 5.8 M
parameters, M = 11.6 MB of bf16 weights — with 1 sequence of 128 tokens per rank (512 tokens per step). At
100 Mbit/s one ZeRO-3 step moves ~3 M across each node's link (gloo's ring all-gather and all-reduce based
reduce-scatter, see below), ~2.8 s, against ~0.1 s of compute per rank: communication dominates.

Timing: every configuration gets ``--warmup`` steps, then ``--rounds`` rounds in which each configuration runs
``--steps`` steps (the order rotates every round, so load drift on a shared machine hits all alike). A step's
time is the slowest rank's; the table shows the median over all timed steps and tokens/s = global tokens per step
/ median step time.

Meter cross-check: ``hf_zeropp.comm_stats`` counts LOGICAL bytes (what each rank must deliver to each peer,
algorithm-independent, see hf_zeropp/comm/comm_meter.py). gloo's algorithms put a fixed multiple of that on the wire
between nodes; with g ranks in node order, d per node, a ring crossing every node boundary once:

* all-gather (gloo::allgather, ring): a node sends (g-1)/g of the buffer across, logically d(g-d)/g
  -> wire = logical x (g-1)/(d(g-d))        (2x2: 0.75)
* torch's reduce-scatter (ProcessGroupGloo runs a full ring all-reduce, then keeps its chunk; the stock FSDP2
  peer): 2(g-1)/g across, logically d(g-d)/g -> wire = logical x 2(g-1)/(d(g-d))   (2x2: 1.5)
* all-to-all (pairwise): wire = logical x 1; qgZ's inter-node hop (a group of one rank per node) likewise.
* hf_zeropp's own reduce-scatter: on gloo the cheaper of the two above, an all-to-all of the chunks plus a local
  sum (x 1; 2x2, 4x2) or torch's ring (2x4: 0.875); see hf_zeropp.comm.comm_meter.gloo_reduce_scatter_as_all_to_all.

The benchmark measures these factors once per run (``probe``: each collective alone between counter reads) and
compares, per configuration and node, the expected wire bytes (meter x factor) with the veth counters over the
same steps: TCP payload = tx_bytes - 66 B x tx_packets (Ethernet + IPv4 + TCP-with-timestamps headers; a pure
ACK counts 0). The stock FSDP2 peer has no meter: its logical bytes are derived from its own FSDP2 units with the
meter's rule (padded shard sizes per unit; forward all-gather, backward all-gather unless the unit keeps its
weights after forward — FSDP2's root does by default — and reduce-scatter); the same derivation applied to
hf_zeropp's ZeRO-3 is checked against its meter (``derived_vs_meter`` in results.json).

Where the time goes: ``--breakdown-steps`` extra steps per hf_zeropp configuration run under ``torch.profiler``;
the time inside hf_zeropp's all-gather and reduce-scatter hooks (profiler ranges ``hf_zeropp.comm.qwz.all_gather`` and
``hf_zeropp.comm.qgz.reduce_scatter``) and inside the ``hf_zeropp::*`` quantization kernel ops within them is read from
the recorded events (scripts/benchmarks/breakdown.py).

The regime: every row also gets step / max(unshaped step, wire time), the unshaped step being the configuration's
own on the unshaped link of the same launch (``--links ...,none``), and the header names the CPU and whether it has
native bf16 (a bf16 run on a CPU without it is compute-bound); the speedup targets are judged where the slower
configuration is communication-bound (scripts/benchmarks/analysis.py).

``--compile BACKEND`` also runs every hf_zeropp configuration with its FSDP units compiled
(``hf_zeropp.compile_units``, what ``--torch_compile`` does), named ``<configuration> compiled (<backend>)``, beside
its eager run in the same launch; each run's first warm-up step (the slowest rank's, holding the compile) is
``first_step_s`` in results.json.

Writes ``results.json``, ``results.md`` and ``results.png`` under ``--out``. Needs root, ``ip`` and ``tc``.
The code is in scripts/benchmarks/ (worker, orchestration, analysis, report); this file is the command line.
"""

from __future__ import annotations

import argparse
import sys
import time


from .analysis import analyse, targets
from .compiled import add_compile_option
from .configs import CONFIGS, DEEPSPEED, HF_TWINS, LINKS, ON_REQUEST
from .orchestrate import output_folder, parse_cli, requirements_problem, run_link, run_links
from .report import chart, markdown, write
from .wire import KINDS, expected_node_wire, wire_factors

__all__ = ["CONFIGS", "KINDS", "LINKS", "analyse", "chart", "expected_node_wire", "main", "markdown",  # re-exported
           "requirements_problem", "run_link", "run_links", "targets", "wire_factors", "write"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_cluster", help="folder for results.json/.md/.png")
    parser.add_argument("--quick", action="store_true", help="fewer steps (1 warm-up, 3 rounds x 1 step, 1 breakdown step)")
    parser.add_argument("--links", default=",".join(LINKS), help="comma list of link rates; default %(default)s")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1, help="steps per configuration per round")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=1)
    parser.add_argument("--untied", action="store_true", help="an output head of its own (tie_word_embeddings=False)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--probe-mb", type=float, default=4.0, help="buffer of the gloo probe (on the fastest link)")
    parser.add_argument("--breakdown-steps", type=int, default=2,
                        help="extra steps per hf_zeropp configuration under torch.profiler (time in the all-gather / "
                             "reduce-scatter calls and their kernels); 0 = off")
    add_compile_option(parser)
    args = parse_cli(parser, CONFIGS, {**ON_REQUEST, **DEEPSPEED, **HF_TWINS})
    if args.worker:
        from .worker import worker  # torch, transformers and hf_zeropp: only on the ranks

        worker(args)
        return 0
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 3, 1
        args.breakdown_steps = min(args.breakdown_steps, 1)
    out = output_folder(args, "bench_cluster")
    if out is None:
        return 2
    started = time.monotonic()
    summary = analyse(run_links(args, out), args)
    summary["settings"] = {k: v for k, v in vars(args).items() if k not in ("worker", "result")}
    summary["wall_s"] = time.monotonic() - started
    table = write(summary, args, out)
    print(table)
    print(f"bench_cluster: wrote {out}/results.json, results.md, results.png in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
