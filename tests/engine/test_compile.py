"""torch.compile on a sharded model, every way a script asks for it, under ZeRO++ (2 emulated nodes x 2 ranks):
each FSDP unit compiled (``hf_zeropp.compile_units``, what Accelerate's dynamo settings and the Trainer's
``--torch_compile`` do; the Accelerate and Trainer paths against stock compiled DDP are in tests/conformance/test_conformance.py),
also with activation checkpointing, then generating, ten blocks with ``fullgraph=True`` (each keeps its graph: more
than torch's default recompile limit), and the whole model compiled by the script itself before
``shard_model`` and after it. The backends keep eager's arithmetic (``aot_eager`` traces forward and backward
graphs, ``eager`` only the forward), so every way must train exactly as eager does: qwZ / qgZ quantize in FSDP's
hooks, outside the graphs, the same bits either way."""

from __future__ import annotations

import pytest
import torch

import hf_zeropp.kernels as K
from hf_zeropp.testing.spawn import run_distributed

pytestmark = pytest.mark.skipif(K.active_backend("cpu") != "cpp", reason="the cpp kernels did not build here")


def _train_four_ways(directory: str) -> dict:
    from pathlib import Path

    from safetensors import safe_open
    from torch._dynamo.utils import counters

    import hf_zeropp
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    results = {}
    for way in ("eager", "units", "units_checkpointed", "whole_before", "whole_after"):
        if way != "whole_after":  # compiled as whole_before's model: its graphs serve (fewer compiles)
            torch._dynamo.reset()
        counters.clear()
        config = hf_zeropp.ZeroPPConfig.preset("zeropp", node_size=2,
                                               activation_checkpointing=way == "units_checkpointed")
        model = tiny_gpt2(seed=0, n_embd=64)
        if way == "whole_before":
            model = torch.compile(model, backend="eager")
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
    return results


def test_every_way_of_compiling_trains_as_eager_under_zeropp(tmp_path):
    results = run_distributed(_train_four_ways, 4, str(tmp_path), node_size=2)[0]
    eager = results["eager"]
    assert len(set(eager["loss"])) == 4 and eager["graphs"] == (0, 0)  # four steps trained, nothing compiled
    for way in ("units", "units_checkpointed", "whole_before", "whole_after"):
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
