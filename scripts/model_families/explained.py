"""ZeRO++ results outside the bounds whose cause was traced to quantization itself, not to hf_zeropp's wiring.

A family is listed here only with the evidence (``docs/results/2026-12-07-model-families.md``, and
``python -m scripts.model_families.quantized_weights`` to reproduce it): under qwZ alone its gradient equals, to
fp32 rounding, stock's gradient at the weights qwZ gathered, so every difference from stock is the INT8 rounding of
the weights. The sweep then classes it *explained*, with the reason, instead of *fail*; the bounds are not loosened.

Only a miss of the gradient bounds is explained: a loss outside its bound, a missing or extra gradient or an error
still fails.
"""

from __future__ import annotations

# (head, family) -> why INT8 weights move the gradient past the bounds
QUANTIZATION_SENSITIVE = {
    ("image-cls", "resnet"): (
        "INT8 weights (qwZ): BatchNorm over 2 images per rank makes the gradient hypersensitive to the weights "
        "(stock's gradient norm 4.7e3); qwZ's gradient equals stock's at qwZ's weights to 5e-8"),
    ("seq2seq", "switch_transformers"): (
        "INT8 weights (qwZ) send 2 of 48 decoder tokens (near-ties of the router) to another expert than stock; "
        "with stock's routing forced the gradient error falls to 0.13; qwZ's gradient equals stock's at qwZ's "
        "weights to 1e-7"),
}
GRADIENT_BOUNDS = ("grad", "worst_grad")


def explain(record: dict, tolerance: dict) -> dict:
    """``record`` classed *explained* with its reason where it failed only the gradient bounds and its family is
    listed; otherwise ``record`` unchanged."""
    reason = QUANTIZATION_SENSITIVE.get((record["head"], record["family"]))
    errors = record.get("errors")
    if record.get("class") != "fail" or reason is None or not errors or "missing" in record.get("reason", ""):
        return record
    if any(value > tolerance[key] for key, value in errors.items() if key not in GRADIENT_BOUNDS):
        return record
    return {**record, "class": "explained", "reason": f"{reason} (measured: {record['reason']})"}
