"""The named configurations a user can ask for by name (``zeropp: zeropp``, ``--zeropp hybrid-q``,
``ZeroPPConfig.preset``): each is a set of :class:`hf_zeropp.config.config.ZeroPPConfig` options."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "ddp": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True},
    # ZeRO++ with the qgZ options that gave the closest update directions (Adam-normalized gradients) at zeropp's
    # cross-node bytes among those that did not raise the loss (docs/accuracy.md, "Beyond ZeRO++"): a 64-element
    # Hadamard rotation of the gradient blocks, an 8-bit intra-node hop, and each rank's own rows added in fp32.
    # Same cross-node bytes as zeropp; qgZ's intra-node hop sends twice as many.
    "zeropp-accurate": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node",
                        "quantized_gradients": True, "gradient_hadamard": 64, "gradient_intra_bits": 8,
                        "gradient_full_precision_local": True},
    "zeropp-lora": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True,
                    "quantized_nontrainable_weights": True},
    # ZeRO++ with qwZ sending INT4 differences against a copy each node keeps between steps; that copy serves the
    # backward's gather inside the node, so hpZ is left off (docs/design.md, "Weight deltas")
    "zeropp-deltas": {"stage": 3, "quantized_weights": True, "weight_bits": 4, "weight_deltas": True,
                      "quantized_gradients": True},
    "zeropp-qwz": {"stage": 3, "quantized_weights": True},
    "zeropp-hpz": {"stage": 3, "hpz_partition_size": "node"},
    "zeropp-qgz": {"stage": 3, "quantized_gradients": True},
    # sharded inside the node, replicated across nodes: no weights cross nodes, one gradient all-reduce per step
    "hybrid": {"stage": 3, "shard_group": "node"},
    "hybrid-q": {"stage": 3, "shard_group": "node", "hybrid_gradient_bits": 4},
    # one of zero3, zeropp, hybrid, hybrid-q (their gradients INT4 or INT8), chosen when sharding starts from a probe
    # of the links (hf_zeropp.engine.auto)
    "auto": {"stage": 3, "shard_group": "auto"},
}
