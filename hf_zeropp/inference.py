"""Inference that gathers the weights once per call instead of once per forward: ``generate()`` and marked loops.

FSDP gathers a unit's weights for every forward and frees them after it, which is right for training (backward
gathers again) but makes token-by-token generation pay a whole-model all-gather per generated token — ZeRO-3's
generation is then bound by the links, not by compute. Inside :func:`gathered_for_inference` each FSDP unit keeps
the weights its first forward gathered, and each INT8-stored frozen weight keeps the copy its first use dequantized,
until the block ends; then everything is freed and the model is back to its shards. With hpZ the frozen weights'
gathers stay inside the node (their secondary copy is permanent); trainable weights (adapters, norms) are gathered
once per call from their world shards, as the first forward after an optimizer step always does.

Memory: while the block runs every rank holds the whole model's weights in the compute dtype (what one unsharded
replica takes) on top of its shards. ``ZeroPPConfig(generation_gather="per_token")`` keeps FSDP's per-forward
gathering in ``generate()`` for models too large for that; the block can be used or not per call site.

An optimizer step inside the block is safe: the step hook installed by ``shard_model`` drops every gathered copy
of the weights it updated, so the next forward gathers the new ones (and keeps them).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ._compat import keep_gathered_after_forward
from .frozen import unique_frozen_stores
from .hpz import reshard_all

PER_CALL = "weights gathered once per call (generate() or gathered_for_inference), freed after it"
PER_TOKEN = "weights gathered for every forward (generation_gather='per_token')"


@contextlib.contextmanager
def gathered_for_inference(model: nn.Module) -> Iterator[nn.Module]:
    """Gather ``model``'s weights at their first use inside the block and keep them until it ends (every rank must
    enter it: the gathers are collectives). For generation and no-grad forward loops: evaluation, rewards,
    reference log-probs. Re-entering (``generate()`` inside the block) is a no-op, and so is a model that is not
    sharded (a one-process run, where ``hf_zeropp.Accelerator`` shards nothing): it has nothing to gather. A part
    of a sharded model is refused: the block belongs around the model ``shard_model`` returned."""
    state = getattr(model, "_zeropp", None)
    if state is None:
        if any(isinstance(module, FSDPModule) for module in model.modules()):
            raise ValueError(f"gathered_for_inference got a part of a sharded model ({type(model).__name__}); pass "
                             f"the model that shard_model or hf_zeropp.Accelerator.prepare returned")
        yield model
        return
    if state.inference_depth:
        yield model
        return
    stores = unique_frozen_stores(model)
    state.inference_depth += 1
    try:
        with keep_gathered_after_forward(model):
            for store in stores:
                store.hold()
            state.meter.note("inference", PER_CALL)
            yield model
    finally:
        state.inference_depth -= 1
        for store in stores:
            store.release()
        reshard_all(model)


def route_generate(model: nn.Module, gather: str) -> None:
    """Make ``model.generate`` (already FSDP's forward method) gather ``"per_call"`` (inside
    :func:`gathered_for_inference`) or ``"per_token"`` (FSDP's own per-forward gathering); each call says which
    in ``comm_stats()["implementations"]["inference"]``."""
    generate = model.generate

    @functools.wraps(generate)
    def generate_per_call(*args: Any, **kwargs: Any) -> Any:
        with gathered_for_inference(model):
            return generate(*args, **kwargs)

    @functools.wraps(generate)
    def generate_per_token(*args: Any, **kwargs: Any) -> Any:
        if not model._zeropp.inference_depth:
            model._zeropp.meter.note("inference", PER_TOKEN)
        return generate(*args, **kwargs)

    model.generate = generate_per_call if gather == "per_call" else generate_per_token
