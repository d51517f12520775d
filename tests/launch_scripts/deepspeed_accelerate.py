"""A stock Accelerate script written for DeepSpeed configs (no hf_zeropp import), as Accelerate's DeepSpeed examples
write one: a ``DeepSpeedPlugin`` made from the config, ``DummyOptim`` / ``DummyScheduler`` standing for the config's
optimizer and scheduler (a torch AdamW and schedule where the config has none), accumulation, clipping. One training
per config (``--deepspeed_configs A.json B.json``), each with its own Accelerator and the same seed. For every
optimizer step it records the learning rate the optimizer applies (read before the step's backward: under DeepSpeed
the engine steps inside it), the loss (mean over ranks) and the gradient norm. Rank 0 writes ``{config name:
record}`` to ``--record`` as JSON. Dropout is off, so that engines can be compared to rounding."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

STEPS, ACCUMULATION, WARMUP, LR, WEIGHT_DECAY = 12, 2, 4, 1e-2, 0.01


def sequences(count: int, seed: int) -> list[torch.Tensor]:
    starts = torch.randint(0, 64, (count,), generator=torch.Generator().manual_seed(seed))
    return [(s + torch.arange(16)) % 64 for s in starts]


def train(config_path: str, batch_size: int) -> dict[str, list[float]]:
    AcceleratorState._reset_state(True)  # one Accelerator per config, as separate scripts would have
    GradientState._reset_state()
    if not torch.cuda.is_available():
        # Accelerate's DeepSpeed path counts one process on a machine without GPUs unless the CPU process group is
        # set up first (the Trainer does the same through TrainingArguments(use_cpu=True)); harmless elsewhere
        PartialState(cpu=True)
    config = json.loads(Path(config_path).read_text())
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              gradient_accumulation_steps=ACCUMULATION)
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = "ForCausalLM"
    data = DataLoader(sequences(STEPS * ACCUMULATION * batch_size * accelerator.num_processes, 1),
                      batch_size=batch_size)
    if "optimizer" in config:
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if "scheduler" in config:
        scheduler = DummyScheduler(optimizer, total_num_steps=STEPS * accelerator.num_processes,
                                   warmup_num_steps=WARMUP)
    else:
        # Accelerate steps a script's own scheduler once per process at every optimizer step: warm up over as many
        warmup = WARMUP * accelerator.num_processes
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / warmup))
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    record: dict[str, list[float]] = {"applied_lr": [], "loss": [], "grad_norm": []}
    for index, ids in enumerate(data):
        if index % ACCUMULATION == ACCUMULATION - 1:
            record["applied_lr"].append(float(optimizer.param_groups[0]["lr"]))
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                record["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            record["loss"].append(accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item())
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_configs", nargs="+", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--batch_size", type=int, default=2, help="per process")
    arguments = parser.parse_args()
    records = {Path(config).stem: train(config, arguments.batch_size) for config in arguments.deepspeed_configs}
    if AcceleratorState().process_index == 0:
        Path(arguments.record).write_text(json.dumps(records, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
