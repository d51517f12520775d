"""Run a function on N ranks that are threads of this process, over torch's threaded process group: the way to
exercise the multi-rank CUDA path on a single GPU, where NCCL refuses two ranks on one device.

Each rank thread may run its own CUDA stream (``own_streams``), so work that a rank issues on one stream and reads
on another without a wait would race as it does with one GPU per rank. The threaded group copies every rank's data
in one thread, on that thread's stream; to keep the harness itself free of races, a collective first waits for
the caller's current stream (its inputs are complete, as NCCL orders a collective after the work already issued on
the caller's stream), and returns once its outputs are written. Everything a rank issues outside collectives keeps
the ordering its own code gives it, which is what a stream check has to see.

On CPU the same harness runs the ranks of the tests as threads instead of processes; it is checked there against
gloo processes (tests/testing/test_threaded_ranks.py).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._compat import threaded_process_groups

DEFAULT_TIMEOUT = 600.0  # seconds the whole run may take before the ranks still running are reported hung


def run_threaded(fn: Callable[..., Any], world_size: int, *args: Any, own_streams: bool = False,
                 sanitizer: Any = None, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """``fn(*args)`` on ``world_size`` rank threads; returns what each rank returned, by rank. A rank that raises
    stops the others and the first failure is raised here with its rank's traceback. ``own_streams``: each rank
    runs on a CUDA stream of its own (current device). ``sanitizer``: a dispatch mode every rank thread enters
    (torch's CUDA stream sanitizer keeps one per process, and dispatch modes are per thread)."""
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    with threaded_process_groups() as (store, stop_all):
        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                with _stream_of_its_own(own_streams), sanitizer if sanitizer is not None else contextlib.nullcontext():
                    results[rank] = fn(*args)
            except BaseException as error:  # noqa: BLE001 -- reported below, with the rank's traceback
                failures[rank] = traceback.format_exc()
                stop_all(error)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}") for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if failures:
        rank = min(failures, key=lambda r: "Test termination event" in failures[r])  # the cause, not the echoes
        raise RuntimeError(f"rank {rank} of {world_size} threads failed:\n{failures[rank]}")
    if hung:
        raise TimeoutError(f"rank threads {hung} still running after {timeout:.0f} s")
    return results


@contextlib.contextmanager
def _stream_of_its_own(enabled: bool) -> Iterator[None]:
    """A fresh CUDA stream made current for the block (nothing without ``enabled``); the rank's work on it is
    complete when the block ends, so its results can be read from any thread."""
    if not enabled:
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream()):
        try:
            yield
        finally:
            torch.cuda.current_stream().synchronize()
