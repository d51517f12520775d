"""A stock Accelerate script (no hf_zeropp import) going through the patterns users write: prepare in one call
with accumulation, clipping, a scheduler and gather_for_metrics; prepare split over two calls; save_state and
load_state into a fresh run; save_model. Writes every loss, gradient norm and the final weights to
``OUTPUT/results.pt`` (rank 0)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH = 64, 16


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    """Counting sequences from random starts, different per step, micro-batch and rank."""
    starts = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))
    return (starts + torch.arange(LENGTH)) % VOCAB


def train(accelerator, model, optimizer, steps, scheduler=None) -> dict[str, list[float]]:
    record: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in steps:
        for micro in range(2):
            ids = batch(step, micro, accelerator.process_index)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    record["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
        record["loss"].append(accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item())
    return record


def fresh_accelerator(accelerator_class):
    AcceleratorState._reset_state(True)  # one Accelerator per pattern, as separate scripts would have
    GradientState._reset_state()
    return accelerator_class(gradient_accumulation_steps=2)


def main(accelerator_class=Accelerator, report=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    output = Path(parser.parse_args().output)
    results = {}

    accelerator = fresh_accelerator(accelerator_class)
    model = tiny_gpt2(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    evaluation = DataLoader(list(range(11)), batch_size=2)
    model, optimizer, scheduler, evaluation = accelerator.prepare(model, optimizer, scheduler, evaluation)
    results["one_call"] = train(accelerator, model, optimizer, range(3), scheduler)
    results["evaluated"] = sorted(torch.cat([accelerator.gather_for_metrics(b) for b in evaluation]).tolist())
    results["state_dict"] = accelerator.get_state_dict(model)
    accelerator.save_model(model, output / "save_model")
    if report is not None:
        results["report"] = report(model)

    accelerator = fresh_accelerator(accelerator_class)
    model = tiny_gpt2(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(optimizer)
    results["split_prepare"] = train(accelerator, model, optimizer, range(3))
    accelerator.save_state(str(output / "state"))
    results["uninterrupted"] = train(accelerator, model, optimizer, range(3, 5))

    accelerator = fresh_accelerator(accelerator_class)
    model = accelerator.prepare(tiny_gpt2(2))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    accelerator.load_state(str(output / "state"))
    results["resumed"] = train(accelerator, model, optimizer, range(3, 5))
    results["accelerator_class"] = f"{type(accelerator).__module__}.{type(accelerator).__name__}"
    if accelerator.is_main_process:
        torch.save(results, output / "results.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
