"""torch.compile on a sharded model, every way a script asks for it, under ZeRO++ (2 emulated nodes x 2 ranks):
each FSDP unit compiled (``hf_zeropp.compile_units``, what Accelerate's dynamo settings and the Trainer's
``--torch_compile`` do; the Accelerate and Trainer paths against stock compiled DDP are in tests/conformance/test_conformance.py),
also with activation checkpointing, then generating, ten blocks with ``fullgraph=True`` (each keeps its graph: more
than torch's default recompile limit), the whole model compiled by the script itself before ``shard_model``, after
it, and before ``accelerator.prepare``; and stage 0 (plain data parallel) compiled by Accelerate's dynamo settings
against stage 0 eager. The backends keep eager's arithmetic (``aot_eager`` traces forward and backward graphs,
``eager`` only the forward), so every way must train exactly as eager does: qwZ / qgZ quantize in FSDP's hooks,
outside the graphs, the same bits either way. Last, ``mode="reduce-overhead"`` on CPU, where there are no CUDA graphs
to take: said and recorded (not trained: inductor's compile takes a minute per rank here)."""

from __future__ import annotations

import pytest
import torch

import hf_zeropp.kernels as K
from hf_zeropp.testing.spawn import run_distributed

pytestmark = pytest.mark.skipif(K.active_backend("cpu") != "cpp", reason="the cpp kernels did not build here")


def _accelerator(preset: str, **kwargs):
    """A fresh ``hf_zeropp.Accelerator`` on CPU, as a separate script would have."""
    import os

    from accelerate.state import AcceleratorState, GradientState

    import hf_zeropp

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return hf_zeropp.Accelerator(zeropp=hf_zeropp.ZeroPPConfig.preset(preset, node_size=2), **kwargs)


def _train_every_way(directory: str) -> dict:
    import warnings
    from pathlib import Path

    from accelerate.utils import TorchDynamoPlugin
    from safetensors import safe_open
    from torch._dynamo.utils import counters

    import hf_zeropp
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    results = {}
    for way in ("eager", "units", "units_checkpointed", "whole_before", "whole_after", "whole_before_prepare",
                "stage0", "stage0_accelerate"):
        if way not in ("whole_after", "whole_before_prepare"):  # as whole_before's model: its graphs serve
            torch._dynamo.reset()
        counters.clear()
        preset = "ddp" if way.startswith("stage0") else "zeropp"
        config = hf_zeropp.ZeroPPConfig.preset(preset, node_size=2,
                                               activation_checkpointing=way == "units_checkpointed")
        model = tiny_gpt2(seed=0, n_embd=64)
        if way.startswith("whole_before"):
            model = torch.compile(model, backend="eager")
        if way == "whole_before_prepare":
            prepared = _accelerator(preset).prepare(model)
            assert prepared is model  # the script's compiled wrapper comes back
        elif way == "stage0_accelerate":
            plugin = TorchDynamoPlugin(backend="aot_eager")
            model = _accelerator(preset, dynamo_plugin=plugin).prepare(model)
        else:
            sharded = hf_zeropp.shard_model(model, config)
            assert sharded is model  # the script's object comes back, a compiled wrapper included
        if way.startswith("units"):
            hf_zeropp.compile_units(model, backend="aot_eager")
        if way == "whole_after":
            model = torch.compile(model, backend="eager")
        optimizer = make_optimizer(model)
        losses = train(model, optimizer, range(2))
        graphs_after_two_steps = counters["stats"]["unique_graphs"]
        losses += train(model, optimizer, range(2, 4))
        results[way] = {"loss": losses, "graph_breaks": sum(counters["graph_break"].values()),
                        "graphs": (graphs_after_two_steps, counters["stats"]["unique_graphs"]),
                        "compile": hf_zeropp.comm_stats(model)["implementations"].get("compile")}
        if way in ("eager", "units"):
            prompt = torch.arange(4).view(1, 4)
            results[way]["generated"] = model.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
        if way == "whole_before":  # saved under the model's own names, not the wrapper's
            saved = hf_zeropp.save_pretrained(model, Path(directory) / way)
            with safe_open(next(saved.glob("*.safetensors")), "pt") as tensors:
                results[way]["saved"] = sorted(tensors.keys())
    torch._dynamo.reset()  # ten blocks, one graph each: more than torch's default recompile limit of 8
    counters.clear()
    model = hf_zeropp.shard_model(tiny_gpt2(seed=0, n_layer=10), hf_zeropp.ZeroPPConfig.preset("zeropp", node_size=2))
    hf_zeropp.compile_units(model, backend="eager", fullgraph=True)
    train(model, make_optimizer(model), range(1))
    results["ten_blocks"] = {"graphs": counters["stats"]["unique_graphs"],
                             "graph_breaks": sum(counters["graph_break"].values())}
    model = hf_zeropp.shard_model(tiny_gpt2(seed=0), hf_zeropp.ZeroPPConfig.preset("zeropp", node_size=2))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hf_zeropp.compile_units(model, backend="inductor", mode="reduce-overhead")
    results["reduce_overhead"] = {"compile": hf_zeropp.comm_stats(model)["implementations"]["compile"],
                                  "said": [str(warning.message) for warning in said]}
    return results


def test_every_way_of_compiling_trains_as_eager(tmp_path):
    results = run_distributed(_train_every_way, 4, str(tmp_path), node_size=2, timeout=600)[0]
    eager = results["eager"]
    assert len(set(eager["loss"])) == 4 and eager["graphs"] == (0, 0)  # four steps trained, nothing compiled
    for way in ("units", "units_checkpointed", "whole_before", "whole_after", "whole_before_prepare"):
        assert results[way]["loss"] == pytest.approx(eager["loss"], abs=1e-6), (way, results[way]["loss"])
    units = results["units"]
    assert units["graph_breaks"] == 0 and units["graphs"] == (2, 2), units  # one graph per block, none after step 2
    assert "per FSDP unit" in units["compile"][0] and "backend='aot_eager'" in units["compile"][0]
    assert results["units_checkpointed"]["graph_breaks"] == 0  # recomputed in backward by the same compiled blocks
    assert units["generated"] == eager["generated"]  # generate() on the compiled model: the same tokens
    before = results["whole_before"]
    assert before["graphs"][0] >= 2 and before["graph_breaks"] > 0  # compiled, broken at the units' FSDP hooks
    assert "before shard_model" in before["compile"][0], before["compile"]
    assert before["saved"] and not any("_orig_mod" in name for name in before["saved"]), before["saved"]
    assert results["ten_blocks"] == {"graphs": 10, "graph_breaks": 0}  # fullgraph=True; no block left uncompiled
    after = results["whole_after"]  # whole_before's graphs serve the same model sharded first: nothing recompiles
    assert after["graphs"] == (0, 0) and after["graph_breaks"] == 0 and after["compile"] is None, after
    prepared = results["whole_before_prepare"]  # accelerator.prepare(torch.compile(model)): shards inside the wrapper
    assert prepared["graphs"] == (0, 0) and "before shard_model or prepare" in prepared["compile"][0], prepared
    stage0, compiled = results["stage0"], results["stage0_accelerate"]  # Accelerate's dynamo settings at stage 0
    assert compiled["loss"] == pytest.approx(stage0["loss"], abs=1e-6) and stage0["loss"] != eager["loss"]
    assert compiled["graph_breaks"] == 0 and compiled["graphs"] == (2, 2), compiled
    assert "per FSDP unit" in compiled["compile"][0] and "backend='aot_eager'" in compiled["compile"][0], compiled
    reduce_overhead = results["reduce_overhead"]  # on CPU: compiled by inductor without CUDA graphs, and said
    assert "mode='reduce-overhead' asks for CUDA graphs: none on cpu" in reduce_overhead["compile"][0], reduce_overhead
    assert any("compiles without them" in line for line in reduce_overhead["said"]), reduce_overhead["said"]
