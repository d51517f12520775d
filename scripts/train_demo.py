"""The main job: a stock Transformers Trainer script (no hf_zeropp import) that trains a small GPT-2 on the Python
standard library's own source (byte-level tokens, present on every machine with Python). ``scripts/demo.sh`` runs
it with ZeRO++ on 4 CPU processes emulating 2 nodes:

    hf-zeropp launch --config_file recipes/accelerate/cpu_2x2.yaml scripts/train_demo.py

It runs unchanged under ``accelerate launch`` or ``torchrun`` (stock DDP). Rank 0 prints the loss, the step time and,
under hf_zeropp, the bytes this rank sent per step split intra/inter node (hf_zeropp adds them to the Trainer's logs),
then writes a checkpoint that plain transformers loads.
"""

from __future__ import annotations

import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, PrinterCallback, Trainer, TrainerCallback,
                          TrainingArguments)


@dataclass
class DemoArguments:
    seq_len: int = field(default=128, metadata={"help": "bytes per training sequence"})
    corpus_bytes: int = field(default=4_000_000, metadata={"help": "bytes of standard-library source to train on"})


def stdlib_sequences(max_bytes: int, seq_len: int) -> torch.Tensor:
    """The standard library's top-level ``.py`` files in sorted order, as rows of ``seq_len`` byte ids."""
    data = b"".join(path.read_bytes() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    ids = torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()
    return ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)


class ByteSequences(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class StepReport(TrainerCallback):
    """One line per logging step on rank 0: loss, seconds per step, and the bytes sent per step if logged."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last_step = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or "loss" not in (logs or {}):
            return
        seconds = (time.perf_counter() - self.started) / max(1, state.global_step - self.last_step)
        self.started, self.last_step = time.perf_counter(), state.global_step
        line = f"step {state.global_step:4d}  loss {logs['loss']:.4f}  {seconds:.3f} s/step"
        if "zeropp/inter_node_bytes" in logs:
            line += (f"  sent/step: intra {logs['zeropp/intra_node_bytes'] / 1e6:.2f} MB, "
                     f"inter {logs['zeropp/inter_node_bytes'] / 1e6:.2f} MB")
            inter = {key.removeprefix("zeropp/").removesuffix("_inter_node_bytes"): value
                     for key, value in logs.items() if key.endswith("_inter_node_bytes") and value}
            self.inter_by_collective = inter
        print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and getattr(self, "inter_by_collective", None):
            parts = ", ".join(f"{name} {value / 1e6:.3f} MB" for name, value in self.inter_by_collective.items())
            print(f"inter-node bytes per step by collective (last window): {parts}", flush=True)


def main() -> None:
    demo, training = HfArgumentParser((DemoArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(training.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=demo.seq_len, n_embd=128, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT-2's class name does not name its loss; say it (transformers warns)
    rows = stdlib_sequences(demo.corpus_bytes, demo.seq_len)
    trainer = Trainer(model=model, args=training, train_dataset=ByteSequences(rows), callbacks=[StepReport()])
    trainer.remove_callback(PrinterCallback)  # StepReport prints instead
    if trainer.is_world_process_zero():
        parameters = sum(p.numel() for p in model.parameters())
        print(f"demo: GPT-2 {parameters / 1e6:.2f}M parameters on {training.world_size} processes, {len(rows)} "
              f"sequences of {demo.seq_len} bytes", flush=True)
    trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"checkpoint written to {training.output_dir} (loads with GPT2LMHeadModel.from_pretrained)", flush=True)


if __name__ == "__main__":
    main()
