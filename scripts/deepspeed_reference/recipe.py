"""The training run behind the DeepSpeed checkpoint fixtures, shared by their generator (which runs it under DeepSpeed)
and by the tests (which resume it under hf_zeropp: :func:`resume_under_hf_zeropp`). Importing this module needs no
DeepSpeed.

A tiny GPT-2 (vocabulary 64, 2 layers of width 32) learns counting sequences (each row steps through the vocabulary
from a random start), 8 rows per global batch, each rank taking its contiguous slice, so any world size dividing 8
sees the same global gradient. AdamW has two parameter
groups as the Trainer builds them (weight decay on matrices, none on biases and norms) and a linear warmup/decay
schedule; eps=1e-6 keeps Adam from turning reduction-order noise in near-zero gradients into full-size updates.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from hf_zeropp.testing.tiny_models import mean_over_ranks

VOCAB = 64
SEQUENCE = 16
GLOBAL_BATCH = 8
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3
LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.01
WARMUP_STEPS = 2
SCHEDULE_STEPS = 8


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def parameter_groups(model: torch.nn.Module, single_group: bool = False) -> list[dict]:
    """The Trainer's grouping: decay for parameters of two or more dimensions, none for the rest (or one group)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if single_group:
        return [{"params": params, "weight_decay": WEIGHT_DECAY}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, single_group: bool = False) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameter_groups(model, single_group), lr=LEARNING_RATE, eps=1e-6)


def make_scheduler(optimizer: torch.optim.Optimizer):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, WARMUP_STEPS, SCHEDULE_STEPS)


def global_batch(step: int) -> torch.Tensor:
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1000 + step))
    return (starts + torch.arange(SEQUENCE)) % VOCAB


def local_batch(step: int) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return global_batch(step).chunk(world)[rank]


def single_process_run(steps: int, precision: str, lrs: list[float] | None = None, single_group: bool = False
                       ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The same ``steps`` in one process without sharding: fp32 master weights and AdamW, the forward and backward
    in ``precision`` (bf16/fp16: on a copy cast to it, as a ZeRO engine computes); the recipe's schedule, or the
    learning rate ``lrs[step]`` at each step. Returns losses, learning rates and the final weights: the yardstick for
    how far any sharded engine lands from plain training."""
    model = tiny_gpt2()
    optimizer = make_optimizer(model, single_group)
    scheduler = make_scheduler(optimizer)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses, used = [], []
    for step in range(steps):
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
        ids = global_batch(step)
        compute = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        loss = compute(input_ids=ids, labels=ids).loss
        loss.backward()
        if compute is not model:
            for master, low in zip(model.parameters(), compute.parameters()):
                master.grad = low.grad.float()
        losses.append(float(loss.detach()))
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses, used, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_after_save(model, optimizer, scheduler, scaler=None) -> dict:
    """The steps after the save (on every rank of a sharded model): losses averaged over the ranks, the learning
    rate each step applied, and the final weights (consolidated on rank 0)."""
    from hf_zeropp.engine.full_state import consolidated_state_dict

    losses, lrs = [], []
    for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE):
        ids = local_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        lrs.append(optimizer.param_groups[0]["lr"])
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return {"losses": losses, "lrs": lrs, "weights": consolidated_state_dict(model)}


def resume_under_hf_zeropp(checkpoint, record: dict, preset: str) -> dict:
    """Resume the DeepSpeed checkpoint ``checkpoint`` (a fixture's, described by its ``expected.json`` ``record``)
    with hf_zeropp's ``preset`` from other initial weights, and train the steps after the save
    (:func:`train_after_save`, plus what ``comm_stats`` says was not restored and the fp16 loss scale)."""
    import hf_zeropp
    from hf_zeropp.interop.deepspeed.optim import build_scheduler

    model = tiny_gpt2(seed=5)  # other initial weights: only the checkpoint can make them right
    config = hf_zeropp.ZeroPPConfig.coerce(preset).to_dict()
    hf_zeropp.shard_model(model, {**config, "mixed_precision": "no" if record["precision"] == "fp32"
                                  else record["precision"]})
    optimizer = make_optimizer(model, record.get("single_group", False))
    scheduler = build_scheduler(optimizer, record["scheduler"]) if "scheduler" in record else make_scheduler(optimizer)
    scaler = None
    if record["precision"] == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device="cpu")
    hf_zeropp.load_deepspeed_checkpoint(checkpoint, model, optimizer, scheduler, grad_scaler=scaler)
    result = train_after_save(model, optimizer, scheduler, scaler)
    result["not_restored"] = hf_zeropp.comm_stats(model)["implementations"].get("deepspeed_checkpoint")
    if scaler is not None:
        result["loss_scale"] = float(scaler.get_scale())
    return result
