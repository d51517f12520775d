"""Gradient and weight fidelity of the qgZ, hybrid-q and qwZ options along a real training trajectory.

    python -m scripts.experiments.fidelity [--topologies 2x2,2x4] [--steps 100,300,550] [--window 8]
                                           [--out out/fidelity] [--candidate NAME ...] [--drive NAME]

A ZeRO-3 fp32 baseline (by default the mini Table 5 recipe, ``recipes/gpt350m_pile/mini/zero3.yaml``, through
ZeroPPTrainer, with the recipe's global batch at every topology) trains on emulated nodes: one gloo process per
rank, ``LOCAL_WORLD_SIZE`` = ranks per node. In each measured window (``--window`` consecutive steps starting at
each of ``--steps``) every FSDP unit's reduce-scatter input — the ranks' true, unreduced gradients — is also reduced
by each candidate qgZ configuration, and every forward all-gather is also run by each candidate qwZ; the baseline
keeps the exact results, so every candidate is measured on the same gradients and weights.

Per parameter class (matrices, embeddings, 1-D) the script reports the relative L2 error ||q - x|| / ||x|| and the
cosine of each candidate's result q against the exact one x, averaged over the measured steps, and for gradients
also the relative error of their sum over each window, ||sum(q - x)|| / ||sum(x)||: what a momentum-like optimizer
state accumulates, where error feedback and stochastic rounding act. The horizon table follows that sum through each
window, after 1, 2, 4, ... steps: an error that changes sign from step to step shrinks against the summed gradient as
the horizon grows, a repeated one (a bias) does not.

Adam does not see the gradient as L2 does: it divides each element by the root of its own second moment, so an error
of the same L2 size harms far more when it lands on elements whose gradients are small. The "Adam-normalized"
columns compare each gradient as the baseline's optimizer step would normalize it, g / (sqrt(v_hat(g)) + eps),
with v_hat(g) the second moment that step computes from its previous state and g itself (gradient clipping
included; see AdamNormalizer): the error of the update direction rather than of the gradient. An earlier version
weighed the error by the exact run's 1 / sqrt(v_hat) of the step before; where an element's gradient had been zero
(the embedding row of a token not yet seen, any element in the first steps) that weight is 1 / eps, and a few such
elements decided the whole column.

The width-rule table isolates the choice of per-block bit widths on the inter-node hop: one quantization of the exact
reduced shard (1-D slices left out, Hadamard 64, the candidates' block size, 4.125 bits per value on average, as
qgZ's INT4 hop) with the fixed width, with ``gradient_bit_allocation``'s rule (wider where the block's absmax is
larger: least L2 error), with that rule held to at least the fixed width on every block that is not all zero (so the
only bits that move are those the fixed format spends on zero blocks: which part of the gain is free), with it held
to 2 bits (``gradient_bit_allocation_floor: 2``: no nonzero block is sent as zeros), with a rule both ends of the
hop could follow at no extra byte (the block's absmax over the root of a moving average of its own past squared
absmax: wider where a block is larger than it usually is), and with
an oracle no sender has (absmax over the block's RMS of the owner's sqrt(v): wider where a block is larger than
Adam expects, what Adam's normalization asks for). Deterministic (seeded); minutes on 2 cores.

The table of where the Adam-normalized error lies splits it between the "surprising" elements (the exact gradient
beyond SURPRISE times the root of the run's own second moment before the step: Adam normalizes them to about
sqrt((1 - beta2**t) / (1 - beta2)), the rest to about 1) and the others. An option whose error concentrates there
delivers too little exactly where the run's second moment has fallen behind the gradient. In a driven run the
delivery table says whether the driving option had starved those elements before the step: per element, moving
averages with Adam's beta2 of the energy it delivered and of the exact energy (what the run's v holds against what
the exact run's would), the share of steps it delivered an exact 0 where the gradient was not 0, and the share of its
Adam-normalized error that lies on the elements it had given less than half their exact energy.

The hybrid rows measure hybrid sharding's gradient path on the same gradients: preset hybrid-q reduce-scatters each
unit exactly inside the node and averages the node partial sums across nodes with a block-quantized (INT4 by
default) reduce-scatter and all-gather, and preset hybrid does that all-reduce in fp32 (FSDP2's HSDP). Its FSDP2
shards a unit over one node's ranks, so the blocks fall on that layout of the unit's buffer: HybridReduceScatter
lays each rank's unreduced gradients out so, runs the engine's own cross-node all-reduce, and cuts this rank's world
shard from the result. tests/scripts/test_fidelity.py checks the layout and the result against the engine's hybrid-q.
Their cross-node bytes are the all-reduce's alone (no weight crosses nodes under hybrid sharding); the fp32 row equals
the exact reduce-scatter to fp32 rounding, a check of the emulation.

``--candidate`` measures only the named gradient rows (after ZeRO++'s own), which makes long windows affordable.
``--drive`` trains on one candidate's results instead of the exact ones, so every candidate is measured along that
candidate's own trajectory rather than the baseline's, and normalized by that run's Adam state (qgZ only: forward
weights stay exact, so the run is the engine's qgZ-only training, which tests/scripts/test_fidelity.py checks). An
option can look harmless on the baseline's trajectory and not on its own: Adam's second moment adapts to what the option
delivers, e.g. shrinks where blocks keep getting no bits. Every run reports the validation loss where it stops, so a
driven run and the baseline on the same seed and batches compare in loss too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_zeropp.testing.spawn import run_distributed

from .candidates import GRADIENT_CANDIDATES
from .report import markdown, summarize
from .run import run_rank

ROOT = Path(__file__).resolve().parents[3]


def parse_topology(text: str) -> tuple[int, int]:
    nodes, _, per_node = text.partition("x")
    if not (nodes.isdigit() and per_node.isdigit()) or int(nodes) < 2:
        raise SystemExit(f"--topologies entry {text!r} must be NODESxRANKS_PER_NODE with at least 2 nodes, e.g. 2x2")
    return int(nodes), int(per_node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes/gpt350m_pile/mini/zero3.yaml"))
    parser.add_argument("--topologies", default="2x2,2x4", help="NODESxRANKS_PER_NODE, comma-separated")
    parser.add_argument("--steps", default="100,300,550", help="first (0-based) step of each measured window")
    parser.add_argument("--window", type=int, default=8, help="consecutive steps measured per window")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    parser.add_argument("--candidate", action="append", default=None, metavar="NAME",
                        help="measure only these gradient candidates (repeat the flag; exact row names); the first "
                             f"row, {next(iter(GRADIENT_CANDIDATES))!r}, is always measured. Default: every row")
    parser.add_argument("--drive", default=None, metavar="NAME",
                        help="train on this gradient candidate's results instead of the exact ones, measuring every "
                             "candidate along its trajectory (qgZ only: the forward weights stay exact); it is "
                             "measured too. Default: the exact baseline")
    parser.add_argument("--out", default="out/fidelity")
    args = parser.parse_args(argv)
    reference = next(iter(GRADIENT_CANDIDATES))
    named = [("--candidate", name) for name in args.candidate or ()]
    if args.drive is not None:
        named.append(("--drive", args.drive))
    for flag, name in named:
        if name not in GRADIENT_CANDIDATES:
            raise SystemExit(f"{flag} {name!r} is not a row of the table; choose from "
                             + ", ".join(repr(name) for name in GRADIENT_CANDIDATES))
    candidates = list(GRADIENT_CANDIDATES) if args.candidate is None else [
        reference, *dict.fromkeys(name for name in [*args.candidate, args.drive] if name not in (reference, None))]
    starts = sorted(int(s) for s in args.steps.split(","))
    if args.window < 1 or any(b < a + args.window for a, b in zip(starts, starts[1:])):
        raise SystemExit(f"--steps {args.steps} with --window {args.window}: windows must not overlap")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report, results = [], {}
    for text in args.topologies.split(","):
        nodes, per_node = parse_topology(text)
        world = nodes * per_node
        raw = run_distributed(run_rank, world, args.recipe, starts, args.window, args.global_batch,
                              str(out / f"run_{text}"), candidates, args.drive, node_size=per_node,
                              timeout=3600)[0]
        results[text] = summarize(raw)
        report.append(markdown(f"{nodes} nodes x {per_node} ranks", results[text]))
        print(report[-1], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(report))
    print(f"wrote {out / 'results.md'}")
    return 0
