"""Start one plain process per rank and watch every rank's exit code and exit time.

``hf_zeropp.testing.spawn.run_distributed`` collects return values and stops at the first error; torchrun's agent
kills the surviving ranks as soon as one fails. Neither shows what a fault-tolerance test needs to see: whether *each*
surviving rank notices a dead peer on its own and exits non-zero, and how long that takes.

Each rank is still a process of its own, in a session of its own, with its own exit code, environment, working
directory and log file; it is forked from ``hf_zeropp.testing.spawn``'s fork server, which has imported torch,
transformers and hf_zeropp once, and runs the script as ``__main__``: started afresh, each rank re-imported them,
several CPU-seconds per rank and launch.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_zeropp.testing.spawn import _rank_context

HERE = Path(__file__).resolve().parent


@dataclass
class RankExit:
    rank: int
    returncode: int | None  # None: still running when the launcher gave up (a hang); negative: killed by a signal
    exited_at: float | None  # wall time (time.time()) when the launcher saw the exit
    log: str = field(repr=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, spec: dict, workdir: Path, world: int, node_size: int, timeout: float,
           fault_marker: Path | None = None, after_fault: float | None = None) -> list[RankExit]:
    """Run ``python script SPEC`` on ``world`` ranks (gloo rendezvous on localhost) and wait for all of them, at
    most ``timeout`` seconds — or, once ``fault_marker`` exists (the faulty rank writes it), at most ``after_fault``
    seconds after the fault, and at most ``FAULTY_GRACE`` seconds once every rank but the faulty one has ended (a
    frozen rank never ends). Ranks still alive then are recorded with ``returncode=None`` (a hang) and killed."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    context = _rank_context()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % node_size), "LOCAL_WORLD_SIZE": str(node_size),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        proc = context.Process(target=_run_script, args=(str(script), str(spec_path), env,
                                                         str(workdir / f"rank{rank}.log"), str(HERE.parent)))
        proc.start()
        procs.append(proc)
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    faulty = None  # the rank that wrote the fault marker
    try:
        while len(exited_at) < world and time.monotonic() < deadline:
            if fault_marker is not None and after_fault is not None and fault_marker.exists():
                faulty = _marker_rank(fault_marker)
                if faulty is not None:  # else being written: read again at the next poll
                    deadline = min(deadline, time.monotonic() + after_fault)
                    fault_marker, after_fault = None, None
            for rank, proc in enumerate(procs):
                if rank not in exited_at and proc.exitcode is not None:
                    exited_at[rank] = time.time()
            if faulty is not None and set(exited_at) == set(range(world)) - {faulty}:
                # every other rank has ended: a frozen faulty rank never will (a killed one is reaped by now)
                deadline = min(deadline, time.monotonic() + FAULTY_GRACE)
            time.sleep(0.1)
    finally:
        for rank, proc in enumerate(procs):
            if proc.exitcode is None:  # a hang: record it, then clean up this rank's process group
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join()
    return [RankExit(rank, procs[rank].exitcode if rank in exited_at else None, exited_at.get(rank),
                     (workdir / f"rank{rank}.log").read_text())
            for rank in range(world)]


FAULTY_GRACE = 2.0  # seconds the faulty rank is still waited for once every other rank has ended


def _marker_rank(marker: Path) -> int | None:
    try:
        return json.loads(marker.read_text())["rank"]
    except (ValueError, KeyError):
        return None


def _run_script(script: str, spec: str, environ: dict, log: str, cwd: str) -> None:
    """In the forked rank: what ``python SCRIPT SPEC`` would have of its own (a session, which a hang's cleanup
    kills whole; the environment, the working directory, stdout and stderr into the log, unbuffered, as
    PYTHONUNBUFFERED=1 had them; one thread, as OMP_NUM_THREADS=1 had torch start), then the script as
    ``__main__``. Its exit code is the process's: 0, SystemExit's, 1 after an exception (its traceback in the log)."""
    import torch

    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    torch.set_num_threads(1)
    sys.argv = [script, spec]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def last_error_line(log: str) -> str:
    """The exception a rank died with (the last line of its traceback)."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else ""
