"""The reference use of hf_zeropp.Accelerator: a plain Accelerate training loop, sharded by hf_zeropp.

    ZEROPP_CONFIG=recipes/zeropp/zeropp.yaml ZEROPP_NODE_SIZE=2 \\
        accelerate launch --config_file recipes/accelerate/cpu_4proc.yaml scripts/train_accelerate.py --steps 20

The only hf_zeropp-specific line is the Accelerator import: the config comes from ``--zeropp`` or the
``ZEROPP_*`` environment. Trains a small GPT-2 on the standard library's source (byte level), with gradient
accumulation, clipping, a scheduler, ``save_state``/``load_state`` and a consolidated ``save_model`` at the end.
Writes ``metrics.json`` (per-step loss and the bytes each rank sent) into ``--output``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import hf_zeropp
from hf_zeropp import Accelerator
from hf_zeropp.testing.corpus import byte_sequences


class Progress:
    """Optimizer steps taken, saved and restored with the accelerator state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zeropp", default=None, help="preset name or config file (default: ZEROPP_* env)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--output", default="out/accelerate")
    parser.add_argument("--save-state-at", type=int, default=None, help="save_state after this many steps")
    parser.add_argument("--resume", action="store_true", help="load_state from <output>/state first")
    args = parser.parse_args()

    accelerator = Accelerator(zeropp=args.zeropp, gradient_accumulation_steps=args.grad_accum)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    data = byte_sequences(400_000, args.seq_len)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    output = Path(args.output)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(str(output / "state"))
        loader = accelerator.skip_first_batches(loader, progress.step * args.grad_accum)

    metrics = []
    model.train()
    batches = iter(loader)
    while progress.step < args.steps:
        for _ in range(args.grad_accum):
            ids = next(batches)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        progress.step += 1
        step = progress.step
        mean_loss = accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item()
        stats = hf_zeropp.comm_stats(model, reset=True) if hasattr(model, "_zeropp") else {}
        metrics.append({"step": step, "loss": mean_loss, "grad_norm": float(grad_norm),
                        "inter_node_bytes": stats.get("total", {}).get("inter_node", 0)})
        accelerator.print(f"step {step:3d} loss {mean_loss:.4f} grad_norm {float(grad_norm):.3f}")
        if args.save_state_at == step:
            accelerator.save_state(str(output / "state"))
    accelerator.save_model(model, str(output / "model"))
    if accelerator.is_main_process:
        (output / ("metrics_resumed.json" if args.resume else "metrics.json")).write_text(json.dumps(metrics))
    accelerator.end_training()


if __name__ == "__main__":
    main()
