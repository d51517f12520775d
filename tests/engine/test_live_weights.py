"""Stage 3's memory knobs (DeepSpeed's ``stage3_*`` keys, :mod:`hf_zeropp.engine.live_weights`): which units of a real
tiny GPT-2 stay gathered for a budget, and, in one 2-rank launch, that every budget, persistence and prefetch depth
trains equal to plain ZeRO-3 and to stock DDP (fp32, 1e-6) while the backward gathers of the kept units leave the
byte count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_zeropp import ZeroPPConfig
from hf_zeropp.engine.live_weights import plan_prefetch, resolve_hidden_size_auto, units_kept_gathered
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import full_parameters, local_batch, make_optimizer, relative_error, tiny_gpt2

LAYERS, STEPS, EXACT = 3, 3, 1e-6
BLOCK = 12 * 32 * 32 + 13 * 32  # one GPT-2 block at n_embd 32: weights and biases, two layer norms
ROOT = 128 * 32 + 32 * 32 + 2 * 32  # tied embedding, positions, final layer norm


def _kept(**knobs) -> list[str]:
    model = tiny_gpt2(n_layer=LAYERS)
    units = list(model.transformer.h)
    names = {id(module): name for name, module in model.named_modules()}
    kept, _ = units_kept_gathered(model, units, ZeroPPConfig(**knobs), set())
    return sorted(names[id(unit)] for unit in kept)


def test_the_units_nearest_the_loss_stay_gathered_within_the_budget():
    assert _kept() == []  # plain ZeRO-3: every unit reshards
    assert _kept(max_live_parameters=10**9, max_reuse_distance=10**9) == ["transformer.h.0", "transformer.h.1",
                                                                           "transformer.h.2"]
    # the live budget: the root's weights plus the kept units'
    assert _kept(max_live_parameters=ROOT + 2 * BLOCK, max_reuse_distance=10**9) == ["transformer.h.1",
                                                                                      "transformer.h.2"]
    assert _kept(max_live_parameters=ROOT + 2 * BLOCK - 1, max_reuse_distance=10**9) == ["transformer.h.2"]
    # the reuse distance: block 2 waits for the root's weights (forward and backward), block 1 also for block 2's
    assert _kept(max_live_parameters=10**9, max_reuse_distance=2 * ROOT + 1) == ["transformer.h.2"]
    assert _kept(max_live_parameters=10**9, max_reuse_distance=2 * (ROOT + BLOCK) + 1) == ["transformer.h.1",
                                                                                            "transformer.h.2"]
    assert _kept(max_live_parameters=10**9, max_reuse_distance=2 * ROOT) == []


def _prefetched(**knobs) -> tuple[list[list[str]], list[list[str]], int]:
    """Per unit, the blocks it prefetches in forward (root first) and in backward (root first, then h.2 ...)."""
    model = tiny_gpt2(n_layer=LAYERS)
    units = list(model.transformer.h)
    config = ZeroPPConfig(stage=3, **knobs)
    kept, _ = units_kept_gathered(model, units, config, set())
    plan = plan_prefetch(model, units, config, set(), kept)
    names = {id(module): name.removeprefix("transformer.") for name, module in model.named_modules()}
    return ([[names[id(u)] for u in ahead] for ahead in plan.forward],
            [[names[id(u)] for u in ahead] for ahead in plan.backward], plan.over_budget)


def test_prefetch_depth_is_the_bucket_capped_by_the_live_budget():
    assert _prefetched() == ([["h.0"], ["h.1"], ["h.2"]], [["h.2"], ["h.1"], ["h.0"]], 0)
    deep = ([["h.0", "h.1", "h.2"], ["h.1", "h.2"], ["h.2"]], [["h.2", "h.1", "h.0"], ["h.1", "h.0"], ["h.0"]], 0)
    assert _prefetched(prefetch_bucket_size=10**9) == deep
    # nothing kept (reuse distance 1): the budget holds the root and all three blocks, so the depth is the bucket's
    assert _prefetched(prefetch_bucket_size=10**9, max_live_parameters=ROOT + 3 * BLOCK, max_reuse_distance=1) == deep
    # h.1 and h.2 kept: a block is prefetched only where it fits whole beside the root, the kept blocks and the
    # running one; the backward of the root and of h.2 has no room for h.0, which FSDP2 prefetches anyway
    assert _prefetched(prefetch_bucket_size=10**9, max_live_parameters=ROOT + 3 * BLOCK - 1,
                       max_reuse_distance=10**9) == ([["h.0", "h.1"], ["h.1"], ["h.2"]], [[], [], ["h.0"]], 2)
    # a budget of 0 (DeepSpeed's "regather" config, stage3_max_live_parameters 0): nothing kept and no gather ahead
    # (DeepSpeed's coordinator prefetches min(max_live - live, bucket) elements), except the backward's one unit that
    # FSDP2 cannot turn off
    assert _prefetched(prefetch_bucket_size=10**9, max_live_parameters=0) == ([[], [], []], [[], [], []], 3)


def test_auto_is_filled_from_the_hidden_size_as_transformers_fills_it():
    config = resolve_hidden_size_auto(tiny_gpt2(), ZeroPPConfig(persistence_threshold="auto",
                                                                prefetch_bucket_size="auto"))
    assert (config.persistence_threshold, config.prefetch_bucket_size) == (320, int(0.9 * 32 * 32))
    with pytest.raises(ValueError, match="hidden size"):
        resolve_hidden_size_auto(torch.nn.Linear(2, 2), ZeroPPConfig(persistence_threshold="auto"))


def test_deepspeed_keys_map_with_deepspeeds_defaults():
    ds = ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert (ds.max_live_parameters, ds.max_reuse_distance, ds.persistence_threshold, ds.prefetch_bucket_size) == (
        10**9, 10**9, 10**5, 5 * 10**7)
    docs = ZeroPPConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto"}})
    assert (docs.max_live_parameters, docs.max_reuse_distance, docs.persistence_threshold) == (10**9, 0, "auto")
    with pytest.warns(UserWarning, match="stage3_max_live_parameters"):
        two = ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}})
    assert two.max_live_parameters is None
    with pytest.raises(ValueError, match="stage3_max_reuse_distance"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": "auto"}})
    with pytest.raises(ValueError, match="needs stage 3"):
        ZeroPPConfig(stage=2, max_live_parameters=10)


# name -> config: plain ZeRO-3 first (the reference), then the knobs
RUNS = {
    "zero3": {"stage": 3},
    "all kept, deep prefetch": {"stage": 3, "max_live_parameters": 10**9, "max_reuse_distance": 10**9,
                                "prefetch_bucket_size": 10**9},
    "last unit kept": {"stage": 3, "max_live_parameters": ROOT + BLOCK, "max_reuse_distance": 10**9},
    "none kept, deep prefetch": {"stage": 3, "prefetch_bucket_size": 10**9},
    "deepspeed docs": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                                             "stage3_prefetch_bucket_size": "auto"}},
}


def _train_every_run() -> dict:
    import hf_zeropp
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name, values in {**RUNS, "ddp": None}.items():
        model = tiny_gpt2(n_layer=LAYERS)
        model = DistributedDataParallel(model) if values is None else hf_zeropp.shard_model(model, values)
        optimizer = make_optimizer(model)
        losses = []
        for step in range(STEPS):
            ids = local_batch(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        weights = full_parameters(model.module if values is None else model)
        out[name] = {"losses": losses, "weights": {k.removeprefix("module."): v for k, v in weights.items()},
                     "stats": None if values is None else hf_zeropp.comm_stats(model)}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_train_every_run, 2)[0]


def test_every_budget_trains_as_zero3_and_ddp(runs):
    for name in [*RUNS, "ddp"]:
        for key, expected in runs["zero3"]["weights"].items():
            assert relative_error(runs[name]["weights"][key], expected) < EXACT, (name, key)
        assert runs[name]["losses"] == pytest.approx(runs["zero3"]["losses"], rel=EXACT), name


def test_kept_units_gather_once_per_step(runs):
    def gathered(name: str, kind: str) -> int:
        return runs[name]["stats"].get(kind, {}).get("intra_node", 0)

    forward = gathered("zero3", "fwd_allgather")
    assert gathered("zero3", "bwd_allgather") > 0
    assert gathered("all kept, deep prefetch", "bwd_allgather") == 0
    assert gathered("all kept, deep prefetch", "fwd_allgather") == forward
    for kind in ("fwd_allgather", "bwd_allgather"):  # prefetching every unit ahead gathers no more than one ahead
        assert gathered("none kept, deep prefetch", kind) == gathered("zero3", kind)
    # the backward gathers the two units that reshard, not the kept one: 2 of the 3 blocks' bytes
    assert gathered("last unit kept", "bwd_allgather") == pytest.approx(gathered("zero3", "bwd_allgather") * 2 / 3,
                                                                         rel=0.01)
    # its budget (the root and one block) has no room for a backward prefetch, which FSDP2 does anyway: said
    assert "no room for a backward prefetch" in runs["last unit kept"]["stats"]["implementations"]["prefetch_depth"][0]
    docs = runs["deepspeed docs"]["stats"]
    assert gathered("deepspeed docs", "bwd_allgather") == 0
    assert "3 of 3 units keep" in docs["implementations"]["live_weights"][0]
    assert "persistence_threshold" in docs["implementations"]["persistent_parameters"][0]
    # biases and layer norms travel in one fp32 all-reduce per backward, not in the gathers
    assert docs["replicated_grad_allreduce"]["calls"] == STEPS
    assert gathered("deepspeed docs", "fwd_allgather") < forward
