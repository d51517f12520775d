"""scripts/fidelity.py end to end on 2 emulated nodes x 2 (the mini Table 5 model, four steps of its baseline).

What must hold whatever the gradients are: the 1-D parameters sent in full precision arrive exactly (error 0,
cosine 1), while quantized with the matrices they lose precision or cost the matrices theirs; the 8-bit intra-node
hop sends the same cross-node bytes yet cuts qgZ's error; error feedback's errors cancel over a window more than
plain rounding's; INT8 weights are an order of magnitude closer than INT4 gradients; the Adam-scaled measure exists
for every step that follows an optimizer step and is computed with Adam's own second moment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="module")
def fidelity_out(tmp_path_factory) -> Path:
    import fidelity

    out = tmp_path_factory.mktemp("fidelity")
    assert fidelity.main(["--topologies", "2x2", "--steps", "1,3", "--window", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def fidelity(fidelity_out: Path) -> dict:
    out = fidelity_out
    summary = json.loads((out / "results.json").read_text())["2x2"]
    assert summary["model"].startswith("GPT2LMHeadModel, ")
    assert "| Hadamard 64 |" in (out / "results.md").read_text()
    assert "gradients scaled as Adam scales them" in (out / "results.md").read_text()
    return summary


def _rows(summary: dict, kind: str) -> dict:
    return {row["name"]: row for row in summary[kind]}


def test_gradient_fidelity_separates_the_qgz_options(fidelity):
    assert fidelity["measured_steps"] == [1, 2, 3, 4]
    rows = _rows(fidelity, "gradients")
    plain = rows["ZeRO++ qgZ (int4/int4, block 256)"]
    # two INT4 hops with one scale per 256 values: tens of percent of relative error, still well aligned
    assert 0.05 < plain["all"]["relative_error"] < 0.6
    assert plain["all"]["cosine"] > 0.8
    for name, row in rows.items():
        if name != "1-D parameters quantized too":  # qgZ's default: 1-D slices reduce-scattered as they are
            assert row["1-D"]["relative_error"] == 0.0 and row["1-D"]["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert rows["1-D parameters quantized too"]["1-D"]["relative_error"] > 0.05
    intra8 = rows["8-bit intra-node hop"]
    assert intra8["all"]["relative_error"] < 0.9 * plain["all"]["relative_error"]
    # same cross-node bytes for every option but the one that quantizes the 1-D slices too (slightly fewer)
    assert intra8["inter_node_mb_per_step"] == pytest.approx(plain["inter_node_mb_per_step"], rel=1e-9)
    assert rows["1-D parameters quantized too"]["inter_node_mb_per_step"] < plain["inter_node_mb_per_step"]
    assert all(row["window_sum_error"] > 0 for row in rows.values())
    # error feedback carries what one step drops into the next: over a window its errors cancel more than plain's
    def carried(row: dict) -> float:
        return row["window_sum_error"] / row["all"]["relative_error"]
    for name in ("error feedback (inter-node hop)", "LoCo error feedback (decay 0.5)"):
        assert carried(rows[name]) < 0.85 * carried(plain), (name, carried(rows[name]), carried(plain))
    # per-block widths move the inter-node hop's bits to the larger blocks at the same bytes
    accurate = rows["Hadamard 64 + 8-bit intra"]
    for name, reference in (("bit allocation (inter-node hop)", plain),
                            ("Hadamard 64 + 8-bit intra + bit allocation", accurate)):
        row = rows[name]
        assert row["inter_node_mb_per_step"] == pytest.approx(plain["inter_node_mb_per_step"], rel=1e-9)
        assert row["all"]["relative_error"] < 0.8 * reference["all"]["relative_error"], (name, row["all"])


def test_adam_scaled_gradient_fidelity(fidelity):
    """Every measured step (1-4) follows an optimizer step, so each has the update-direction measure; full-precision
    1-D slices stay exact under any weighting, and weighting changes the error (it is not the L2 ratio again)."""
    rows = _rows(fidelity, "gradients")
    plain = rows["ZeRO++ qgZ (int4/int4, block 256)"]
    for name, row in rows.items():
        scaled = row["adam_scaled"]
        assert 0 < scaled["all"]["relative_error"] < 5 and -1 <= scaled["all"]["cosine"] <= 1, name
        assert row["adam_scaled_window_sum_error"] > 0, name
        if name != "1-D parameters quantized too":
            assert scaled["1-D"]["relative_error"] == 0.0, name
    assert plain["adam_scaled"]["all"]["relative_error"] != pytest.approx(plain["all"]["relative_error"], rel=1e-3)


def test_adam_scale_is_one_over_the_root_of_adams_second_moment():
    """After one AdamW step the bias-corrected second moment is g^2 exactly: the scale is 1 / (|g| + eps), laid out
    at the parameter's span, zero on the padding after it."""
    import torch

    import fidelity

    param = torch.nn.Parameter(torch.zeros(2, 3))
    optimizer = torch.optim.AdamW([param], lr=0.1, eps=1e-3)
    assert fidelity.adam_scale(optimizer, [(param, 2, 8)], 10) is None  # no state before the first step
    gradient = torch.tensor([[0.5, -2.0, 1e-4], [3.0, 0.0, -0.25]])
    param.grad = gradient.clone()
    optimizer.step()
    scale = fidelity.adam_scale(optimizer, [(param, 2, 8)], 10)
    expected = torch.zeros(10, dtype=torch.float64)
    expected[2:8] = 1 / (gradient.double().abs().flatten() + 1e-3)
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)


def test_weight_fidelity_of_qwz(fidelity):
    rows = _rows(fidelity, "weights")
    plain = rows["ZeRO++ qwZ (int8, block 256, 1-D in full precision)"]
    quantized_1d = rows["1-D parameters quantized too"]
    assert plain["1-D"]["relative_error"] == 0.0 and quantized_1d["1-D"]["relative_error"] > 0
    # INT8 with one scale per 256 values: about 1 % on matrices (the qwZ docstring's 0.007 at GPT-2 h = 768)
    assert 1e-3 < plain["matrices"]["relative_error"] < 0.02
    # a block shared with norm gains (~1) gets their scale: the matrix values in it lose precision
    assert quantized_1d["matrices"]["relative_error"] > 1.2 * plain["matrices"]["relative_error"]
    gradients = _rows(fidelity, "gradients")["ZeRO++ qgZ (int4/int4, block 256)"]
    assert plain["all"]["relative_error"] < gradients["all"]["relative_error"] / 10


def test_the_recipe_decides_the_model_family(tmp_path):
    """The second accuracy case's Llama recipe is measured on a Llama, not on a GPT-2 built from its keywords."""
    import fidelity

    recipe = Path(__file__).resolve().parent.parent / "recipes/llama_python_docs/zero3.yaml"
    assert fidelity.main(["--recipe", str(recipe), "--topologies", "2x2", "--steps", "0", "--window", "1",
                          "--global-batch", "16", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())["2x2"]
    assert summary["model"].startswith("LlamaForCausalLM, ")
    assert summary["measured_steps"] == [0]
    assert "adam_scaled" not in summary["gradients"][0]  # step 0 comes before Adam has any state
    assert "model: LlamaForCausalLM" in (tmp_path / "results.md").read_text()


def test_the_quantizer_floor_reads_the_fidelity_report(fidelity_out, fidelity):
    """scripts/quantizer_floor.py compares its floors with the numbers fidelity.py wrote, not with other rows."""
    import quantizer_floor

    rows = _rows(fidelity, "gradients")
    [(heading, plain, best)] = quantizer_floor.measured_errors(fidelity_out / "results.md")
    assert heading.startswith("2 nodes x 2 ranks: gradients")
    assert plain == pytest.approx(rows[quantizer_floor.PLAIN_ROW]["all"]["relative_error"], abs=5e-5)
    assert best == pytest.approx(rows[quantizer_floor.BEST_ROW]["all"]["relative_error"], abs=5e-5)
