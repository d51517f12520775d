"""Soak test: train a small GPT-2 with ZeRO++ (qwZ + hpZ + qgZ) for many steps on 4 CPU
processes (2 emulated nodes x 2) and check that resident memory stays flat after warm-up — no growth of comm
buffers, hpZ secondary shards, meters or autograd state from step to step.

    .venv/bin/python scripts/soak.py                       # 500 steps, RSS every 25 steps, warm-up 100 steps
    .venv/bin/python scripts/soak.py --steps 2000 --output soak.json

Every ``--interval`` steps each rank samples its RSS (psutil) and the number of live torch tensors (gc); rank 0
prints one line with every rank's figures. At the end it prints, per rank, the RSS at the end of warm-up, at the
end, the growth between them, the spread after warm-up and a least-squares slope (KiB per 100 steps), and exits 1
if any rank grew by more than ``--max-growth-mib`` or its live-tensor count changed after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_zeropp.testing.spawn import run_distributed  # noqa: E402

MIB = 1024 * 1024


def _live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance on some torch objects warns about deprecated attributes
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _batch(sequences: torch.Tensor, step: int, per_rank: int) -> torch.Tensor:
    """This rank's slice of a seeded random pick of byte-level sequences of the standard library's source."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    picks = torch.randint(0, len(sequences), (world * per_rank,), generator=torch.Generator().manual_seed(step))
    return sequences[picks].view(world, per_rank, -1)[rank]


def _soak(options: dict) -> dict:
    import psutil
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp
    from hf_zeropp.testing.corpus import byte_sequences

    torch.manual_seed(0)
    vocab, seq = 256, options["seq"]
    sequences = byte_sequences(1_000_000, seq)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=options["n_embd"],
                                       n_layer=options["n_layer"], n_head=2, bos_token_id=0, eos_token_id=0))
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.preset(options["preset"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    process = psutil.Process()
    samples, losses = [], []
    start = time.perf_counter()
    for step in range(1, options["steps"] + 1):
        ids = _batch(sequences, step, options["batch"])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % options["interval"] == 0 or step == 1:
            hf_zeropp.comm_stats(model, reset=True)  # the meter's counters, read as a trainer's callback would
            gc.collect()
            sample = {"step": step, "rss": process.memory_info().rss, "tensors": _live_tensors(),
                      "seconds": time.perf_counter() - start}
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sample)
            if dist.get_rank() == 0:
                rss = "  ".join(f"{s['rss'] / MIB:7.1f}" for s in everyone)
                tensors = " ".join(str(s["tensors"]) for s in everyone)
                print(f"step {step:5d}  {sample['seconds']:7.1f} s  loss {losses[-1]:.3f}  RSS MiB per rank: {rss}"
                      f"  live tensors: {tensors}", flush=True)
            samples.append(sample)
    return {"samples": samples, "first_loss": losses[0], "last_loss": sum(losses[-20:]) / min(20, len(losses)),
            "techniques": hf_zeropp.active_techniques(model)}


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per step."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    denominator = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / denominator if denominator else 0.0


def summarize(results: list[dict], warmup: int) -> list[dict]:
    rows = []
    for rank, result in enumerate(results):
        after = [s for s in result["samples"] if s["step"] >= warmup]
        rss = [s["rss"] for s in after]
        rows.append({
            "rank": rank,
            "rss_first_mib": result["samples"][0]["rss"] / MIB,
            "rss_warm_mib": after[0]["rss"] / MIB,
            "rss_end_mib": after[-1]["rss"] / MIB,
            "growth_after_warmup_mib": (after[-1]["rss"] - after[0]["rss"]) / MIB,
            "spread_after_warmup_mib": (max(rss) - min(rss)) / MIB,
            "slope_kib_per_100_steps": _slope([(s["step"], s["rss"]) for s in after]) * 100 / 1024,
            "tensors_warm": after[0]["tensors"],
            "tensors_end": after[-1]["tensors"],
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100, help="steps before the reference RSS sample")
    parser.add_argument("--interval", type=int, default=25)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--preset", default="zeropp")
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--max-growth-mib", type=float, default=8.0)
    parser.add_argument("--output", type=Path, help="write samples and summary as JSON")
    args = parser.parse_args()
    if args.warmup % args.interval:
        parser.error("--warmup must be a multiple of --interval (RSS is sampled every --interval steps)")

    options = {k: getattr(args, k) for k in ("steps", "interval", "preset", "n_embd", "n_layer", "seq", "batch")}
    print(f"soak: {args.steps} steps, preset {args.preset}, {args.world} ranks = {args.world // args.node_size} "
          f"nodes x {args.node_size}, GPT-2 n_embd={args.n_embd} n_layer={args.n_layer}, batch {args.batch}x{args.seq}"
          f" per rank", flush=True)
    started = time.perf_counter()
    results = run_distributed(_soak, args.world, options, node_size=args.node_size, timeout=3600)
    wall = time.perf_counter() - started
    rows = summarize(results, args.warmup)
    print(f"\ntechniques {results[0]['techniques']}; loss {results[0]['first_loss']:.3f} -> "
          f"{results[0]['last_loss']:.3f} (mean of the last 20 steps); wall {wall:.0f} s")
    print(f"{'rank':>4} {'RSS@1':>8} {'RSS@' + str(args.warmup):>9} {'RSS@end':>8} {'growth':>8} {'spread':>8} "
          f"{'slope':>14} {'tensors':>11}")
    for row in rows:
        print(f"{row['rank']:>4} {row['rss_first_mib']:8.1f} {row['rss_warm_mib']:9.1f} {row['rss_end_mib']:8.1f} "
              f"{row['growth_after_warmup_mib']:+8.2f} {row['spread_after_warmup_mib']:8.2f} "
              f"{row['slope_kib_per_100_steps']:+9.1f} KiB/100 {row['tensors_warm']:>5}->{row['tensors_end']}")
    print("(MiB; growth = RSS at the end minus RSS after warm-up; spread = max - min after warm-up; slope = "
          "least-squares fit after warm-up)")
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "summary": rows,
                                           "samples": [r["samples"] for r in results], "wall_seconds": wall},
                                          indent=2))
    bad = [r for r in rows if r["growth_after_warmup_mib"] > args.max_growth_mib or r["tensors_end"] != r["tensors_warm"]]
    if bad:
        print(f"FAIL: ranks {[r['rank'] for r in bad]} grew by more than {args.max_growth_mib} MiB after warm-up or "
              f"hold a different number of live tensors")
        return 1
    print(f"OK: every rank's RSS grew by at most {args.max_growth_mib} MiB after warm-up and its live-tensor count "
          f"stayed constant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
