"""Run a function on N gloo ranks in fresh local processes — one machine emulating several nodes — and collect
what each rank returns. Used by the tests and the measurement scripts; training jobs use torchrun instead.

Ranks are forked from a fork server that has imported torch, transformers and hf_zeropp once (``PRELOADED_MODULES``):
a spawned rank re-imports them, several CPU-seconds per rank, which on a 2-core machine cost more than most of the
distributed tests themselves. A rank still starts as a spawned one would: nothing of the calling process's state
but its working directory, module search path, environment and standard output/error, which are passed at each
start.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.reduction import DupFd

DEFAULT_PG_TIMEOUT = 120.0  # seconds a collective may wait for a peer before the process group gives up

# What the ranks of the tests and scripts import; the fork server imports each once (a name missing is skipped).
# ``import hf_zeropp`` is lazy, so the engine, checkpoints and integrations are named too: a rank that shards a model
# otherwise imports them itself (0.4 s of CPU for the engine, 1.7 s for the Trainer integration, measured here). None
# of them changes an upstream class on import; installing hf_zeropp into transformers or Accelerate is an explicit call.
# torch.compile's dynamo and AOTAutograd cost a rank that compiles 1.4 CPU-s to import (measured here).
PRELOADED_MODULES = ["hf_zeropp", "hf_zeropp.testing.tiny_models", "transformers.models.gpt2.modeling_gpt2",
                     "transformers.models.llama.modeling_llama", "hf_zeropp.engine.sharding",
                     "hf_zeropp.engine.runtime", "hf_zeropp.checkpoint.checkpoint",
                     "hf_zeropp.integrations.accelerate_integration", "hf_zeropp.integrations.trainer",
                     "torch._dynamo", "torch._functorch.aot_autograd"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_context():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)  # takes effect when the server first starts
    return context


class _PassedFd:
    """A file descriptor of the caller that reaches the started process as a descriptor of its own (an int there).
    It can only be pickled while a process is being started, when multiprocessing sends descriptors along."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (DupFd(self.fd),)


def _received_fd(passed) -> int:
    return passed.detach()


def _take_callers_process_state(environ: dict, stdout: int, stderr: int) -> None:
    """The fork server's environment and output files are those of the moment it started; a rank needs the caller's
    at this run (a test's environment variables, pytest's per-test output capture)."""
    os.environ.clear()
    os.environ.update(environ)
    for target, fd in ((1, stdout), (2, stderr)):
        os.dup2(fd, target)
        os.close(fd)


def _worker(rank, world_size, node_size, port, fn, args, queue, pg_timeout, caller_state):
    _take_callers_process_state(*caller_state)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % node_size), LOCAL_WORLD_SIZE=str(node_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        result = fn(*args)
        dist.barrier()
        buffer = io.BytesIO()  # plain bytes: tensors shared through the queue die with this process
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report any failure (assertions included) to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def run_distributed(fn, world_size: int, *args, node_size: int | None = None, timeout: float = 300.0,
                    pg_timeout: float | timedelta = DEFAULT_PG_TIMEOUT) -> list:
    """``fn(*args)`` on every rank (LOCAL_WORLD_SIZE = node_size); returns the per-rank results in rank order.

    ``timeout``: seconds to wait for the next rank to report before giving up. ``pg_timeout``: the process group's
    timeout (how long a collective waits for a missing peer). A rank that dies without reporting (a crash, a
    SIGKILL, the OOM killer) fails the run as soon as it is noticed instead of after ``timeout``; the error names
    every rank that failed within a few seconds of the first, not only the first.
    """
    node_size = node_size or world_size
    if isinstance(pg_timeout, timedelta):
        pg_timeout = pg_timeout.total_seconds()
    ctx = _rank_context()
    queue = ctx.Queue()
    port = _free_port()
    sys.stdout.flush()  # the caller's buffered output comes before its ranks' in the files they share
    sys.stderr.flush()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, node_size, port, fn, args, queue, pg_timeout,
                               (dict(os.environ), _PassedFd(1), _PassedFd(2))))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, queue, results, errors, timeout)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("distributed run failed\n" + "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _collect(procs, queue, results: dict, errors: dict, timeout: float, grace: float = 3.0) -> None:
    """Read the ranks' reports until all are in, one fails (plus ``grace`` seconds for the others' errors), a rank
    dies without reporting, or no report arrives for ``timeout`` seconds."""
    last_progress = time.monotonic()
    first_error_at: float | None = None
    while len(results) + len(errors) < len(procs):
        now = time.monotonic()
        if first_error_at is not None and now - first_error_at > grace:
            return
        if now - last_progress > timeout:
            silent = [r for r in range(len(procs)) if r not in results and r not in errors]
            errors.update({r: f"no report within {timeout:.0f} s ({_exit_description(procs[r].exitcode)})"
                           for r in silent})
            return
        try:
            rank, status, payload = queue.get(timeout=0.5)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in results and r not in errors and p.exitcode is not None]
            if dead:
                _drain(queue, results, errors, wait=1.0)  # its report may still be in the pipe
                for r in dead:
                    if r not in results and r not in errors:
                        errors[r] = f"died without reporting ({_exit_description(procs[r].exitcode)})"
                        first_error_at = first_error_at or time.monotonic()
            continue
        last_progress = time.monotonic()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
            first_error_at = first_error_at or last_progress


def _drain(queue, results: dict, errors: dict, wait: float) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue_module.Empty:
            return
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
