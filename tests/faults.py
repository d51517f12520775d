"""Fault injection shared by the fault tests (non-finite values, fp16 loss scaling, crash-safe checkpoints, rank
failures, exact resume): the ZeRO++ configuration they use, a SIGKILL, a non-finite gradient on one rank, and the
4-rank runs of ``tests/fault_worker.py`` that train 20 steps, checkpoint at 10 and can be killed at 15."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from rank_launcher import launch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
ZEROPP = {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True}
PG_TIMEOUT = 20  # seconds: the process-group timeout of the fault tests
EXIT_MARGIN = 30  # seconds on top of it for a survivor to notice, raise and tear its interpreter down (shared CPU)


def die():
    """SIGKILL this process: no exception, no atexit, no flushing."""
    os.kill(os.getpid(), signal.SIGKILL)


def inject_non_finite_gradient(model, value: float):
    """On this rank only: the gradient reaching the last block's output gets ``value`` at one position."""

    def forward_hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output

        def poison(grad):
            grad = grad.clone()
            grad[0, 3, 5] = value
            return grad

        hidden.register_hook(poison)

    return model.transformer.h[-1].register_forward_hook(forward_hook)


RESUME_CONFIGS = {"stage3": {"stage": 3}, "zeropp": ZEROPP,
                  # stochastic rounding in both hops' quantizers, the inter-node one with per-block widths
                  "zeropp_sr": {**ZEROPP, "stochastic_rounding": True, "seed": 7, "gradient_bit_allocation": True},
                  # LoCo-style: the residual averaged, and reset every 7 reductions (at 7 and 14: one before the
                  # checkpoint at 10 and one after it, so a resume that lost the count would reset at 17)
                  "zeropp_ef": {**ZEROPP, "gradient_error_feedback": True, "gradient_hadamard": 64,
                                "gradient_error_feedback_decay": 0.5, "gradient_error_feedback_reset": 7}}
STEPS, SAVE_AT, FAULT_AT = 20, 10, 15


def run_spec(name: str, root: Path, losses: Path, **extra) -> dict:
    return {"name": name, "config": RESUME_CONFIGS[name], "root": str(root), "losses": str(losses), "end": STEPS,
            "save_at": [SAVE_AT], **extra}


def read_losses(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}


def faulty_run(work: Path, run: dict) -> dict:
    marker = Path(run["losses"]).with_suffix(".killed")
    ranks = launch(WORKER, {"pg_timeout": PG_TIMEOUT, "runs": [run]}, work, 4, 2, timeout=500,
                   fault_marker=marker, after_fault=PG_TIMEOUT + EXIT_MARGIN)
    killed_at = json.loads(marker.read_text()) if marker.exists() else None
    return {"ranks": ranks, "killed": killed_at, "losses": read_losses(Path(run["losses"]))}
