"""Parameters FSDP2 cannot shard, kept whole on every rank and trained as DDP trains them.

``fully_shard`` refuses two kinds of parameter (torch 2.13): 0-d ones (``_verify_managed_param``: there is no dim
to shard; Accelerate's ``RegressionModel`` has two, CLIP's ``logit_scale`` is one, SigLIP's is a 1-element vector,
which it shards) and non-contiguous ones (``FSDPParam``'s ``NotImplementedError``; any shape it takes otherwise, one
with fewer rows than ranks included). It takes an empty one but fails at its first gradient reduce-scatter
(``_chunk_cat expects non-empty tensor``; MobileBERT's LM head has a ``(hidden - embedding, hidden)`` weight, empty
where the two widths are equal), so empty ones are kept here too. DDP and DeepSpeed train such models, so
:func:`hf_zeropp.shard_model` does not fail on them: it passes them to every ``fully_shard`` call as ``ignored_params``
(FSDP2's own way to leave a parameter unmanaged) and this module gives them what FSDP2 gives the parameters it shards:

* rank 0's value on every rank once the model is sharded (DDP broadcasts at construction; FSDP2 would not);
* the gradient averaged over every rank (the data-parallel group, also under hybrid sharding, whose replicas span
  nodes) by one all-reduce at the end of each backward that synchronises gradients (an autograd callback queued by
  the backward through the model's outputs or into the parameters themselves): not inside :func:`hf_zeropp.no_sync`
  at stages 0 and 1, every micro-batch at stages 2 and 3, as the sharded gradients' reduction runs (averaging an
  accumulated gradient again adds the new micro-batch's mean to the mean so far). A parameter with no gradient on some
  rank counts as zero there (DDP's ``find_unused_parameters``); one with a gradient on no rank keeps none. The sum
  travels in fp32 (or wider) and unquantized, whatever ZeRO++ does with the sharded gradients: they are a few values;
* its bytes in ``comm_stats()`` under ``replicated_grad_allreduce``, and one line in ``implementations`` naming the
  parameters, with a warning on rank 0 at sharding time.

A replicated parameter stays a plain tensor: torch's state-dict API, DCP and hf_zeropp's writers treat a plain
tensor as one every rank holds whole, and :func:`hf_zeropp.engine.runtime.clip_grad_norm_` counts its (equal on every
rank) gradient once. FSDP2's mixed precision does not cast it: it computes in its own dtype (a 0-d one scales
activations without changing their dtype; a non-contiguous matrix would meet bf16 activations in fp32, so the warning
says how to have it sharded instead).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import queue_backward_callback
from .comm_meter import CommMeter, nbytes
from .topology import Topology

KIND = "replicated_grad_allreduce"


def _refusal(param: nn.Parameter) -> str | None:
    """Why ``fully_shard`` would refuse ``param`` (torch 2.13), or None if it shards it."""
    if param.dim() == 0:
        return "0-d"
    if param.numel() == 0:
        return f"empty, shape {tuple(param.shape)}"
    if not param.is_contiguous():
        return f"non-contiguous, stride {tuple(param.stride())}"
    return None


class ReplicatedParameters:
    """The parameters of one model that FSDP2 cannot shard (by name), and their gradient all-reduce."""

    def __init__(self, model: nn.Module, topology: Topology, meter: CommMeter,
                 persistent: dict[str, str] | None = None) -> None:
        """``persistent``: parameters asked to stay whole (stage 3's ``persistence_threshold``), by name, with why;
        kept as those FSDP2 refuses, and recorded in ``comm_stats()`` without a warning (they were asked for)."""
        refused = {name: why for name, param in model.named_parameters() if (why := _refusal(param))}
        self.reasons = {**(persistent or {}), **refused}
        self.ignored = {model.get_parameter(name) for name in self.reasons}  # fully_shard's ignored_params
        self.topology, self.meter = topology, meter
        self.sync = True  # False inside no_sync at stages 0 and 1 (ZeroPPModule.set_requires_gradient_sync)
        self._queued = False
        if refused:
            self._report(refused)
        if persistent:
            self.meter.conditions["persistent_parameters"] = (
                f"{len(persistent)} parameters at or below persistence_threshold are never sharded "
                f"({sum(model.get_parameter(name).numel() for name in persistent):,} elements on every rank); their "
                f"gradients are all-reduced in fp32 in one collective per backward")

    def _report(self, refused: dict[str, str]) -> None:
        """Say once, on rank 0, which parameters stay replicated, and record it in ``comm_stats()``."""
        listed = ", ".join(f"{name} ({why})" for name, why in refused.items())
        count = "1 parameter FSDP2 cannot shard is" if len(refused) == 1 else \
            f"{len(refused)} parameters FSDP2 cannot shard are"
        line = f"{count} replicated on every rank, gradients all-reduced in full precision as DDP does: {listed}"
        self.meter.conditions["replicated_parameters"] = line
        if self.topology.rank == 0:
            warnings.warn(f"hf_zeropp: {line}. Each costs its full size on every rank and computes in its own "
                          f"dtype; FSDP2 would shard (and cast) a 0-d parameter stored as a 1-element vector and a "
                          f"non-contiguous one made contiguous (.contiguous())", stacklevel=4)

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [model.get_parameter(name) for name in self.reasons]

    def start(self, model: nn.Module) -> None:
        """Give every rank rank 0's values and average the gradients from now on (after the model's weights are
        placed: on the meta device, the model's init or a checkpoint gave them their values just now)."""
        if not self.reasons:
            return
        group = self.topology.world_mesh.get_group()
        with torch.no_grad():
            for param in self.parameters(model):
                dist.broadcast(param.data, src=0, group=group)
                param.register_post_accumulate_grad_hook(functools.partial(self._queue, model))
        model.register_forward_hook(self._after_forward)

    def _after_forward(self, model: nn.Module, args: Any, output: Any) -> None:
        """A backward through this forward's outputs ends with the all-reduce, also on a rank where it gives these
        parameters no gradient (every rank must join), and so does one that reaches them without an output (a
        penalty on a parameter alone): queued once per backward, however many forwards it goes through."""
        if not torch.is_grad_enabled():
            return
        self._queued = False  # not inside a backward: a backward that failed before its callbacks left it set
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._queue, model), mode="any")

    def _queue(self, model: nn.Module, _: torch.Tensor | None) -> None:
        if not self._queued:
            self._queued = True
            queue_backward_callback(functools.partial(self._all_reduce, model))

    def _all_reduce(self, model: nn.Module) -> None:
        """Average the gradients over every rank: one SUM of the flattened gradients and a has-a-gradient flag per
        parameter, then the sum divided by the world size (same collectives on every rank)."""
        self._queued = False
        params = [p for p in self.parameters(model) if p.requires_grad]
        if not self.sync or not params:
            return
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in params], torch.float32)
        device = params[0].device
        pieces = [(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=device)
        flat = torch.cat([*(piece.to(device, dtype) for piece in pieces), has_grad])
        group = self.topology.world_mesh.get_group()
        dist.all_reduce(flat, group=group)
        self.meter.record_allreduce(group, nbytes(flat), f"all_reduce {dtype} of {len(params)} replicated "
                                                         f"parameters, unquantized", kind=KIND)
        flat /= self.topology.world_size
        values = flat.split([p.numel() for p in params] + [len(params)])
        for param, value, anywhere in zip(params, values, values[-1].tolist()):
            if not anywhere:
                continue
            mean = value.view_as(param).to(param.dtype)
            if param.grad is None:
                param.grad = mean
            else:
                param.grad.copy_(mean)


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: nested tuples, lists and dicts (transformers' ``ModelOutput`` is one)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


__all__ = ["KIND", "ReplicatedParameters"]
