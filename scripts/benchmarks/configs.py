"""What the cluster benchmark compares: the configurations (hf_zeropp options, None = stock FSDP2) and link rates."""

from __future__ import annotations

CONFIGS: dict[str, dict | None] = {
    "FSDP2": None,  # stock torch FSDP2
    "ZeRO-3": {"stage": 3},
    "+qwZ": {"stage": 3, "quantized_weights": True},
    "+hpZ": {"stage": 3, "hpz_partition_size": "node"},
    "+qgZ": {"stage": 3, "quantized_gradients": True},
    "ZeRO++": {"preset": "zeropp"},
    "ZeRO++ ref": {"preset": "zeropp", "kernel_backend": "reference"},
    "hybrid": {"preset": "hybrid"},
    "hybrid-q": {"preset": "hybrid-q"},
    "auto": {"preset": "auto"},
}
LINKS = ("100mbit", "300mbit", "1gbit", "3gbit", "none")
