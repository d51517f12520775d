"""A stock Transformers Trainer script (no hf_zeropp import) as users run it with DeepSpeed: HfArgumentParser over a
script dataclass and TrainingArguments, then one training per DeepSpeed config given (``--deepspeed_configs A.json
B.json``; ``TrainingArguments(deepspeed=...)``), each from the same seed. For every optimizer step it records the
learning rate the optimizer applies (read as the step begins), and the logged loss, learning rate and gradient norm.
Rank 0 writes ``{config name: record}`` to ``--record`` as JSON. Dropout is off, so that engines can be compared to
rounding."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments,
                          set_seed)


@dataclass
class ScriptArguments:
    deepspeed_configs: list[str] = field(default_factory=list)
    record: str = "record.json"


class AppliedLearningRate(TrainerCallback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.values.append(float(optimizer.param_groups[0]["lr"]))


def sequences(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, 64, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(16)) % 64 for s in starts)]


def train(args: TrainingArguments) -> dict[str, list[float]]:
    set_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = "ForCausalLM"
    applied = AppliedLearningRate()
    trainer = Trainer(model=model, args=args, train_dataset=sequences(96, 1), callbacks=[applied])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"applied_lr": applied.values, "logged_lr": [entry["learning_rate"] for entry in logs],
            "loss": [entry["loss"] for entry in logs], "grad_norm": [entry.get("grad_norm") for entry in logs]}


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    records = {}
    for config in script_args.deepspeed_configs:
        name = Path(config).stem
        args = dataclasses.replace(training_args, deepspeed=config,
                                   output_dir=str(Path(training_args.output_dir) / name))
        records[name] = train(args)
    if training_args.process_index == 0:
        Path(script_args.record).write_text(json.dumps(records, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
