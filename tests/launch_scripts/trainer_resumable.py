"""A stock Transformers-example-style Trainer script that resumes as the examples do
(``trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)``), with no hf_zeropp import: the same
tiny GPT-2 and counting sequences as ``trainer_example.py``. It trains under DeepSpeed or under ``hf-zeropp launch``
alike; ``trainer_state.json`` in the output folder holds every logged loss and learning rate."""

from __future__ import annotations

import torch
from trainer_example import ModelArguments, sequences  # this folder is the script's: python puts it on the path
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=model_args.vocab_size, n_positions=model_args.seq_len,
                                       n_embd=model_args.n_embd, n_layer=model_args.n_layer, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"
    train_dataset = sequences(64, 1, model_args.vocab_size, model_args.seq_len)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_state()
    if torch.distributed.is_initialized():  # no rank exits (gloo may abort it at exit) before rank 0 has written
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
