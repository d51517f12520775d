"""A stock Accelerate script (no hf_zeropp import) for an Accelerate FSDP config: loads a pretrained model, trains it
with clipping, saves its state, and writes every loss, gradient norm, the final full weights, the FSDP unit classes
and the FSDP variables it saw to ``OUTPUT/results.pt`` (rank 0).

Under ``hf-zeropp launch`` it is the script a user writes: ``accelerator.prepare(model, optimizer)`` shards the model
with hf_zeropp, which takes the config's FSDP settings. Under stock ``accelerate launch`` on a machine without GPUs,
Accelerate runs DDP instead of FSDP (its FSDP plugin needs a GPU), so the script applies FSDP2 as that plugin would
on a GPU: the plugin built from the launch's ``FSDP_*`` variables, then Accelerate's own ``fsdp2_apply_ac`` and
``fsdp2_prepare_model`` (units, resharding, offload, activation checkpointing, rank 0's weights sent to the others
under CPU-RAM-efficient loading). The one change: CPU offload does not pin host memory, which needs an accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from transformers import AutoModelForCausalLM

STEPS, LENGTH = 6, 16


def batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    """Counting sequences from random starts, different per step and rank."""
    starts = torch.randint(0, vocab, (2, 1), generator=torch.Generator().manual_seed(1000 * step + rank))
    return (starts + torch.arange(LENGTH)) % vocab


def as_accelerate_fsdp2_would(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded as Accelerate's FSDP2 path (``Accelerator._prepare_fsdp2``) shards it on a GPU."""
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as the Accelerator reads them
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not torch.accelerator.is_available():
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    stand_in = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), device=accelerator.device,
                                     mixed_precision=accelerator.mixed_precision,
                                     is_main_process=accelerator.is_main_process)
    plugin.set_auto_wrap_policy(model)
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(stand_in, model)
    return fsdp2_prepare_model(stand_in, model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    output = Path(args.output)
    accelerator = Accelerator()
    on_cpu_instead = accelerator.distributed_type != DistributedType.FSDP
    stock_fsdp = os.environ.get("ACCELERATE_USE_FSDP") == "true" and on_cpu_instead
    model = AutoModelForCausalLM.from_pretrained(args.pretrained)
    model.loss_type = "ForCausalLM"  # GPT-2's class name does not name its loss; say it (transformers warns)
    on_meta = [None] * dist.get_world_size()
    dist.all_gather_object(on_meta, any(p.is_meta for p in model.parameters()))
    results = {"loaded_on_meta": on_meta,
               "fsdp_variables": {k: v for k, v in os.environ.items() if k.startswith("FSDP_") or k.endswith("_FSDP")}}
    if stock_fsdp:
        model = as_accelerate_fsdp2_would(accelerator, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    if not stock_fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)
    # the class each unit shards: Accelerate 1.16 shards the CheckpointWrapper around a matched layer (same
    # parameters; its hooks stay outside compiled code), so look through it
    results["units"] = sorted({type(getattr(m, "_checkpoint_wrapped_module", m)).__name__.removeprefix("FSDP")
                               for m in model.modules() if isinstance(m, FSDPModule) and m is not model})
    results["loss"], results["grad_norm"] = [], []
    for step in range(STEPS):
        ids = batch(step, accelerator.process_index, model.config.vocab_size)
        loss = model(input_ids=ids, labels=ids).loss
        if stock_fsdp:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        results["loss"].append(mean.item() / dist.get_world_size())
        results["grad_norm"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    if stock_fsdp:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        results["state_dict"] = get_model_state_dict(model, options=options)
    else:
        results["state_dict"] = accelerator.get_state_dict(model)
        accelerator.save_state(output / "state")
        results["saved_state"] = sorted(p.name for p in (output / "state").iterdir())
        if "hf_zeropp" in sys.modules:  # the launcher installed it: its byte counts and what ran
            results["comm_stats"] = sys.modules["hf_zeropp"].comm_stats(model)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        torch.save(results, output / "results.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
