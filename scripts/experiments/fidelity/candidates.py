"""The rows compared: each gradient and weight candidate as overrides of a preset, the width rules, and the
thresholds the tables use."""

from __future__ import annotations

from typing import Any


from hf_zeropp.config.config import ZeroPPConfig



CLASSES = ("matrices", "embeddings", "1-D", "all")

# name -> ZeroPPConfig overrides of the zeropp preset, or of the preset a "preset" key names (the hybrid rows: see
# HybridReduceScatter); the first row is the reference the others are compared to
GRADIENT_CANDIDATES: dict[str, dict[str, Any]] = {
    "ZeRO++ qgZ (int4/int4, block 256)": {},
    "1-D parameters quantized too": {"gradient_full_precision_1d": False},
    "Hadamard 32": {"gradient_hadamard": 32},
    "Hadamard 64": {"gradient_hadamard": 64},
    "Hadamard 128": {"gradient_hadamard": 128},
    "stochastic rounding": {"stochastic_rounding": True},
    "8-bit intra-node hop": {"gradient_intra_bits": 8},
    "error feedback (inter-node hop)": {"gradient_error_feedback": True},
    "LoCo error feedback (decay 0.5)": {"gradient_error_feedback": True, "gradient_error_feedback_decay": 0.5},
    "Hadamard 64 + 8-bit intra": {"gradient_hadamard": 64, "gradient_intra_bits": 8},
    "Hadamard 64 + 8-bit intra + error feedback": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                   "gradient_error_feedback": True},
    "Hadamard 64 + 8-bit intra + LoCo (decay 0.5)": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                     "gradient_error_feedback": True,
                                                     "gradient_error_feedback_decay": 0.5},
    "Hadamard 64 + SR + 8-bit intra": {"gradient_hadamard": 64, "stochastic_rounding": True,
                                       "gradient_intra_bits": 8},
    "bit allocation (inter-node hop)": {"gradient_bit_allocation": True},
    "Hadamard 64 + 8-bit intra + bit allocation": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                   "gradient_bit_allocation": True},
    "own rows in fp32": {"gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + own rows in fp32": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                     "gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + bit allocation, floor 2 + own rows in fp32": {
        "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_bit_allocation": True,
        "gradient_bit_allocation_floor": 2, "gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + bit allocation, floor 2": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                           "gradient_bit_allocation": True,
                                                           "gradient_bit_allocation_floor": 2},
    "Hadamard 64 + 8-bit intra + bit allocation + LoCo (decay 0.5)": {
        "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_bit_allocation": True,
        "gradient_error_feedback": True, "gradient_error_feedback_decay": 0.5},
    "hybrid (fp32 across nodes)": {"preset": "hybrid"},
    "hybrid-q (int4 across nodes, block 256)": {"preset": "hybrid-q"},
    "hybrid-q, Hadamard 64": {"preset": "hybrid-q", "gradient_hadamard": 64},
    "hybrid-q, int8 across nodes": {"preset": "hybrid-q", "hybrid_gradient_bits": 8},
    "hybrid-q, error feedback": {"preset": "hybrid-q", "gradient_error_feedback": True},
    "hybrid-q, Hadamard 64 + error feedback": {"preset": "hybrid-q", "gradient_hadamard": 64,
                                               "gradient_error_feedback": True},
}
# ways of choosing the inter-node hop's per-block widths, compared on one quantization of the exact shard
WIDTH_RULES = ("fixed 4 bits (ZeRO++)", "absmax: least L2 error (gradient_bit_allocation)",
               "absmax, no block below 4 bits unless all zero (bits move only from zero blocks)",
               "absmax, no block below 2 bits unless all zero (gradient_bit_allocation_floor: 2)",
               "absmax / RMS of its past absmax (moving average 0.99)",
               "oracle: absmax / the block's RMS of the owner's sqrt(v)")
RULE_HADAMARD, RULE_BITS, RULE_HISTORY_DECAY = 64, 4, 0.99
# an element is "surprising" Adam when its exact gradient exceeds this many times its root second moment before the step
SURPRISE = 3.0
# delivered/exact energy (Deliveries) thresholds: starved, half-starved, over-delivered (quantization noise)
DELIVERY_BINS = (0.1, 0.5, 2.0)
DELIVERY_COLUMNS = ("elements", "no exact gradient before", "delivered energy < 0.1 of the exact",
                    "< 0.5", ">= 2", "steps delivered as exactly 0",
                    "driving option's error on those < 0.5 (share of all its error)")
WEIGHT_CANDIDATES: dict[str, dict[str, Any]] = {
    "ZeRO++ qwZ (int8, block 256, 1-D in full precision)": {},
    "1-D parameters quantized too": {"weight_full_precision_1d": False},
}


def candidate_config(overrides: dict[str, Any]) -> ZeroPPConfig:
    return ZeroPPConfig.from_dict({"preset": "zeropp", **overrides})


