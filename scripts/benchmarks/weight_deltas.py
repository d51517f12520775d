#!/usr/bin/env python3
"""Cross-node forward bytes, weight error and loss gap of qwZ by weight deltas against INT8 and INT4 qwZ.

    python -m scripts.benchmarks.weight_deltas --nodes 2 --node-size 2 --steps 8

One launch of gloo ranks on this machine (``node_size`` emulates the nodes), GPT-2 from config (n_embd 256, 4
layers, vocab 4096, 128 positions, fp32), AdamW (``--lr``, default 1e-3), the same batches for every configuration. Per
configuration: the forward all-gather's cross-node bytes per step and rank from ``comm_stats`` (mean over the steps
after the first), the relative L2 error of the weights forward used against the master
(``comm_stats()["quantization_error"]["fwd_allgather"]``, mean over the same steps), and the sum over all steps of
|loss - ZeRO-3's loss|, and for weight deltas the steps in which some difference was sent again (INT4 lost more than
the limit). Prints a markdown table.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

CONFIGS = {
    "ZeRO-3": {"stage": 3},
    "qwZ INT8": {"stage": 3, "quantized_weights": True},
    "qwZ INT4": {"stage": 3, "quantized_weights": True, "weight_bits": 4},
    "deltas INT8": {"stage": 3, "quantized_weights": True, "weight_deltas": True},
    "deltas INT4": {"stage": 3, "quantized_weights": True, "weight_bits": 4, "weight_deltas": True},
}


def _model(seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=seq, n_embd=256, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _measure(steps: int, node_size: int, seq: int, lr: float) -> dict:
    import hf_zeropp
    from hf_zeropp.engine.state import zeropp_state
    from hf_zeropp.testing.corpus import byte_sequences

    sequences = byte_sequences(400_000, seq)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, options in CONFIGS.items():
        model = _model(seq)
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(node_size=node_size, **options))
        zeropp_state(model).meter.track_errors = True
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, inter, errors, refined = [], [], [], 0
        for step in range(steps):
            picks = torch.randint(0, len(sequences), (2 * world,), generator=torch.Generator().manual_seed(step))
            ids = sequences[picks].view(world, 2, seq)[rank]
            hf_zeropp.comm_stats(model, reset=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            stats = hf_zeropp.comm_stats(model)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            inter.append(stats["fwd_allgather"]["inter_node"])
            errors.append(stats.get("quantization_error", {}).get("fwd_allgather", 0.0))
            refined += any("lost more" in how for how in stats["implementations"]["fwd_allgather"])
        out[name] = {"losses": losses, "inter": inter, "errors": errors, "refined": refined}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    from hf_zeropp.testing.spawn import run_distributed

    result = run_distributed(_measure, args.nodes * args.node_size, args.steps, args.node_size, args.seq_len, args.lr,
                             node_size=args.node_size, timeout=1800.0)[0]
    zero3 = result["ZeRO-3"]["losses"]
    qwz8 = sum(result["qwZ INT8"]["inter"][1:]) / (args.steps - 1)
    print(f"{args.nodes} nodes x {args.node_size} ranks, {args.steps} steps, learning rate {args.lr:g}\n")
    print("| | cross-node forward bytes / step (after step 1) | ÷ qwZ INT8 | step 1 | weight error vs master "
          "(rel. L2) | Σ\\|loss − zero3\\| | steps refined |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in result.items():
        later = sum(run["inter"][1:]) / (args.steps - 1)
        error = sum(run["errors"][1:]) / (args.steps - 1)
        gap = sum(abs(a - b) for a, b in zip(run["losses"], zero3))
        print(f"| {name} | {later / 1e3:.1f} kB | {later / qwz8:.3f} | {run['inter'][0] / 1e3:.1f} kB | "
              f"{error:.1e} | {gap:.1e} | {run['refined']} |")


if __name__ == "__main__":
    main()
