"""Launches of scripts under ``hf-zeropp launch`` and under stock ``accelerate launch``, from the checkout's root,
with only the ``ZEROPP_*`` variables a test sets: shared by the launch tests and the launch fixtures made in the
background (tests/background.py; conftest's DeepSpeed-config runs)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import background
from paths import ROOT

BIN = Path(sys.executable).parent
STOCK_CPU = ROOT / "recipes" / "accelerate" / "cpu_4proc.yaml"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# With torch 2.13 on gloo, a stock script that never destroys its process group sometimes aborts as its process exits,
# after it has finished and written its results: gloo's worker threads still hold work when Python finalizes (about 1
# launch in 5 under load). That is stock's own exit, so a stock launch may end that way; the results are compared in
# full. The launcher's workers destroy their group at exit, so an hf-zeropp launch must end with 0.
EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(output: str) -> bool:
    return EXIT_ABORT in output and ("(SIGABRT)" in output or "exitcode: -6" in output)


def run_launch(command: list[str], env: dict[str, str] | None = None, timeout: int = 300, stock: bool = False) -> str:
    full_env = {**background.environ(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    for name in [n for n in full_env if n.startswith("ZEROPP_")]:
        if env is None or name not in env:
            del full_env[name]  # only what a test sets reaches the launch
    result = background.run(command, timeout, cwd=ROOT, env=full_env)
    output = result.stdout + result.stderr
    assert result.returncode == 0 or (stock and aborted_at_exit(output)), first_failure(output)
    return output


def first_failure(output: str) -> str:
    """From the first traceback on (a failing rank's own error comes before the launcher's summary), and the end."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line or "Fatal" in line), max(0, len(lines) - 80))
    return "\n".join(lines[first:first + 80] + ["..."] + lines[-30:])


def hf_zeropp_launch(*args: str, env: dict[str, str] | None = None) -> str:
    return run_launch([str(BIN / "hf-zeropp"), "launch", "--main_process_port", free_port(), *args], env)


def stock_launch(*args: str, env: dict[str, str] | None = None) -> str:
    return run_launch([str(BIN / "accelerate"), "launch", "--config_file", str(STOCK_CPU), "--main_process_port",
                       free_port(), *args], {"ACCELERATE_USE_CPU": "true", **(env or {})}, stock=True)
