"""Wall-clock timing of GPU work: synchronize before and after, so the time covers the kernels the call queued and
nothing queued before it."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronized_seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
