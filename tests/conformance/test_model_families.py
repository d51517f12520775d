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
