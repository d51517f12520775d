"""A representative slice of Transformers' model families (``scripts/model_families/slice.py``: every head, dense and
mixture-of-experts decoders, sliding-window, linear-attention and state-space layers, tied and shared weights,
encoder-decoders, convolutional and windowed vision models, contrastive towers) each trains one AdamW step under
zero3 on 2 gloo ranks as it does on one process: the loss before and after the step and every gradient, to 1e-5
(``python -m scripts.model_families`` sweeps every family of the auto mappings the same way). One spawn of the ranks
runs the whole slice."""

from __future__ import annotations

import pytest

from scripts.model_families.run import sweep
from scripts.model_families.slice import CI_SLICE


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    found = sweep(CI_SLICE, "zero3", tmp_path_factory.mktemp("families"), log=lambda line: None)
    return {(record["head"], record["family"]): record for record in found}


@pytest.mark.parametrize("entry", CI_SLICE, ids="/".join)
def test_family_trains_one_step_as_stock_under_zero3(records, entry):
    record = records[entry]
    assert record["class"] == "pass", record
    assert record["params"] > 0 and record["errors"]["grad"] <= 1e-5


def test_a_miss_of_the_gradient_bounds_traced_to_quantization_is_explained_and_nothing_else():
    """ResNet's and Switch Transformers' ZeRO++ gradients miss the bounds by INT8 weights alone (their evidence in
    docs/results/2026-12-07-model-families.md): classed explained with the reason; a loss out of bounds, a missing
    gradient or an unlisted family still fails."""
    from scripts.model_families.explained import explain
    from scripts.model_families.run import TOLERANCE

    errors = {"loss": 0.04, "grad": 1.0, "worst_grad": 1.03, "loss_after": 0.005}
    record = {"head": "image-cls", "family": "resnet", "class": "fail", "errors": errors,
              "reason": "grad 1.0e+00 > 0.25; worst_grad 1.0e+00 > 1"}
    explained = explain(record, TOLERANCE["zeropp"])
    assert explained["class"] == "explained" and "BatchNorm" in explained["reason"]
    assert explain({**record, "errors": {**errors, "loss": 0.2}}, TOLERANCE["zeropp"])["class"] == "fail"
    assert explain({**record, "reason": "gradients missing ['x'] / extra []"}, TOLERANCE["zeropp"])["class"] == "fail"
    assert explain({**record, "family": "vit"}, TOLERANCE["zeropp"])["class"] == "fail"
