"""The main job: train a small GPT-2 with ZeRO++ on CPU processes, one machine emulating 2 nodes.

    torchrun --standalone --nproc_per_node 4 scripts/train_demo.py --preset zeropp --node-size 2

Data: the Python standard library's own source (present on every machine with Python, read in sorted file order),
byte-level tokens, packed into fixed-length sequences. Prints loss, step time and the bytes each rank sent per
step, split intra/inter node, and writes a consolidated checkpoint that plain transformers can load.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import hf_zeropp
from hf_zeropp.testing.corpus import byte_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="zeropp", choices=sorted(hf_zeropp.PRESETS))
    parser.add_argument("--node-size", type=int, default=None, help="ranks per emulated node")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output", default="out/demo")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    config = hf_zeropp.ZeroPPConfig.preset(args.preset, node_size=args.node_size)
    hf_zeropp.shard_model(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    sequences = byte_sequences(4_000_000, args.seq_len)
    generator = torch.Generator().manual_seed(1)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) * world  # shards add up to the model
        print(f"hf_zeropp demo: {args.preset} on {world} ranks ({model._zeropp.topology.nodes} "
              f"emulated nodes), GPT-2 ~{params / 1e6:.1f}M params, {len(sequences)} sequences of "
              f"{args.seq_len} bytes", flush=True)
    hf_zeropp.comm_stats(model, reset=True)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        picks = torch.randint(0, len(sequences), (args.batch_per_rank * world,), generator=generator)
        ids = sequences[picks].view(world, args.batch_per_rank, -1)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            stats = hf_zeropp.comm_stats(model, reset=True)
            steps_counted = 1 if step == 1 else 10
            if rank == 0:
                elapsed = (time.perf_counter() - start) / steps_counted
                print(f"step {step:4d}  loss {float(mean_loss) / world:.4f}  {elapsed:.3f} s/step  "
                      f"sent/step: intra {stats['total']['intra_node'] / steps_counted / 1e6:.2f} MB, "
                      f"inter {stats['total']['inter_node'] / steps_counted / 1e6:.2f} MB", flush=True)
            start = time.perf_counter()
    if rank == 0:
        print("collectives that ran:", hf_zeropp.comm_stats(model)["implementations"])
    hf_zeropp.save_pretrained(model, args.output)
    if rank == 0:
        print(f"consolidated checkpoint written to {args.output} (loads with GPT2LMHeadModel.from_pretrained)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
