"""DeepSpeed's fp16 dynamic loss scaler (``deepspeed.runtime.fp16.loss_scaler``) fed fixed overflow patterns, for
the fp16 sections hf_zeropp maps (loss_scale, initial_scale_power, loss_scale_window, hysteresis,
consecutive_hysteresis, min_loss_scale); writes the scale after every update to
tests/fixtures/deepspeed/loss_scale.json, which tests/interop/test_deepspeed_training.py holds
hf_zeropp.interop.deepspeed.training.DeepSpeedLossScaler to.

    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -m scripts.deepspeed_reference.loss_scale
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "deepspeed" / "loss_scale.json"
# overflow (1) or not (0) at each step: bursts, isolated overflows, and long clean runs that cross the windows
PATTERN = [0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
           0, 0, 0, 0, 0]
# the fp16 sections: DeepSpeed's defaults, the Transformers docs' values, and each rule changed on its own
SECTIONS = {
    "defaults": {},
    "transformers_docs": {"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
                          "min_loss_scale": 1},
    "small_window": {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2},
    "no_hysteresis": {"initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 1},
    "consecutive_hysteresis": {"initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 3,
                               "consecutive_hysteresis": True},
    "floor": {"initial_scale_power": 4, "loss_scale_window": 5, "hysteresis": 1, "min_loss_scale": 4},
    "floor_with_hysteresis": {"initial_scale_power": 3, "loss_scale_window": 8, "hysteresis": 2, "min_loss_scale": 2},
    "static": {"loss_scale": 128},
}


def deepspeed_scales(section: dict) -> dict:
    """The scale DeepSpeed's engine would use after each step of PATTERN (its ``CreateLossScaler`` for fp16), up to
    the step where it stops the run (an overflow at the floor), if any."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    fp16 = DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, **section}}).float16_config
    scaler = CreateLossScaler(dtype=torch.float16, static_loss_scale=fp16.loss_scale,
                              dynamic_scaling=fp16.loss_scale == 0, dynamic_loss_args=fp16.dynamic_loss_scale_args())
    scales = []
    for step, overflow in enumerate(PATTERN):
        try:
            scaler.update_scale(bool(overflow))
        except Exception as error:  # DeepSpeed raises a bare Exception at the floor
            return {"scales": scales, "stops_at": step, "error": str(error)}
        scales.append(float(scaler.loss_scale))
    return {"scales": scales, "stops_at": None}


def main() -> None:
    import deepspeed
    import deepspeed.comm as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29681", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed("gloo")  # the scaler says on rank 0 what it did
    fixture = {"deepspeed": deepspeed.__version__, "pattern": PATTERN,
               "cases": {name: {"fp16": section, **deepspeed_scales(section)} for name, section in SECTIONS.items()}}
    OUTPUT.write_text(json.dumps(fixture, indent=1) + "\n")
    dist.destroy_process_group()
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
