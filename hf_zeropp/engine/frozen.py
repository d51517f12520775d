"""Frozen weights stored as INT8 shards (``quantized_nontrainable_weights``): ZeRO++ for LoRA and RLHF.

In LoRA fine-tuning and RLHF the frozen base weights dominate memory and — through generation, which runs many
forwards per step — communication. Every frozen floating weight of an ``nn.Linear``, transformers ``Conv1D`` or
``nn.Embedding`` is quantized once, from the real weights, when the model is sharded: each rank keeps its 1/N
shard of block-quantized INT8 codes and scales, and with hpZ also its 1/k slice of the node's copy (frozen weights
never change, so that secondary copy is built once and kept for the whole run). A use gathers the codes — inside
the node with hpZ, across the world without — and dequantizes them into a temporary compute-dtype tensor that is
freed after the op; backward gathers again instead of keeping the weight alive between forward and backward.
The weights leave FSDP entirely (they are no longer parameters); FSDP shards the trainable rest as usual.

What the model saves: the trainable parameters and small frozen ones (LayerNorm); the INT8-stored base weights
are not part of its state dict — with peft the adapter is what is saved, and the base comes from its checkpoint.
"""

from __future__ import annotations

import types
import warnings
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..comm.comm_meter import CommMeter, nbytes
from ..comm.qwz import all_gather_packed
from ..comm.topology import Topology


class FrozenInt8Weight:
    """One frozen weight: this rank's INT8 shard (and hpZ slice), gathered and dequantized on use."""

    def __init__(self, weight: torch.Tensor, topology: Topology, meter: CommMeter, bits: int,
                 block_size: int, compute_dtype: torch.dtype, backend: kernels.Backend | None = None,
                 device: torch.device | None = None) -> None:
        """``weight`` gives shape and dtype; its values are quantized unless it is on the meta device (then
        :meth:`load_own_part_` must follow, with the values of :meth:`own_range`). ``device``: where the codes
        live (default: the weight's)."""
        self.shape, self.dtype, self.numel = weight.shape, weight.dtype, weight.numel()
        self.device = device if device is not None else weight.device
        self.topology, self.meter, self.bits, self.block_size = topology, meter, bits, block_size
        self.compute_dtype, self.backend = compute_dtype, backend
        self.shard_numel = -(-self.numel // topology.world_size)
        hpz = topology.hpz_mesh
        if hpz is not None:  # this rank's 1/k slice of the node's copy: every later gather stays in the node
            self.group = hpz.get_group(1)
            self._position, self._parts = dist.get_rank(self.group), topology.hpz_size
        else:  # this rank's 1/N shard, gathered over the world
            self.group = topology.world_mesh.get_group()
            self._position, self._parts = topology.rank, topology.world_size
        self.uses_hpz = hpz is not None
        self._held: dict[torch.dtype, torch.Tensor] | None = None  # dequantized weights kept while held, by dtype
        if not weight.is_meta:
            self.load_(weight)

    def own_range(self) -> tuple[int, int]:
        """The elements of the flattened weight this rank stores, ``[start, stop)``; ``stop`` may pass the end (the
        padding of the last shards)."""
        length = self.shard_numel * (self.topology.world_size // self._parts)
        return self._position * length, (self._position + 1) * length

    def load_(self, weight: torch.Tensor) -> None:
        """Quantize this rank's part from the full ``weight`` (the same tensor on every rank; no communication)."""
        if tuple(weight.shape) != tuple(self.shape):
            raise ValueError(f"a frozen INT8 weight of shape {tuple(self.shape)} cannot load a tensor of shape "
                             f"{tuple(weight.shape)}")
        codes, scales = self._quantize_rows(weight.detach().reshape(-1), self.topology.world_size)
        self.codes = codes.view(self._parts, -1)[self._position].clone()
        self.scales = scales.view(self._parts, -1)[self._position].clone()
        if self._held is not None:  # the held copy is stale; every rank has the codes a gather would return
            self._held = {self.compute_dtype: self._dequantize(codes, scales, self.compute_dtype)}

    def load_own_part_(self, values: torch.Tensor) -> None:
        """Quantize this rank's part from just its elements (:meth:`own_range`, cut at the weight's end): blocks
        never cross a shard, so the codes equal those :meth:`load_` gives from the full weight."""
        start, stop = self.own_range()
        if values.numel() != max(0, min(stop, self.numel) - start):
            raise ValueError(f"a frozen INT8 weight's part [{start}, {min(stop, self.numel)}) cannot load "
                             f"{values.numel()} values")
        codes, scales = self._quantize_rows(values.reshape(-1), (stop - start) // self.shard_numel)
        self.codes, self.scales = codes.reshape(-1), scales.reshape(-1)
        self._held = None

    def _quantize_rows(self, flat: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``flat`` padded with zeros to ``rows`` shards, each quantized in blocks of its own."""
        padded = torch.zeros(rows * self.shard_numel, dtype=self.dtype, device=self.device)
        padded[: flat.numel()] = flat.to(padded.device, self.dtype)
        return kernels.quantize(padded.view(rows, self.shard_numel), self.bits, self.block_size,
                                backend=self.backend)

    def stored_bytes(self) -> int:
        return nbytes(self.codes) + nbytes(self.scales)

    def hold(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Keep the weight dequantized (in its compute dtype) from these gathered ``codes`` and ``scales`` until
        :meth:`release`: later uses communicate nothing. :func:`hold_all` gathers them."""
        self._held = {self.compute_dtype: self._dequantize(codes, scales, self.compute_dtype)}

    def release(self) -> None:
        self._held = None

    @property
    def is_held(self) -> bool:
        return self._held is not None

    def held_bytes(self) -> int:
        return sum(weight.untyped_storage().nbytes() for weight in (self._held or {}).values())

    def materialize(self, dtype: torch.dtype) -> torch.Tensor:
        """The full weight in ``dtype``: gathered (INT8) and dequantized now, a temporary tensor — or, while held,
        the held one (cast once, and kept, if another dtype is asked for: no gather inside the block)."""
        if self._held is None:
            return self._dequantize(*self._gather(), dtype)
        if dtype not in self._held:
            self._held[dtype] = self._held[self.compute_dtype].to(dtype)
        return self._held[dtype]

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's codes and scales of this weight, as ``(parts, bytes)`` int8 rows."""
        return tuple(_gather_packed([self]))

    def gather_description(self) -> str:
        return (f"frozen int{self.bits} weight all_gather" + (" (hpZ copy)" if self.uses_hpz else "")
                + f", kernels {kernels.active_backend(self.codes.device, self.backend)}")

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        world = self.topology.world_size
        weight = kernels.dequantize(codes.view(world, -1), scales.view(torch.float32).view(world, -1), bits=self.bits,
                                    block_size=self.block_size, length=self.shard_numel, dtype=dtype,
                                    backend=self.backend)
        return weight.view(-1)[: self.numel].view(self.shape)


def _gather_packed(stores: list[FrozenInt8Weight]) -> list[torch.Tensor]:
    """The gathered codes and scales of ``stores`` (all on one group), in that order, from one collective."""
    first = stores[0]
    parts = all_gather_packed([t for store in stores for t in (store.codes, store.scales)], first.group)
    first.meter.record("frozen_allgather", first.group, sum(store.stored_bytes() for store in stores),
                       first.gather_description() + (f", {len(stores)} weights packed" if len(stores) > 1 else ""))
    return parts


def hold_all(stores: list[FrozenInt8Weight]) -> None:
    """Gather every store not held yet — one packed all-gather per group, not one per weight: at block entry the
    per-collective latency of tens of small gathers costs more than the bytes — and hold each dequantized (a
    collective: every rank calls it with the same stores)."""
    by_group: dict[int, list[FrozenInt8Weight]] = {}
    for store in stores:
        if not store.is_held:
            by_group.setdefault(id(store.group), []).append(store)
    for group_stores in by_group.values():
        parts = _gather_packed(group_stores)
        for index, store in enumerate(group_stores):
            store.hold(parts[2 * index], parts[2 * index + 1])


class _FrozenMatmul(torch.autograd.Function):
    """``x @ W`` (``transpose=False``, Conv1D layout) or ``x @ W.T`` (nn.Linear) with a gathered-on-use W.

    Nothing of W is saved for backward: backward gathers it again, as FSDP regathers an unsharded parameter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, store: FrozenInt8Weight, transpose: bool) -> torch.Tensor:
        ctx.store, ctx.transpose = store, transpose
        weight = store.materialize(x.dtype)
        return x @ (weight.t() if transpose else weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight = ctx.store.materialize(grad_output.dtype)
        return grad_output @ (weight if ctx.transpose else weight.t()), None, None


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = _FrozenMatmul.apply(x, self._zeropp_frozen, True)
    return out + self.bias if self.bias is not None else out


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = _FrozenMatmul.apply(x, self._zeropp_frozen, False)
    return out + self.bias if self.bias is not None else out


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    weight = self._zeropp_frozen.materialize(self._zeropp_frozen.compute_dtype)
    return F.embedding(ids, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                       self.sparse)


def _forward_for(module: nn.Module):
    if isinstance(module, nn.Linear):
        return _linear_forward
    if isinstance(module, nn.Embedding):
        return _embedding_forward
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 projection layer
        return _conv1d_forward
    return None


def quantize_frozen_weights(model: nn.Module, topology: Topology, meter: CommMeter, bits: int, block_size: int,
                            compute_dtype: torch.dtype, source: FrozenWeightSource | None = None,
                            backend: kernels.Backend | None = None) -> dict[str, FrozenInt8Weight]:
    """Replace every frozen floating weight of a Linear/Conv1D/Embedding by INT8 shards; returns them by name.

    Tied weights (one Parameter used by several modules) share one store. Non-floating frozen tensors, frozen
    parameters of other modules (LayerNorm) and the output head (with the embedding tied to it) stay as they are:
    the head's precision matters most for the logits, and RL trainers (TRL's fused log-prob head) read its
    ``weight`` directly. ``source`` gives a weight's real values when the model holds none (on the meta device):
    each rank's own part, read as it is quantized and not kept.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = {id(head.weight)} if isinstance(getattr(head, "weight", None), torch.Tensor) else set()
    stores: dict[int, FrozenInt8Weight] = {}
    converted: dict[str, FrozenInt8Weight] = {}
    for name, module in model.named_modules():
        forward = _forward_for(module)
        weight = module._parameters.get("weight") if forward is not None else None
        if weight is None or weight.requires_grad or not weight.is_floating_point() or id(weight) in kept:
            continue
        key = f"{name}.weight" if name else "weight"
        store = stores.get(id(weight))
        if store is None:
            shape_only = weight if source is None else weight.to("meta")
            store = stores[id(weight)] = FrozenInt8Weight(shape_only, topology, meter, bits, block_size,
                                                          compute_dtype or weight.dtype, backend,
                                                          device=source.device if source is not None else None)
            if source is not None:
                source.fill(key, store)
        del module._parameters["weight"]
        # a shape/dtype-only stand-in, for code (peft, generation utilities) that inspects `.weight`
        module.weight = torch.empty(store.shape, dtype=weight.dtype, device="meta")
        module._zeropp_frozen = store
        module.forward = types.MethodType(forward, module)
        converted[key] = store
    if not converted:
        warnings.warn("quantized_nontrainable_weights=True but the model has no frozen Linear/Conv1D/Embedding "
                      "weights; nothing was quantized (freeze the base model, e.g. with peft, first)", stacklevel=3)
    return converted


class FrozenWeightSource(Protocol):
    """Where the values of frozen weights come from when the model being sharded holds none (meta device)."""

    device: torch.device

    def fill(self, name: str, store: FrozenInt8Weight) -> None:
        """Load ``store`` (the weight named ``name`` in the model's state dict) with its real values."""


def frozen_stores(model: nn.Module) -> dict[str, FrozenInt8Weight]:
    """The INT8 stores of ``model`` by the state-dict name of the weight each replaced (tied weights: every name)."""
    return {f"{name}.weight" if name else "weight": module._zeropp_frozen
            for name, module in model.named_modules() if hasattr(module, "_zeropp_frozen")}


def unique_frozen_stores(model: nn.Module) -> list[FrozenInt8Weight]:
    """Each INT8 store of ``model`` once (a tied weight's store serves several names)."""
    return list({id(store): store for store in frozen_stores(model).values()}.values())


def frozen_weight_bytes(model: nn.Module) -> int:
    """Bytes this rank holds for INT8-stored frozen weights (shards, scales and hpZ copies)."""
    return sum(store.stored_bytes() for store in unique_frozen_stores(model))


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of dequantized frozen weights held right now (by :func:`hf_zeropp.gathered_for_inference`)."""
    return sum(store.held_bytes() for store in unique_frozen_stores(model))
