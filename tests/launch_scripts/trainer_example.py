"""A stock Transformers-example-style script (no hf_zeropp import): HfArgumentParser over a script dataclass and
TrainingArguments, a Trainer with evaluation, then save_model and save_state (``trainer_state.json`` holds every
log line, hf_zeropp's byte counts included when it runs). With ``--model_name_or_path`` the model is loaded with
``AutoModelForCausalLM.from_pretrained``, and the script says whether it came back on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer,
                          TrainingArguments, set_seed)


@dataclass
class ModelArguments:
    n_embd: int = 32
    n_layer: int = 2
    vocab_size: int = 64
    seq_len: int = 16
    model_name_or_path: str | None = None


def sequences(count: int, seed: int, vocab: int, length: int) -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(length)) % vocab for s in starts)]


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        if training_args.process_index == 0:
            print(f"from_pretrained returned a model on the meta device: {all(p.is_meta for p in model.parameters())}")
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=model_args.vocab_size, n_positions=model_args.seq_len,
                                           n_embd=model_args.n_embd, n_layer=model_args.n_layer, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT-2's class name does not name its loss; say it (transformers warns)
    data = {name: sequences(count, seed, model_args.vocab_size, model_args.seq_len)
            for name, count, seed in (("train_dataset", 64, 1), ("eval_dataset", 8, 2))}
    trainer = Trainer(model=model, args=training_args, **data)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    if torch.distributed.is_initialized():  # no rank exits (gloo may abort it at exit) before rank 0 has written
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
