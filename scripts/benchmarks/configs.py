"""What the cluster benchmark compares: the configurations (hf_zeropp options, None = stock FSDP2) and link rates.

``ON_REQUEST`` configurations run only when named in ``--configs``. So do those of ``DEEPSPEED``, DeepSpeed's own
ZeRO-3 and ZeRO++ (its ``zero_optimization`` options; ``"node"`` is the ranks per node), which also need an
interpreter that has ``deepspeed`` (``--python``; scripts/benchmarks/deepspeed_env.sh): it is installed for this
benchmark alone, never as a dependency of hf_zeropp. Each has an ``hf `` twin in ``HF_TWINS``: the same
``zero_optimization`` dict given to hf_zeropp (``ZeroPPConfig.from_deepspeed``), so that like is compared with like."""

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
ON_REQUEST: dict[str, dict] = {
    "ZeRO-2": {"stage": 2},  # weights kept gathered from forward to backward: what DeepSpeed's defaults do here
    # what all-reducing the 1-D parameters in fp32 beside hybrid-q's INT4 blocks costs
    "hybrid-q 1-D quantized": {"preset": "hybrid-q", "gradient_full_precision_1d": False},
    # the INT8 variants auto may widen a quantized choice to
    "ZeRO++ int8 gradients": {"preset": "zeropp", "gradient_bits": 8},
    "hybrid-q int8": {"preset": "hybrid-q", "hybrid_gradient_bits": 8},
    # qwZ sending INT4 differences against a copy each node keeps (docs/results/2026-12-07-weight-deltas.md)
    "ZeRO++ deltas": {"preset": "zeropp-deltas"},
}
DEEPSPEED: dict[str, dict] = {
    "DeepSpeed ZeRO-3": {"stage": 3},  # its defaults keep up to 1e9 gathered parameters live between uses
    "DeepSpeed ZeRO-3 regather": {"stage": 3, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
    "DeepSpeed hpZ": {"stage": 3, "zero_hpz_partition_size": "node"},
    "DeepSpeed qwZ": {"stage": 3, "zero_quantized_weights": True},
    "DeepSpeed qgZ": {"stage": 3, "zero_quantized_gradients": True},
}
HF_TWINS: dict[str, dict] = {f"hf {name}": zero for name, zero in DEEPSPEED.items()}


def deepspeed_peer(name: str) -> str | None:
    """The DeepSpeed configuration an ``hf `` twin is measured against."""
    return name.removeprefix("hf ") if name in HF_TWINS else None
