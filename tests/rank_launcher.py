"""Start one plain process per rank and watch every rank's exit code and exit time.

``hf_zeropp.testing.spawn.run_distributed`` collects return values and stops at the first error; torchrun's agent
kills the surviving ranks as soon as one fails. Neither shows what a fault-tolerance test needs to see: whether *each*
surviving rank notices a dead peer on its own and exits non-zero, and how long that takes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    seconds after the fault. Ranks still alive then are recorded with ``returncode=None`` (a hang) and killed."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % node_size), "LOCAL_WORLD_SIZE": str(node_size),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), str(spec_path)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=HERE.parent, start_new_session=True))
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(exited_at) < world and time.monotonic() < deadline:
            if fault_marker is not None and after_fault is not None and fault_marker.exists():
                deadline = min(deadline, time.monotonic() + after_fault)
                fault_marker, after_fault = None, None
            for rank, proc in enumerate(procs):
                if rank not in exited_at and proc.poll() is not None:
                    exited_at[rank] = time.time()
            time.sleep(0.1)
    finally:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:  # a hang: record it, then clean up this rank's process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    return [RankExit(rank, procs[rank].returncode if rank in exited_at else None, exited_at.get(rank),
                     (workdir / f"rank{rank}.log").read_text())
            for rank in range(world)]


def last_error_line(log: str) -> str:
    """The exception a rank died with (the last line of its traceback)."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else ""
