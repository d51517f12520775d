"""The engine's rules (docs/design.md, "Engine rules"): no forward computes with stale weights, ranks start from the same
weights as under DDP, the node size is found from the launch, a technique that cannot apply says so, frozen weights
are not kept alive by an optimizer, and comm_stats names every implementation that ran."""

from __future__ import annotations

import gc
import os
import socket
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.config.config import ZeroPPConfig
from hf_zeropp.comm.node_size import node_size_from_environment
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import VOCAB, full_parameters, local_batch, make_optimizer, tiny_gpt2, train

STALE_CONFIGS = {"zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
                 "hpz": {"stage": 3, "hpz_partition_size": "node"},
                 "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node",
                            "quantized_gradients": True},
                 "hybrid-q": {"stage": 3, "shard_group": "node", "hybrid_gradient_bits": 4},
                 "hybrid-q stage 2": {"stage": 2, "shard_group": "node", "hybrid_gradient_bits": 4}}


def _loss_after_one_step(options: dict, forward_between: bool) -> dict[str, float]:
    """GPT-2 2 x 32, SGD lr 0.5: backward, optionally a no-grad forward (an evaluation, generate(), a reward), step;
    then the loss of a forward with the new weights."""
    import hf_zeropp

    model = tiny_gpt2()
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = local_batch(0)
    before = model(input_ids=ids, labels=ids).loss
    before.backward()
    if forward_between:
        with torch.no_grad():
            model(input_ids=ids)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    return {"before": float(before), "after": float(after)}


def _stale_weight_runs() -> dict:
    return {name: {between: _loss_after_one_step(options, between) for between in (False, True)}
            for name, options in STALE_CONFIGS.items()}


def test_a_no_grad_forward_between_backward_and_step_leaves_no_stale_weights():
    """Stage 2 keeps the gathered weights after a forward and hpZ keeps its secondary shard; from a forward after
    backward they would survive the step (before the fix: the post-step loss equalled the pre-step loss)."""
    for rank_result in run_distributed(_stale_weight_runs, 4, node_size=2):
        for name, runs in rank_result.items():
            plain, with_forward = runs[False], runs[True]
            assert plain["after"] < plain["before"] - 0.01, (name, plain)
            assert with_forward["after"] == plain["after"], (name, runs)


def _loss_after_a_step_with_an_unconsumed_prefetch(options: dict, call_first_block: bool) -> float:
    """Backward, then (optionally) the first block called on its own under no_grad: its forward prefetches the
    next block's gather, which nothing consumes before the optimizer step; then the loss with the new weights."""
    import hf_zeropp

    model = tiny_gpt2()
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = local_batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    if call_first_block:
        with torch.no_grad():
            model.transformer.h[0](torch.randn(*ids.shape, model.config.n_embd))
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _unconsumed_prefetch_runs() -> dict:
    return {name: {call: _loss_after_a_step_with_an_unconsumed_prefetch(STALE_CONFIGS[name], call)
                   for call in (False, True)} for name in ("zero3", "zeropp", "hybrid-q")}


def test_a_prefetched_gather_never_serves_weights_from_before_a_step():
    """On CPU every unit's forward starts the next unit's gather; one that no forward consumed (a block called on
    its own) is dropped by the post-step hook, or FSDP would serve it at the next forward with the old weights."""
    for rank_result in run_distributed(_unconsumed_prefetch_runs, 4, node_size=2):
        for name, runs in rank_result.items():
            assert runs[True] == runs[False], (name, runs)


def _forward_gather_order(options: dict) -> dict:
    """The order in which forward gathers start and blocks compute, and the async_op FSDP passed each gather."""
    import hf_zeropp
    from hf_zeropp._compat import in_backward
    from hf_zeropp.comm.qwz import QuantizedAllGather

    model = tiny_gpt2(n_layer=3)
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
    events, async_flags = [], []
    original_call = QuantizedAllGather.__call__

    def call(self, output_tensor, input_tensor, group, async_op=False):
        if not in_backward():
            events.append("gather")
        async_flags.append(async_op)
        return original_call(self, output_tensor, input_tensor, group, async_op)

    QuantizedAllGather.__call__ = call
    try:
        for index, block in enumerate(model.transformer.h):
            block.attn.register_forward_pre_hook(lambda module, args, index=index: events.append(f"block{index}"))
        ids = local_batch(0)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        QuantizedAllGather.__call__ = original_call
    return {"events": events, "async": async_flags}


def _gather_order_runs() -> dict:
    return {name: _forward_gather_order(STALE_CONFIGS[name]) for name in ("zero3", "zeropp")}


def test_gathers_are_prefetched_and_asynchronous_on_cpu():
    """gloo collectives block the host unless issued async: every gather (forward and backward) is, and in forward
    the gather of block k+1 starts before block k computes — the root, block 0 and block 1 are in flight or done
    when block 0 starts (without prefetching: only the root and block 0)."""
    for rank_result in run_distributed(_gather_order_runs, 4, node_size=2):
        for name, got in rank_result.items():
            events = got["events"]
            units = 4  # root + 3 blocks
            for k in range(3):
                started = events[: events.index(f"block{k}")].count("gather")
                assert started == min(k + 3, units), (name, k, events)
            assert got["async"] and all(got["async"]), (name, got["async"])


def _per_rank_init(config: ZeroPPConfig) -> dict:
    """Every rank builds its own random weights (seeded by rank, as a script that seeds per rank or not at all)."""
    import hf_zeropp

    rank = dist.get_rank()
    model = tiny_gpt2(seed=100 + rank)
    rank0_init = tiny_gpt2(seed=100).state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_zeropp.shard_model(model, config)
    full = full_parameters(model)
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for name, p in model.named_parameters()}
    return {"equal_to_rank0": all(torch.equal(full[name], rank0_init[name]) for name in full),
            "local": local, "warned": any("different initial weights" in str(w.message) for w in caught)}


@pytest.mark.parametrize("config", [ZeroPPConfig(stage=0), ZeroPPConfig(stage=3), ZeroPPConfig.preset("hybrid-q")],
                         ids=["stage0", "stage3", "hybrid-q"])
def test_ranks_start_from_rank_0_weights_as_under_ddp(config):
    """Replicas (stage 0's ranks; hybrid sharding's nodes, rank r and r + 2 here) hold the same weights."""
    results = run_distributed(_per_rank_init, 4, config, node_size=2)
    assert all(r["equal_to_rank0"] for r in results)
    assert results[0]["warned"] and not any(r["warned"] for r in results[1:])
    replicas = [(0, 1, 2, 3)] if config.stage == 0 else [(0, 2), (1, 3)] if config.shard_group == "node" else []
    for group in replicas:
        for name, value in results[group[0]]["local"].items():
            assert all(torch.equal(results[r]["local"][name], value) for r in group[1:]), (group, name)


def test_node_size_from_the_launchers_variables():
    assert node_size_from_environment({}) is None
    assert node_size_from_environment({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"})[0] == 8
    assert node_size_from_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)")
    assert node_size_from_environment({"MPI_LOCALNRANKS": "2"})[0] == 2
    assert node_size_from_environment({"MV2_COMM_WORLD_LOCAL_SIZE": "2"})[0] == 2
    assert node_size_from_environment({"SLURM_NTASKS_PER_NODE": "4"})[0] == 4
    assert node_size_from_environment({"SLURM_TASKS_PER_NODE": "4(x2)"})[0] == 4
    assert node_size_from_environment({"SLURM_TASKS_PER_NODE": "8,8"})[0] == 8
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='4\(x2\),3': nodes run different numbers of ranks"):
        node_size_from_environment({"SLURM_TASKS_PER_NODE": "4(x2),3"})
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_LOCAL_SIZE='x' .* is not a positive number"):
        node_size_from_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": "x"})


def _launch_without_launcher_variables(hosts: list[str], preset: str) -> dict:
    """A custom launcher: no LOCAL_WORLD_SIZE or similar; this rank runs on ``hosts[rank]``."""
    import hf_zeropp

    os.environ.pop("LOCAL_WORLD_SIZE")
    socket.gethostname = lambda: hosts[dist.get_rank()]
    model = tiny_gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hf_zeropp.shard_model(model, preset)
        except ValueError as error:
            return {"error": str(error)}
    ids = local_batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    state = model._zeropp
    return {"node_size": state.topology.node_size, "source": state.topology.node_size_source,
            "active": hf_zeropp.active_techniques(model), "stats": hf_zeropp.comm_stats(model),
            "warnings": [str(w.message) for w in caught if "not applied" in str(w.message)]}


def test_without_launcher_variables_the_host_names_give_the_node_size():
    two_hosts = run_distributed(_launch_without_launcher_variables, 4, ["a", "a", "b", "b"], "zeropp")
    for result in two_hosts:
        assert result["node_size"] == 2 and result["source"] == "host names (2 host(s))"
        assert result["active"] == {"quantized_weights": True, "hpz": True, "quantized_gradients": True}
        assert result["stats"]["bwd_allgather"]["inter_node"] == 0 and result["stats"]["qgz_inter"]["inter_node"] > 0
    interleaved = run_distributed(_launch_without_launcher_variables, 4, ["a", "b", "a", "b"], "zeropp")
    assert all("ranks are not numbered node by node" in r["error"] for r in interleaved)


def test_a_technique_that_cannot_apply_is_reported_off_with_the_reason():
    """One host: every rank on one node. qwZ (it only quantizes gathers that cross nodes) and hpZ (its secondary
    shard would be the whole world) do not apply: active_techniques says so, comm_stats says why, rank 0 warns."""
    results = run_distributed(_launch_without_launcher_variables, 4, ["a"] * 4, "zeropp")
    for rank, result in enumerate(results):
        assert result["node_size"] == 4
        assert result["active"] == {"quantized_weights": False, "hpz": False, "quantized_gradients": True}
        implementations = result["stats"]["implementations"]
        assert "not applied" in implementations["quantized_weights"][0]
        assert "all 4 ranks are on one node" in implementations["hpz"][0]
        assert not any("qwZ" in line for line in implementations["fwd_allgather"])
        assert len(result["warnings"]) == (2 if rank == 0 else 0), result["warnings"]
    hybrid = ZeroPPConfig.preset("hybrid-q", gradient_error_feedback=True)
    for rank, result in enumerate(run_distributed(_launch_without_launcher_variables, 4, ["a"] * 4, hybrid)):
        assert result["stats"]["implementations"]["shard_group"] == [
            "not applied: hybrid sharding replicates across nodes, and all 4 ranks are on one node (node size 4 from "
            "host names (1 host(s))): it runs as ZeRO-3 (preset zero3) (and nothing crosses nodes for "
            "hybrid_gradient_bits to quantize)"]
        assert len(result["warnings"]) == (1 if rank == 0 else 0), result["warnings"]
        assert "hybrid_reduce_scatter" not in result["stats"]


def _tiny_openai_gpt():
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    torch.manual_seed(0)
    return OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _openai_gpt_in_two_placements() -> dict:
    """A transformers model that lists no _no_split_modules (OpenAI GPT), sharded as it comes and with its layers
    named: the warnings, comm_stats' line, the units, and the losses of three AdamW steps of each."""
    import hf_zeropp

    result = {}
    for name, wrap in (("as_it_comes", None), ("layers_named", ["Block"])):
        model = _tiny_openai_gpt()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, wrap_modules=wrap))
        losses = train(model, make_optimizer(model), range(3))
        result[name] = {"warnings": [str(w.message) for w in caught if "hf_zeropp" in str(w.message)],
                        "units": len(model._zeropp.units), "losses": losses,
                        "fsdp_units": hf_zeropp.comm_stats(model)["implementations"].get("fsdp_units")}
    return result


def test_a_model_without_layer_classes_is_one_unit_and_says_so_with_the_fix():
    """OpenAI GPT lists no _no_split_modules: its layers would silently share one FSDP unit (stage 3 gathers every
    weight at once). Rank 0 warns once, comm_stats says so with the option that fixes it, and either way the losses
    are stock's (the same model unsharded in one process on the global batch)."""
    stock_model = _tiny_openai_gpt()
    stock = train(stock_model, make_optimizer(stock_model), range(3))
    for rank, result in enumerate(run_distributed(_openai_gpt_in_two_placements, 4, node_size=2)):
        plain, named = result["as_it_comes"], result["layers_named"]
        assert plain["units"] == 0 and named["units"] == 2
        assert "OpenAIGPTLMHeadModel lists no _no_split_modules" in plain["fsdp_units"][0]
        assert "wrap_modules=['Block']" in plain["fsdp_units"][0]
        assert len(plain["warnings"]) == (1 if rank == 0 else 0), plain["warnings"]
        assert named["fsdp_units"] is None and not named["warnings"]
        assert plain["losses"] == pytest.approx(stock, rel=1e-6)
        assert named["losses"] == pytest.approx(stock, rel=1e-6)


def _frozen_weights_freed() -> dict:
    """An optimizer built on all parameters (frozen included) before prepare, with frozen INT8 weights."""
    import hf_zeropp
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    os.environ["ACCELERATE_USE_CPU"] = "true"
    accelerator = hf_zeropp.Accelerator(zeropp=hf_zeropp.ZeroPPConfig.preset("zeropp-lora", node_size=2))
    model = tiny_gpt2()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("transformer.ln_f"))
    frozen = weakref.ref(model.transformer.h[0].mlp.c_fc.weight)
    trainable = weakref.ref(model.transformer.ln_f.weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    gc.collect()
    held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    return {"frozen_alive": frozen() is not None, "trainable_alive": trainable() is not None,
            "held_are_the_shards": held == {id(p) for p in model.parameters()}}


def test_frozen_weights_stored_int8_are_not_kept_alive_by_the_optimizer():
    for result in run_distributed(_frozen_weights_freed, 4, node_size=2):
        assert not result["frozen_alive"] and not result["trainable_alive"], result
        assert result["held_are_the_shards"], result  # the INT8-stored weights dropped, the rest rebound


def _implementations_per_window() -> list[dict]:
    import hf_zeropp

    model = tiny_gpt2()
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, quantized_gradients=True, node_size=2,
                                                        kernel_backend="reference"))
    ids = local_batch(0)
    windows = []
    for quantized in (True, False, True):
        hf_zeropp.set_techniques(model, quantized_gradients=quantized)
        model(input_ids=ids, labels=ids).loss.backward()
        if quantized is False:  # the same window sees both implementations
            hf_zeropp.set_techniques(model, quantized_gradients=True)
            model(input_ids=ids, labels=ids).loss.backward()
        windows.append(hf_zeropp.comm_stats(model, reset=True)["implementations"])
    return windows


def test_comm_stats_lists_every_implementation_of_its_window_with_the_kernel_backend():
    first, mixed, last = run_distributed(_implementations_per_window, 4, node_size=2)[0]
    assert "grad_reduce_scatter" not in first and "grad_reduce_scatter" not in last  # reset between windows
    assert [line.split(",")[0] for line in mixed["qgz_inter"]] == ["qgZ 2-hop all-to-all int4/int4"]
    assert mixed["grad_reduce_scatter"] == ["reduce_scatter torch.float32"]
    assert all(line.endswith("kernels reference") for line in first["qgz_intra"] + first["qgz_inter"])


def _save_on_rank_0_only(directory: str) -> str:
    import datetime

    import hf_zeropp
    import hf_zeropp.engine.full_state

    hf_zeropp.engine.full_state.ARRIVAL_TIMEOUT = datetime.timedelta(seconds=3)
    model = tiny_gpt2()
    hf_zeropp.shard_model(model, "zero3")
    if dist.get_rank() != 0:
        return "not called"
    try:
        model.save_pretrained(directory)  # fine under DDP, a hang under FSDP
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_saving_on_rank_0_alone_fails_with_the_fix_instead_of_hanging(tmp_path):
    message = run_distributed(_save_on_rank_0_only, 2, str(tmp_path))[0]
    assert "is collective: every rank must call it" in message and "Ranks 1 failed" in message, message


def _schedules_outside_the_trainer() -> dict:
    """Rank 0 alone passes a config with a ``*_until`` schedule to shard_model and to hf_zeropp.Accelerator: a
    collective there would leave it waiting for rank 1 (which goes straight to the barrier). Then every rank shards
    with ``runs_schedule=True``, as the Trainer integration does."""
    import hf_zeropp

    result = {}
    if dist.get_rank() == 0:
        model = tiny_gpt2()
        try:
            hf_zeropp.shard_model(model, {"preset": "zeropp", "quantized_gradients_until": 0.5})
        except ValueError as error:
            result["shard_model"] = str(error)
        result["sharded"] = getattr(model, "_zeropp", None) is not None
        try:
            hf_zeropp.Accelerator(zeropp=hf_zeropp.ZeroPPConfig.preset("zeropp", hpz_until=0.25))
        except ValueError as error:
            result["accelerator"] = str(error)
    dist.barrier()
    model = hf_zeropp.shard_model(tiny_gpt2(), hf_zeropp.ZeroPPConfig.preset("zeropp", quantized_gradients_until=0.5),
                                  runs_schedule=True)
    result["scheduled"] = hf_zeropp.active_techniques(model)
    return result


def test_entry_points_without_the_trainer_refuse_a_schedule_before_any_collective():
    """quantized_weights_until / hpz_until / quantized_gradients_until need the training progress: shard_model and
    hf_zeropp.Accelerator used to ignore them silently; now they refuse, naming the field and the alternatives."""
    results = run_distributed(_schedules_outside_the_trainer, 2, node_size=1, pg_timeout=60)
    refused = results[0]
    assert not refused["sharded"]
    assert refused["shard_model"].startswith("quantized_gradients_until=0.5: schedules are applied only by the "
                                             "Trainer integration"), refused["shard_model"]
    assert "shard_model cannot tell how far training is" in refused["shard_model"]
    assert "hf_zeropp.set_techniques(model, quantized_gradients=False) once 50% of the steps" in refused["shard_model"]
    assert refused["accelerator"].startswith("hpz_until=0.25: schedules are applied only by the Trainer"), refused
    assert "hf_zeropp.Accelerator cannot tell" in refused["accelerator"]
    assert "hf_zeropp.set_techniques(model, hpz=False) once 25% of the steps" in refused["accelerator"]
    for result in results:
        assert result["scheduled"] == {"quantized_weights": True, "hpz": False, "quantized_gradients": True}, result
