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
        "INT8 weights: BatchNorm over 2 images per rank makes the gradient hypersensitive (stock's norm 4.7e3; 1/64 of "
        "qwZ's rounding moves it by 0.46); qwZ equals stock at qwZ's weights to 3e-5"),
    ("seq2seq", "switch_transformers"): (
        "INT8 weights send 2 of 48 decoder tokens (router near-ties) to another expert; stock's routing forced: "
        "gradient 0.13; qwZ equals stock at qwZ's weights to 4e-7"),
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
    return {**record, "class": "explained", "reason": reason}
