"""Communication and per-rank memory per training step, measured on local gloo processes.

    python -m scripts.benchmarks.comm_table [--configs zeropp|stages] [--world 4 --node-size 2] [--json out.json]

Runs one measured optimizer step of a GPT-2-style model (bf16 weights, bf16 gradient reduction, as in the paper's
M) on processes that emulate ``world / node_size`` nodes.

``--configs zeropp`` (default): ZeRO-3, each ZeRO++ technique alone and all three; prints the bytes each rank sent
to other nodes per collective as a fraction of ZeRO-3's — the ZeRO++ paper's Table 1, whose theory is forward
1 → 0.5 (qwZ), backward 1 → 0 (hpZ), gradients 1 → 0.25 (qgZ), total 3 → 0.75 (0.25x).

``--configs stages``: ZeRO stages 0-3 and hybrid sharding; prints per-rank parameter, gradient and optimizer-state
bytes at rest, the gathered weights held after forward, and the bytes sent per step, beside the ZeRO formulas
(hybrid: the states divided by the ranks of a node).

``--configs qgz-options``: ZeRO++ all on, plain and with each qgZ accuracy option (Hadamard rotation,
stochastic rounding, 8-bit intra-node hop, inter-node error feedback, the best combination): bytes per step inside
and across nodes, the extra memory each keeps between steps, and the step time as a ratio to plain ZeRO++ —
medians over ``--steps`` steps, the configurations' steps interleaved so that machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

STAGE_CONFIGS = {
    "stage 0 (DDP)": {"stage": 0},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "hybrid (stage 3 in the node)": {"stage": 3, "shard_group": "node"},
    "hybrid-q": {"stage": 3, "shard_group": "node", "hybrid_gradient_bits": 4},
}
# per configuration of STAGE_CONFIGS: the states ZeRO shards, and over how many ranks ("node": the ranks of a node)
SHARDED = {"stage 0 (DDP)": ((), "world"), "stage 1": (("optimizer_state",), "world"),
           "stage 2": (("optimizer_state", "gradients"), "world"),
           "stage 3": (("optimizer_state", "gradients", "parameters"), "world"),
           "hybrid (stage 3 in the node)": (("optimizer_state", "gradients", "parameters"), "node"),
           "hybrid-q": (("optimizer_state", "gradients", "parameters"), "node")}
ZEROPP = {"quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True}
ZEROPP_CONFIGS = {
    "ZeRO-3": {},
    "+qwZ": {"quantized_weights": True},
    "+hpZ": {"hpz_partition_size": "node"},
    "+qgZ": {"quantized_gradients": True},
    "ZeRO++ (all three)": ZEROPP,
}
QGZ_OPTION_CONFIGS = {
    "ZeRO++": ZEROPP,
    "1-D parameters quantized too": {**ZEROPP, "gradient_full_precision_1d": False},
    "+ Hadamard 64": {**ZEROPP, "gradient_hadamard": 64},
    "+ stochastic rounding": {**ZEROPP, "stochastic_rounding": True},
    "+ 8-bit intra-node hop": {**ZEROPP, "gradient_intra_bits": 8},
    "+ error feedback": {**ZEROPP, "gradient_error_feedback": True},
    "+ Hadamard + SR + 8-bit intra": {**ZEROPP, "gradient_hadamard": 64, "stochastic_rounding": True,
                                      "gradient_intra_bits": 8},
    "+ Hadamard + 8-bit intra": {**ZEROPP, "gradient_hadamard": 64, "gradient_intra_bits": 8},
    "+ Hadamard + 8-bit intra + bit allocation": {**ZEROPP, "gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                  "gradient_bit_allocation": True},
    "+ Hadamard + 8-bit intra + own rows in fp32 (zeropp-accurate)": {
        **ZEROPP, "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_full_precision_local": True},
    "+ Hadamard + 8-bit intra + bit allocation, floor 2 + own rows in fp32": {
        **ZEROPP, "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_bit_allocation": True,
        "gradient_bit_allocation_floor": 2, "gradient_full_precision_local": True},
}
COLUMNS = {"forward all-gather": ("fwd_allgather",), "backward all-gather": ("bwd_allgather",),
           "gradient reduction": ("grad_reduce_scatter", "qgz_1d_full_precision", "qgz_intra", "qgz_inter")}


def _measure(configs: dict[str, dict]) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp

    out = {}
    for name, options in configs.items():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                                           bos_token_id=0, eos_token_id=0))
        params = sum(p.numel() for p in model.parameters())
        config = hf_zeropp.ZeroPPConfig(**{"stage": 3, "mixed_precision": "bf16", "reduce_dtype": "bf16", **options})
        hf_zeropp.shard_model(model, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
        loss = model(input_ids=ids, labels=ids).loss
        gathered_after_forward = hf_zeropp.gathered_parameter_bytes(model)
        loss.backward()
        optimizer.step()
        out[name] = {"stats": hf_zeropp.comm_stats(model, reset=True), "params": params,
                     "state": hf_zeropp.state_bytes(model, optimizer), "gathered": gathered_after_forward}
    return out


def _measure_options(configs: dict[str, dict], steps: int) -> dict:
    """Every configuration trains side by side (one step each in turn); returns bytes, residual memory and the
    median step time per configuration."""
    import time

    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp

    runs = {}
    for name, options in configs.items():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                                           bos_token_id=0, eos_token_id=0))
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, mixed_precision="bf16", **options))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(steps + 1):  # step 0 warms up
        ids = torch.randint(0, 1024, (4, 64), generator=generator)
        for name, (model, optimizer, times) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
            if step == 0:
                hf_zeropp.comm_stats(model, reset=True)
    out = {}
    for name, (model, _, times) in runs.items():
        stats = hf_zeropp.comm_stats(model)["total"]
        residual = sum(codes.numel() + 4 * scales.numel()
                       for reduce_scatter in model._zeropp.reduce_scatters if reduce_scatter.feedback is not None
                       for codes, scales in reduce_scatter.feedback.residuals.values())
        out[name] = {"step_s": sorted(times)[len(times) // 2], "intra": stats["intra_node"] / steps,
                     "inter": stats["inter_node"] / steps, "residual_bytes": residual,
                     "params": sum(p.numel() for p in model.parameters())}
    return out


def options_table(results: dict) -> str:
    base = results["ZeRO++"]
    lines = ["| configuration | sent intra-node / step | sent cross-node / step | kept between steps | "
             "step time (ratio to ZeRO++) |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        kept = f"{r['residual_bytes'] / 1e6:.3f} MB" if r["residual_bytes"] else "0"
        lines.append(f"| {name} | {r['intra'] / 1e6:.3f} MB | {r['inter'] / 1e6:.3f} MB | {kept} | "
                     f"{r['step_s'] * 1e3:.0f} ms ({r['step_s'] / base['step_s']:.2f}) |")
    return "\n".join(lines)


def memory_table(results: dict, world: int, node_size: int) -> str:
    """Per-rank state beside the ZeRO formulas (fp32 master weights/gradients, Adam's two fp32 moments), each state
    divided by the ranks it is sharded over (hybrid: the ranks of a node)."""
    params = next(iter(results.values()))["params"]
    full = {"parameters": 4 * params, "gradients": 4 * params, "optimizer_state": 8 * params}
    lines = ["| configuration | parameters | gradients | optimizer state | ZeRO formula (p / g / os) | "
             "gathered weights after forward | sent per step (intra / inter) |",
             "|---|---:|---:|---:|---|---:|---|"]
    for name, result in results.items():
        state, stats = result["state"], result["stats"]["total"]
        sharded, over = SHARDED[name]
        ranks = world if over == "world" else node_size
        formula = " / ".join(f"{full[k] / (ranks if k in sharded else 1) / 1e6:.2f}"
                             for k in ("parameters", "gradients", "optimizer_state"))
        lines.append(f"| {name} | {state['parameters'] / 1e6:.2f} MB | {state['gradients'] / 1e6:.2f} MB | "
                     f"{state['optimizer_state'] / 1e6:.2f} MB | {formula} MB | {result['gathered'] / 1e6:.2f} MB | "
                     f"{stats['intra_node'] / 1e6:.2f} / {stats['inter_node'] / 1e6:.2f} MB |")
    return "\n".join(lines)


def table(results: dict) -> str:
    base = results["ZeRO-3"]["stats"]

    def inter(stats, kinds):
        return sum(stats.get(kind, {}).get("inter_node", 0) for kind in kinds)

    base_columns = {col: inter(base, kinds) for col, kinds in COLUMNS.items()}
    base_total = base["total"]["inter_node"]
    lines = ["| configuration | " + " | ".join(COLUMNS) + " | total cross-node | ratio to ZeRO-3 |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for name, result in results.items():
        stats = result["stats"]
        cells = []
        for col, kinds in COLUMNS.items():
            value = inter(stats, kinds)
            cells.append(f"{value / 1e6:.3f} MB ({value / base_columns[col]:.3f})")
        total = stats["total"]["inter_node"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {total / 1e6:.3f} MB | {total / base_total:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", choices=["zeropp", "stages", "qgz-options"], default="zeropp")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (qgz-options)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--json", help="also write the raw per-rank statistics here")
    args = parser.parse_args()
    setup = f"{args.world} ranks = {args.world // args.node_size} nodes x {args.node_size}, rank 0"
    if args.configs == "qgz-options":
        results = run_distributed(_measure_options, args.world, QGZ_OPTION_CONFIGS, args.steps,
                                  node_size=args.node_size)[0]
        params = results["ZeRO++"]["params"]
        print(f"GPT-2-style model, {params / 1e6:.2f}M parameters, bf16, {setup}, medians of {args.steps} steps:\n")
        print(options_table(results))
    else:
        configs = ZEROPP_CONFIGS if args.configs == "zeropp" else STAGE_CONFIGS
        results = run_distributed(_measure, args.world, configs, node_size=args.node_size)[0]
        params = next(iter(results.values()))["params"]
        print(f"GPT-2-style model, {params / 1e6:.2f}M parameters (M = {2 * params / 1e6:.2f} MB in bf16), "
              f"one step, {setup}:\n")
        if args.configs == "zeropp":
            print("bytes sent to other nodes (fraction of ZeRO-3's per column):\n")
            print(table(results))
        else:
            print(memory_table(results, args.world, args.node_size))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
