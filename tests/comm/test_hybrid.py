"""Hybrid sharding (presets ``hybrid`` and ``hybrid-q``): sharded inside the node, replicated across nodes.

Unquantized it is FSDP2's HSDP, and equals stock FSDP2 HSDP (``fully_shard`` on a ``(replicate, shard)`` mesh) to
1e-6. Quantized (INT4 block-quantized cross-node all-reduce), every replica must hold the same parameters bit for
bit, every gradient must be the mean over all ranks up to the quantization's error (averaged once, not
``node_size`` times it), no weight may cross nodes, and the cross-node bytes must be what INT4 blocks cost."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from hf_zeropp import ZeroPPConfig
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.comm.topology import Topology

STEPS = 4


def _batch() -> int:
    """Global batch: 4 sequences per rank (2 per micro-batch of two), so the mean over ranks is the global mean."""
    return 4 * dist.get_world_size()


def _stock_hsdp(node_size: int, micro_batches: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_zeropp.testing.tiny_models import full_parameters, make_optimizer, tiny_gpt2, train

    model = tiny_gpt2(seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size() // node_size, node_size),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, make_optimizer(model), range(STEPS), micro_batches=micro_batches, size=_batch())
    return losses, full_parameters(model)


def _first_gradients(model) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients of step 0 (full tensors), after one forward and backward, and the meter's relative error of
    each quantization in it (what the Trainer logs as ``quantization_error``)."""
    from hf_zeropp import comm_stats
    from hf_zeropp.engine.state import zeropp_state
    from hf_zeropp.testing.tiny_models import local_batch

    ids = local_batch(0, size=_batch())
    zeropp_state(model).meter.track_errors = True
    model(input_ids=ids, labels=ids).loss.backward()
    zeropp_state(model).meter.track_errors = False
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads, comm_stats(model).get("quantization_error", {})


def _hybrid(preset: str, node_size: int, micro_batches: int, checkpoint_dir: str | None = None):
    from hf_zeropp import comm_stats, load_checkpoint, save_checkpoint, shard_model
    from hf_zeropp.testing.tiny_models import full_parameters, make_optimizer, tiny_gpt2, train

    model = shard_model(tiny_gpt2(seed=0), ZeroPPConfig.preset(preset, node_size=node_size))
    optimizer = make_optimizer(model)
    grads, errors = _first_gradients(model)
    comm_stats(model, reset=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(model, optimizer, range(STEPS), micro_batches=micro_batches, size=_batch())
    result = {"losses": losses, "params": full_parameters(model), "grads": grads, "errors": errors,
              "deprecations": sorted({str(w.message) for w in caught
                                      if issubclass(w.category, (FutureWarning, DeprecationWarning))}),
              "local": {name: p.to_local().clone() for name, p in model.named_parameters()},
              "stats": {k: v for k, v in comm_stats(model).items() if k != "quantization_error"}}
    if checkpoint_dir is not None:  # resume: the next step equals the uninterrupted run's
        save_checkpoint(checkpoint_dir, model, optimizer, step=STEPS)
        following = train(model, optimizer, range(STEPS, STEPS + 1), size=_batch())
        resumed = shard_model(tiny_gpt2(seed=1), ZeroPPConfig.preset(preset, node_size=node_size))
        resumed_optimizer = make_optimizer(resumed)
        load_checkpoint(checkpoint_dir, resumed, resumed_optimizer)
        result["resume"] = (following, train(resumed, resumed_optimizer, range(STEPS, STEPS + 1), size=_batch()))
    return result


def _launch(node_size: int, checkpoint_dir: str):
    from hf_zeropp.testing.tiny_models import tiny_gpt2

    model = tiny_gpt2(seed=0)
    exact_grads = None
    if dist.get_rank() == 0:  # the mean gradient of step 0 over the global batch, on one process
        from hf_zeropp.testing.tiny_models import global_batch

        ids = global_batch(0, _batch())
        model(input_ids=ids, labels=ids).loss.backward()
        exact_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    stock_losses, stock_params = _stock_hsdp(node_size, micro_batches=1)
    return {"exact_grads": exact_grads, "stock": (stock_losses, stock_params),
            "stock_micro": _stock_hsdp(node_size, micro_batches=2)[0],
            "hybrid": _hybrid("hybrid", node_size, 1),
            "hybrid-q": _hybrid("hybrid-q", node_size, 1, checkpoint_dir),
            "hybrid-q-micro": _hybrid("hybrid-q", node_size, 2)}


TOPOLOGIES = {"2x2": (4, 2), "3x2": (6, 2), "4x2": (8, 2), "2x4": (8, 4)}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def runs(request, tmp_path_factory):
    world, node_size = TOPOLOGIES[request.param]
    checkpoint = str(tmp_path_factory.mktemp(f"hybrid_{request.param}") / "ckpt")
    return world, node_size, run_distributed(_launch, world, node_size, checkpoint, node_size=node_size,
                                             timeout=600)


def test_hybrid_equals_stock_fsdp2_hsdp(runs):
    _, _, results = runs
    stock_losses, stock_params = results[0]["stock"]
    hybrid = results[0]["hybrid"]
    assert hybrid["losses"] == pytest.approx(stock_losses, rel=1e-6, abs=1e-6)
    for name, value in stock_params.items():
        assert torch.allclose(hybrid["params"][name], value, rtol=1e-6, atol=1e-6), name
    stats = hybrid["stats"]
    assert stats["fwd_allgather"]["inter_node"] == stats["bwd_allgather"]["inter_node"] == 0
    assert stats["grad_reduce_scatter"]["inter_node"] == 0
    assert stats["hybrid_allreduce"]["inter_node"] > 0, "the cross-node all-reduce must be metered"


def test_hybrid_q_replicas_hold_identical_parameters(runs):
    world, node_size, results = runs
    for variant in ("hybrid-q", "hybrid-q-micro"):
        for rank in range(node_size, world):
            replica = results[rank % node_size][variant]["local"]
            mine = results[rank][variant]["local"]
            assert all(torch.equal(mine[name], replica[name]) for name in mine), (variant, rank)


def test_hybrid_q_gradient_is_the_mean_over_all_ranks_within_int4_error(runs):
    _, _, results = runs
    exact = results[0]["exact_grads"]
    got = results[0]["hybrid-q"]["grads"]
    total_error = sum(float((got[n] - exact[n]).pow(2).sum()) for n in exact) ** 0.5
    total_norm = sum(float(exact[n].pow(2).sum()) for n in exact) ** 0.5
    # INT4 blocks of 256 lose ~10-20 % of a gradient's norm per quantization; node_size times the mean (the bug
    # of averaging over the node only) would be off by 100 % or more
    assert total_error / total_norm < 0.35, total_error / total_norm
    # the 1-D parameters (biases, norm gains) cross nodes in fp32: exact up to fp32 rounding, not INT4 blocks
    for name in (n for n in exact if exact[n].dim() == 1):
        assert torch.allclose(got[name], exact[name], rtol=1e-4, atol=1e-6), name
    unquantized = results[0]["hybrid"]["grads"]
    for name in exact:
        assert torch.allclose(unquantized[name], exact[name], rtol=1e-4, atol=1e-6), name
    assert results[0]["hybrid"]["errors"] == {}


def test_hybrid_q_reports_the_error_of_each_hop_and_together_they_explain_the_gradients_error(runs):
    """The meter's round-trip errors of the two quantizations (INT4 blocks: a few to 20 % each) and the error of the
    gradient the step got against the exact mean, measured independently on one process: the two hops' errors
    compounded, so of their size (above half the smaller, below 1.5 times their sum)."""
    world, _, results = runs
    exact = results[0]["exact_grads"]
    got = results[0]["hybrid-q"]["grads"]
    actual = (sum(float((got[n] - exact[n]).pow(2).sum()) for n in exact)
              / sum(float(exact[n].pow(2).sum()) for n in exact)) ** 0.5
    hops = [max(results[rank]["hybrid-q"]["errors"][kind] for rank in range(world))
            for kind in ("hybrid_reduce_scatter", "hybrid_all_gather")]
    print(f"world {world}: hybrid-q gradient error {actual:.3f}; reduce-scatter hop {hops[0]:.3f}, all-gather hop "
          f"{hops[1]:.3f}")
    assert all(0.01 < error < 0.35 for error in hops), hops
    assert 0.5 * min(hops) < actual < 1.5 * sum(hops), (actual, hops)


def test_hybrid_q_trains_as_stock_hsdp_within_quantization_error(runs):
    _, _, results = runs
    stock_losses = results[0]["stock"][0]
    for variant, reference in (("hybrid-q", stock_losses), ("hybrid-q-micro", results[0]["stock_micro"])):
        losses = results[0][variant]["losses"]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses == pytest.approx(reference, rel=2e-2), variant


def test_hybrid_q_sends_no_weights_across_nodes_and_int4_gradients(runs):
    world, node_size, results = runs
    nodes = world // node_size
    quantized, full = results[0]["hybrid-q"]["stats"], results[0]["hybrid"]["stats"]
    assert quantized["fwd_allgather"]["inter_node"] == quantized["bwd_allgather"]["inter_node"] == 0
    cross = quantized["hybrid_reduce_scatter"]["inter_node"] + quantized["hybrid_all_gather"]["inter_node"]
    vectors = quantized["hybrid_1d_full_precision"]["inter_node"]
    flags = quantized["unused_parameter_flags"]["inter_node"]  # one int32 per parameter: which had a gradient
    assert cross + vectors + flags == quantized["total"]["inter_node"]
    # fp32 gradients -> 4-bit codes + one fp32 scale per 256: 1/8 + 1/256 of the bytes, plus each unit's padding to
    # nodes x 256 elements; the 1-D parameters, a few percent of this tiny model, in fp32
    ratio = cross / full["hybrid_allreduce"]["inter_node"]
    assert 0.129 <= ratio < 0.129 + 0.02 * nodes, ratio
    assert 0 < vectors < 0.05 * full["hybrid_allreduce"]["inter_node"], vectors
    description = quantized["implementations"]["hybrid_reduce_scatter"]
    assert description == [f"hybrid cross-node all-reduce: int4 block 256 reduce-scatter + all-gather among {nodes} "
                           f"nodes, asynchronous, 1-D parameters in full precision"]
    assert "hybrid_synchronous" not in quantized["implementations"], "no unit may fall back to the synchronous path"


def test_hybrid_q_resumes_from_a_checkpoint_exactly(runs):
    _, _, results = runs
    following, resumed = results[0]["hybrid-q"]["resume"]
    assert resumed == following


def test_hybrid_training_calls_no_deprecated_api(runs):
    """A user's log shows no deprecation warning from our collectives (torch renames them across versions)."""
    _, _, results = runs
    for rank, result in enumerate(results):
        for preset in ("hybrid", "hybrid-q", "hybrid-q-micro"):
            assert result[preset]["deprecations"] == [], (rank, preset)


def test_bad_hybrid_configurations_are_refused_before_any_collective():
    for options, named in (({"quantized_weights": True}, "quantized_weights"),
                           ({"hpz_partition_size": "node"}, "hpz_partition_size"),
                           ({"quantized_gradients": True}, "quantized_gradients"), ({"stage": 0}, "stage=0")):
        with pytest.raises(ValueError, match=f"shard_group='node' \\(hybrid sharding\\) with {named}: no weights "
                                             f"cross nodes.*quantize it with hybrid_gradient_bits"):
            ZeroPPConfig.preset("hybrid", **options)
    with pytest.raises(ValueError, match="shard_group='world'; set shard_group: node"):
        ZeroPPConfig(hybrid_gradient_bits=4)
    with pytest.raises(ValueError, match="hybrid sharding\\) with gradient_bit_allocation: it acts on qgZ's two-hop "
                                         "all-to-all"):
        ZeroPPConfig.preset("hybrid-q", gradient_bit_allocation=True)
    with pytest.raises(ValueError, match="gradient_error_feedback but no hybrid_gradient_bits: .* runs in full "
                                         "precision here; set hybrid_gradient_bits: 4"):
        ZeroPPConfig.preset("hybrid", gradient_error_feedback=True)
    assert ZeroPPConfig.preset("hybrid-q", gradient_error_feedback=True).gradient_error_feedback
    for options, named in (({"quantized_weights": True}, "quantized_weights"), ({"stage": 2}, "stage=2"),
                           ({"hybrid_gradient_bits": 4}, "hybrid_gradient_bits")):
        with pytest.raises(ValueError, match=f"chooses stage 3 and the techniques itself, but {named} is set"):
            ZeroPPConfig.preset("auto", **options)
    for option, value in (("gradient_error_feedback", True), ("stochastic_rounding", True), ("weight_bits", 4),
                          ("quantized_gradients_until", 0.5)):  # the chosen preset's would replace it: never silently
        with pytest.raises(ValueError, match=f"sets the techniques' options with the configuration it chooses, but "
                                             f"{option} is set"):
            ZeroPPConfig.preset("auto", **{option: value})
    assert ZeroPPConfig.preset("auto", block_size=128, node_size=2, mixed_precision="bf16").shard_group == "auto"


def test_hybrid_refuses_a_model_whose_states_do_not_fit_a_node(monkeypatch):
    from hf_zeropp.comm import hybrid
    from hf_zeropp.testing.tiny_models import tiny_gpt2

    config = ZeroPPConfig.preset("hybrid", node_size=2)
    topology = Topology.from_config(config, 4)
    model = tiny_gpt2()
    monkeypatch.setattr(hybrid, "_free_bytes_per_rank", lambda device, ranks: 1000.0)
    with pytest.raises(ValueError, match=r"need about .* GiB of states per rank .* node of 2 ranks.*preset zero3"):
        hybrid.check_hybrid_fits(model, config, topology, torch.device("cpu"))
    monkeypatch.setattr(hybrid, "_free_bytes_per_rank", lambda device, ranks: 1e12)
    hybrid.check_hybrid_fits(model, config, topology, torch.device("cpu"))



def _with_an_unused_parameter(preset: str):
    """One backward of a GPT-2 whose block 1 holds a parameter no rank uses: it reduces as zeros with the rest of its
    unit (hf_zeropp.engine.unused_parameters), so the unit keeps its expected layout, and ends with no gradient, as
    under stock."""
    from hf_zeropp import comm_stats, shard_model
    from hf_zeropp.testing.tiny_models import local_batch, tiny_gpt2

    model = tiny_gpt2(seed=0)
    model.transformer.h[1].register_parameter("unused", torch.nn.Parameter(torch.zeros(5)))
    shard_model(model, ZeroPPConfig.preset(preset, node_size=2))
    ids = local_batch(0, size=_batch())
    model(input_ids=ids, labels=ids).loss.backward()
    return {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None},
            "local": {n: p.grad.to_local() for n, p in model.named_parameters() if p.grad is not None},
            "implementations": comm_stats(model)["implementations"]}


def _unused_parameter_launch():
    return {preset: _with_an_unused_parameter(preset) for preset in ("hybrid", "hybrid-q")}


def test_hybrid_q_unit_with_an_unused_parameter_is_averaged_once_and_the_parameter_keeps_no_gradient():
    results = run_distributed(_unused_parameter_launch, 4, node_size=2)
    exact, quantized = results[0]["hybrid"]["grads"], results[0]["hybrid-q"]["grads"]
    assert "transformer.h.1.unused" not in exact and "transformer.h.1.unused" not in quantized
    assert exact.keys() == quantized.keys()
    implementations = results[0]["hybrid-q"]["implementations"]
    assert "hybrid_synchronous" not in implementations and "hybrid_1d_fallback" not in implementations
    error = sum(float((quantized[n] - exact[n]).pow(2).sum()) for n in exact) ** 0.5
    assert error / sum(float(g.pow(2).sum()) for g in exact.values()) ** 0.5 < 0.35
    block = [n for n in exact if n.startswith("transformer.h.1.")]
    error = sum(float((quantized[n] - exact[n]).pow(2).sum()) for n in block) ** 0.5
    assert error / sum(float(exact[n].pow(2).sum()) for n in block) ** 0.5 < 0.35, "the synchronous unit's mean"
    for rank in (2, 3):  # gradients of replicas are equal, bit for bit
        mine, replica = results[rank]["hybrid-q"]["local"], results[rank - 2]["hybrid-q"]["local"]
        assert all(torch.equal(mine[n], replica[n]) for n in mine)


ACCURACY_VARIANTS = {"int4": {}, "int8": {"hybrid_gradient_bits": 8},
                     "hadamard + stochastic rounding": {"gradient_hadamard": 64, "stochastic_rounding": True}}


def _one_backward(options: dict):
    """One backward of the tiny GPT-2 under hybrid (options None) or hybrid-q with ``options``, 2 x 2."""
    from hf_zeropp import comm_stats, shard_model
    from hf_zeropp.testing.tiny_models import local_batch, tiny_gpt2

    config = (ZeroPPConfig.preset("hybrid", node_size=2) if options is None
              else ZeroPPConfig.preset("hybrid-q", node_size=2, **options))
    model = shard_model(tiny_gpt2(seed=0), config)
    ids = local_batch(0, size=_batch())
    model(input_ids=ids, labels=ids).loss.backward()
    return {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "local": {n: p.grad.to_local() for n, p in model.named_parameters()},
            "implementations": comm_stats(model)["implementations"]}


def _accuracy_launch():
    return {"exact": _one_backward(None),
            **{name: _one_backward(options) for name, options in ACCURACY_VARIANTS.items()}}


def test_hybrid_q_takes_the_gradient_accuracy_options_and_keeps_replicas_equal():
    """8-bit codes, and a Hadamard rotation with stochastic rounding, on hybrid-q's cross-node all-reduce: each runs
    as described, replicas get the same gradients bit for bit, and the error against the exact mean is INT8's
    (a few tenths of a percent) or stays within INT4's."""
    results = run_distributed(_accuracy_launch, 4, node_size=2)
    exact = results[0]["exact"]["grads"]
    norm = sum(float(g.pow(2).sum()) for g in exact.values()) ** 0.5
    errors = {}
    for name in ACCURACY_VARIANTS:
        got = results[0][name]["grads"]
        errors[name] = sum(float((got[n] - exact[n]).pow(2).sum()) for n in exact) ** 0.5 / norm
        for rank in (2, 3):
            mine, replica = results[rank][name]["local"], results[rank - 2][name]["local"]
            assert all(torch.equal(mine[n], replica[n]) for n in mine), (name, rank)
    print("hybrid-q gradient error against the exact mean: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    assert errors["int8"] < 0.02 and errors["int8"] < errors["int4"] / 5, errors
    assert errors["hadamard + stochastic rounding"] < 0.35, errors
    described = {name: results[0][name]["implementations"]["hybrid_reduce_scatter"][0] for name in ACCURACY_VARIANTS}
    assert described["int8"].startswith("hybrid cross-node all-reduce: int8 block 256")
    assert ", Hadamard 64, stochastic rounding, 1-D parameters in full precision" in described[
        "hadamard + stochastic rounding"]


FEEDBACK_VARIANTS = {"off": {}, "plain": {"gradient_error_feedback": True},
                     "loco": {"gradient_error_feedback": True, "gradient_error_feedback_decay": 0.5},
                     "reset every reduction": {"gradient_error_feedback": True, "gradient_error_feedback_reset": 1}}
FEEDBACK_LENGTH, FEEDBACK_BLOCK = 1001, 64  # a node partial sum that no block size divides


def _feedback_worker(steps: int):
    """The same node partial sum all-reduced ``steps`` times under each error-feedback variant."""
    from hf_zeropp.comm.comm_meter import CommMeter
    from hf_zeropp.comm.hybrid import QuantizedCrossNodeAllReduce
    from hf_zeropp.comm.topology import get_topology

    topology = get_topology(ZeroPPConfig(node_size=2), "cpu")
    torch.manual_seed(7 + dist.get_rank())
    partial = torch.distributions.StudentT(3.0).sample((FEEDBACK_LENGTH,))  # heavy-tailed, as gradients are
    exact = partial.clone()
    dist.all_reduce(exact, group=topology.inter_node_group)
    results = {}
    for name, options in FEEDBACK_VARIANTS.items():
        config = ZeroPPConfig.preset("hybrid-q", node_size=2, block_size=FEEDBACK_BLOCK, **options)
        all_reduce = QuantizedCrossNodeAllReduce(config, topology, CommMeter(topology))
        total = torch.zeros(FEEDBACK_LENGTH)
        for _ in range(steps):
            got = all_reduce.reduce(partial.clone())
            total += got
        residuals = all_reduce.residuals_state_dict()
        results[name] = {"step": float((got - exact).norm()), "mean": float((total / steps - exact).norm()),
                         "exact": float(exact.norm()), "last": got,
                         "residual_codes": {hop: codes.shape for state in residuals.values()
                                            for hop, (codes, _) in state["residuals"].items()},
                         "reductions": [state["reductions"] for state in residuals.values()],
                         "described": all_reduce.describe()}
    return results


def test_hybrid_q_error_feedback_cancels_both_hops_rounding_over_steps():
    """The same gradient every step, rounded to nearest: without feedback every step repeats the same error, so the
    mean over steps is as wrong as one step; with feedback on both hops the errors cancel over steps; LoCo's
    averaged residual cancels them too, more slowly; a residual reset before every reduction is no feedback at all.
    Replicas get the same sum bit for bit in every variant. The residuals are hop 1's rows (one per node, the kept
    one carrying none) and hop 2's chunk, at 8 bits."""
    steps = 8
    results = run_distributed(_feedback_worker, 4, steps, node_size=2)
    print(f"rank 0, relative error of one step / of the mean over {steps} steps: " + ", ".join(
        f"{name} {row['step'] / row['exact']:.4f} / {row['mean'] / row['exact']:.4f}"
        for name, row in results[0].items()))
    for rank, errors in enumerate(results):
        off = errors["off"]
        assert off["step"] > 0.05 * off["exact"], "INT4 blocks of 64 must lose something"
        assert off["mean"] == pytest.approx(off["step"], rel=1e-6)
        assert errors["plain"]["mean"] < 0.15 * off["mean"], (rank, errors["plain"], off)
        assert errors["loco"]["mean"] < 0.5 * off["mean"], (rank, errors["loco"], off)
        assert torch.equal(errors["reset every reduction"]["last"], off["last"])
        chunk = -(-FEEDBACK_LENGTH // (2 * FEEDBACK_BLOCK)) * FEEDBACK_BLOCK
        assert errors["plain"]["residual_codes"] == {0: (2, chunk), 1: (1, chunk)}
        assert errors["loco"]["reductions"] == [steps]
        assert errors["plain"]["described"].endswith(", error feedback (8-bit residual) on both hops")
        for name in FEEDBACK_VARIANTS:
            assert torch.equal(errors[name]["last"], results[rank ^ 2][name]["last"]), (name, rank)


def _resume(checkpoint_dir: str, options: dict):
    """hybrid-q: the step after a resume equals the step without the stop (stochastic rounding draws the same
    rounding; error feedback adds the same residuals)."""
    from hf_zeropp import load_checkpoint, save_checkpoint, shard_model
    from hf_zeropp.engine.state import zeropp_state
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    config = ZeroPPConfig.preset("hybrid-q", node_size=2, **options)
    model = shard_model(tiny_gpt2(seed=0), config)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(2), size=_batch())
    save_checkpoint(checkpoint_dir, model, optimizer, step=2)
    train(model, optimizer, range(2, 3), size=_batch())
    resumed = shard_model(tiny_gpt2(seed=1), config)
    resumed_optimizer = make_optimizer(resumed)
    load_checkpoint(checkpoint_dir, resumed, resumed_optimizer)
    train(resumed, resumed_optimizer, range(2, 3), size=_batch())
    all_reduce = zeropp_state(model).cross_node_all_reduce
    return {"pairs": [(p.to_local().clone(), q.to_local().clone())
                      for p, q in zip(model.parameters(), resumed.parameters())],
            "residual_units": len(all_reduce.residuals_state_dict()),
            "described": zeropp_state(model).meter.stats()["implementations"]["hybrid_reduce_scatter"]}


@pytest.mark.parametrize("options", [{"stochastic_rounding": True}, {"gradient_error_feedback": True}],
                         ids=["stochastic rounding", "error feedback"])
def test_hybrid_q_resumes_with_the_same_rounding_and_residuals(tmp_path, options):
    results = run_distributed(_resume, 4, str(tmp_path / "ckpt"), options, node_size=2)
    for rank, result in enumerate(results):
        assert all(torch.equal(uninterrupted, resumed) for uninterrupted, resumed in result["pairs"]), f"rank {rank}"
        replica = results[rank ^ 2]["pairs"]
        assert all(torch.equal(mine[0], theirs[0]) for mine, theirs in zip(result["pairs"], replica)), rank
    if "gradient_error_feedback" in options:
        assert results[0]["residual_units"] == 3  # the tiny GPT-2's two blocks and its root
        assert results[0]["described"][0].endswith("error feedback (8-bit residual) on both hops")


def _resume_on_other_node_size(checkpoint_dir: str, preset: str):
    """Error feedback saved on 2 nodes x 4 ranks, resumed on 4 x 2 (same world size): the residuals belong to other
    elements there. Against the same checkpoint without its per-rank files (residuals from zero), and a resume on
    the saving layout (restored)."""
    import shutil

    from hf_zeropp import comm_stats, load_checkpoint, save_checkpoint, shard_model
    from hf_zeropp.engine.state import zeropp_state
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    def sharded(node_size: int):
        model = shard_model(tiny_gpt2(seed=1), ZeroPPConfig.preset(preset, node_size=node_size,
                                                                   gradient_error_feedback=True))
        return model, make_optimizer(model)

    def residual_count(model) -> int:
        state = zeropp_state(model)
        if state.cross_node_all_reduce is not None:
            return len(state.cross_node_all_reduce.residuals_state_dict())
        return sum(bool(rs.state_dict()["error_feedback"]["residuals"]) for rs in state.reduce_scatters)

    model, optimizer = sharded(4)
    train(model, optimizer, range(2), size=_batch())
    save_checkpoint(checkpoint_dir, model, optimizer, step=2)
    without_rank_files = checkpoint_dir + "_without_rank_files"
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint_dir, without_rank_files)
        shutil.rmtree(f"{without_rank_files}/rng")
    dist.barrier()
    result = {}
    for name, directory, node_size in (("same layout", checkpoint_dir, 4), ("other node size", checkpoint_dir, 2),
                                       ("no residuals", without_rank_files, 2)):
        resumed, resumed_optimizer = sharded(node_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_checkpoint(directory, resumed, resumed_optimizer)
        restored = residual_count(resumed)
        train(resumed, resumed_optimizer, range(2, 3), size=_batch())
        result[name] = {"restored": restored, "warnings": [str(w.message) for w in caught],
                        "condition": comm_stats(resumed)["implementations"].get("gradient_error_feedback_residuals"),
                        "params": [p.full_tensor() for p in resumed.parameters()]}
    return result


@pytest.mark.parametrize("preset", ["hybrid-q", "zeropp"])
def test_error_feedback_residuals_are_not_restored_on_another_node_size_and_that_is_said(tmp_path, preset):
    """A rank's residual is what its quantization dropped from its own slice of the gradient. Resumed on another
    node size (same world size) it would be added to other elements, with shapes that can match: it must start from
    zero, exactly as if the checkpoint had no per-rank files, with one warning naming the change."""
    results = run_distributed(_resume_on_other_node_size, 8, str(tmp_path / "ckpt"), preset, node_size=4,
                              timeout=600)
    for rank, result in enumerate(results):
        assert result["same layout"]["restored"] > 0 and result["same layout"]["warnings"] == [], rank
        assert result["same layout"]["condition"] is None
        assert result["other node size"]["restored"] == 0, rank
        assert all(torch.equal(mine, reference) for mine, reference in zip(
            result["other node size"]["params"], result["no residuals"]["params"])), rank
        condition, = result["other node size"]["condition"]
        assert condition.startswith("not restored: ") and "node size 4 -> 2" in condition, condition
    warned = results[0]["other node size"]["warnings"]
    assert len(warned) == 1 and "error-feedback residuals" in warned[0] and "node size 4 -> 2" in warned[0], warned
    assert all(result["other node size"]["warnings"] == [] for result in results[1:]), "rank 0 warns, once"
