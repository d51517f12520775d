"""Inference that gathers the weights once per call instead of once per forward: ``generate()`` and marked loops.

FSDP gathers a unit's weights for every forward and frees them after it, which is right for training (backward
gathers again) but makes token-by-token generation pay a whole-model all-gather per generated token — ZeRO-3's
generation is then bound by the links, not by compute. Entering :func:`gathered_for_inference` gathers every FSDP
unit's weights and every INT8-stored frozen weight (dequantized once, in the compute dtype); they are kept until
the block ends, then freed, and the model is back to its shards. With hpZ the frozen weights' gathers stay inside
the node (their secondary copy is permanent); trainable weights (adapters, norms) are gathered from their world
shards.

Because everything is gathered on entry, forwards inside the block run no collective: ranks may run different
numbers of them. ``generate()`` therefore runs without ``synced_gpus`` on the per-call path (a rank whose sequences
are finished stops, instead of running dummy forwards until every rank is done and all-reducing a flag across the
nodes per token), unless the caller passes ``synced_gpus`` explicitly.

Memory: while the block runs every rank holds the whole model's weights in the compute dtype (what one unsharded
replica takes) on top of its shards. ``ZeroPPConfig(generation_gather="per_token")`` keeps FSDP's per-forward
gathering in ``generate()`` for models too large for that; the block can be used or not per call site.

An optimizer step inside the block is safe: the step hook installed by ``shard_model`` drops every gathered copy
of the weights it updated, so the next forward gathers the new ones (a collective again) and keeps them; a
``generate()`` or nested block after the step gathers them on entry, so generation stays collective-free.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._compat import keep_all_gathered, unshard_all
from .frozen import hold_all, unique_frozen_stores
from ..comm.hpz import reshard_all

PER_CALL = "weights gathered once per call (generate() or gathered_for_inference), freed after it"
PER_TOKEN = "weights gathered for every forward (generation_gather='per_token')"


@contextlib.contextmanager
def gathered_for_inference(model: nn.Module) -> Iterator[nn.Module]:
    """Gather all of ``model``'s weights on entry and keep them until the block ends (every rank must enter it: the
    gathers are collectives); forwards inside it communicate nothing. For generation and no-grad forward loops:
    evaluation, rewards, reference log-probs. Re-entering (``generate()`` inside the block) gathers again only what
    an optimizer step inside the outer block dropped. A model that is not sharded (a one-process run, where
    ``hf_zeropp.Accelerator`` shards nothing) has nothing to gather: the block is a no-op. A part of a sharded model
    is refused: the block belongs around the model ``shard_model`` returned."""
    state = getattr(model, "_zeropp", None)
    if state is None:
        if any(isinstance(module, FSDPModule) for module in model.modules()):
            raise ValueError(f"gathered_for_inference got a part of a sharded model ({type(model).__name__}); pass "
                             f"the model that shard_model or hf_zeropp.Accelerator.prepare returned")
        yield model
        return
    if state.inference_depth:
        unshard_all(model)  # what an optimizer step inside the outer block dropped
        yield model
        return
    stores = unique_frozen_stores(model)
    state.inference_depth += 1
    try:
        hold_all(stores)
        with keep_all_gathered(model):
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
        kwargs.setdefault("synced_gpus", False)  # nothing inside the block is a collective (module docstring)
        with gathered_for_inference(model):
            return generate(*args, **kwargs)

    @functools.wraps(generate)
    def generate_per_token(*args: Any, **kwargs: Any) -> Any:
        if not model._zeropp.inference_depth:
            model._zeropp.meter.note("inference", PER_TOKEN)
        return generate(*args, **kwargs)

    model.generate = generate_per_call if gather == "per_call" else generate_per_token
