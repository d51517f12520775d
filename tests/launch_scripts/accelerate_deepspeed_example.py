"""Accelerate's own DeepSpeed example (``examples/by_feature/deepspeed_with_config_support.py``), cut down to what
decides how it trains and kept in its shape: no hf_zeropp import, a plain ``Accelerator()`` whose DeepSpeed config
comes from the launch's YAML, ``DummyOptim`` / ``DummyScheduler`` chosen by reading
``accelerator.state.deepspeed_plugin.deepspeed_config`` (torch AdamW and ``get_scheduler`` otherwise), the
accumulation steps read from that config, two parameter groups (no decay on biases), the loss divided by the
accumulation steps before ``accelerator.backward``, ``optimizer.step`` / ``lr_scheduler.step`` every
``gradient_accumulation_steps`` batches, and the evaluation's ``gather_for_metrics`` after each epoch.

Left out, because they decide nothing about the numbers: the dataset and tokenizer (a fixed synthetic sequence set
and a tiny GPT-2 built from its config, dropout off), trackers, checkpointing and the final save. The training data
is not shuffled, so that no engine's use of the random generator can reorder it.

Rank 0 writes ``--record``: for every optimizer step the learning rate the optimizer applies (read before the
step's backward: under DeepSpeed the engine steps inside it) and the loss (mean over ranks); the evaluation loss of
each epoch; and what the script saw: ``distributed_type``, whether there was a plugin, and the optimizer and
scheduler classes it built."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", required=True)
    return parser.parse_args()


def sequences(count: int, seed: int) -> list[torch.Tensor]:
    starts = torch.randint(0, 64, (count,), generator=torch.Generator().manual_seed(seed))
    return [(s + torch.arange(16)) % 64 for s in starts]


def evaluate(args, model, eval_dataloader, accelerator) -> float:
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(input_ids=batch, labels=batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    model.train()
    return torch.mean(torch.cat(losses)).item()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    train_dataloader = DataLoader(sequences(96, 1), batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(sequences(16, 2), batch_size=args.per_device_eval_batch_size)

    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    # Creates Dummy Optimizer if `optimizer` was specified in the config file else creates Adam Optimizer
    optimizer_cls = (
        torch.optim.AdamW
        if accelerator.state.deepspeed_plugin is None
        or "optimizer" not in accelerator.state.deepspeed_plugin.deepspeed_config
        else DummyOptim
    )
    optimizer = optimizer_cls(optimizer_grouped_parameters, lr=args.learning_rate)

    # Get gradient accumulation steps from deepspeed config if available
    if accelerator.state.deepspeed_plugin is not None:
        args.gradient_accumulation_steps = accelerator.state.deepspeed_plugin.deepspeed_config[
            "gradient_accumulation_steps"
        ]
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    else:
        args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    # Creates Dummy Scheduler if `scheduler` was specified in the config file else creates `args.lr_scheduler_type`
    if (accelerator.state.deepspeed_plugin is None
            or "scheduler" not in accelerator.state.deepspeed_plugin.deepspeed_config):
        lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                     num_warmup_steps=args.num_warmup_steps, num_training_steps=args.max_train_steps)
    else:
        lr_scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps,
                                      warmup_num_steps=args.num_warmup_steps)
    seen = {"distributed_type": str(accelerator.distributed_type.value),
            "deepspeed": accelerator.distributed_type == DistributedType.DEEPSPEED,
            "plugin": accelerator.state.deepspeed_plugin is not None,
            "optimizer_class": type(optimizer).__name__, "scheduler_class": type(lr_scheduler).__name__,
            "gradient_accumulation_steps": args.gradient_accumulation_steps}

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    record = {"seen": seen, "applied_lr": [], "loss": [], "eval_loss": []}
    completed_steps = 0
    for _ in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            boundary = (step + 1) % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1
            if boundary:
                record["applied_lr"].append(float(optimizer.param_groups[0]["lr"]))
            loss = model(input_ids=batch, labels=batch).loss
            if boundary:
                record["loss"].append(accelerator.gather(loss.detach().reshape(1)).mean().item())
            loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            if boundary:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break
        record["eval_loss"].append(evaluate(args, model, eval_dataloader, accelerator))
    if accelerator.is_main_process:
        Path(args.record).write_text(json.dumps(record, indent=1))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
