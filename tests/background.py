"""Launch fixtures made in the background, at the lowest CPU priority, while the rest of the suite runs.

On 2 cores the suite leaves about a sixth of the CPU idle once the background compiles of tests/conftest.py have
ended: a one-process test uses one core, a launcher starts alone before its workers, fault tests wait out timeouts
(/proc/stat every 5 s over a whole run, 2026-11-28). The launches of a fixture registered here depend on nothing
the other tests do. They start when collection ends, one fixture after the other in the order the suite first uses
them, and take that idle time; the fixture then waits for what is left, when the CPU is theirs alone. Same
commands, same checks as launching in the fixture.

A registered fixture is two functions of a fresh folder: ``prepare``, run in pytest's own thread when collection
ends (anything in-process that could touch state the tests share, such as seeding torch's global generator to
build a model to load), and ``launch``, run in the background thread, which starts processes only through
:func:`run` / :func:`popen` and builds their environment from :func:`environ` (the environment as collection
ended: a test running meanwhile may set variables of its own). Every process of a background launch runs at the
lowest priority (scripts/lowest_priority.sh), its workers too: tests/lowest_priority/sitecustomize.py, first on
their PYTHONPATH, lowers each Python process as it starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOWEST_PRIORITY = ["sh", str(HERE.parent / "scripts" / "lowest_priority.sh")]
# seconds: a background launch may wait long for idle CPU (the fixture waiting for it has pytest's timeout)
BACKGROUND_TIMEOUT = 3600

_fixtures: dict[str, tuple[Callable[[Path], None] | None, Callable[[Path], Any]]] = {}  # name: (prepare, launch)
_started: dict[str, tuple[Path, Future]] = {}
_processes: set[subprocess.Popen] = set()
_environ: dict[str, str] = {}
_in_background = contextvars.ContextVar("in_background", default=False)
_stopping = threading.Event()  # set when the session ends: no new background process
_executor: ThreadPoolExecutor | None = None


def launches(fixture: str, prepare: Callable[[Path], None] | None = None):
    """Register the decorated ``launch(folder) -> result`` (after ``prepare(folder)``) as what ``fixture`` is."""

    def register(launch: Callable[[Path], Any]) -> Callable[[Path], Any]:
        _fixtures[fixture] = (prepare, launch)
        return launch

    return register


def start(items) -> None:
    """Prepare and start the registered fixtures the collected ``items`` use, in the order they first use them."""
    global _executor
    needed = list(dict.fromkeys(name for item in items for name in getattr(item, "fixturenames", ())
                                if name in _fixtures))
    if not needed:
        return
    _environ.update(os.environ)
    _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-launches")
    for name in needed:
        prepare, launch = _fixtures[name]
        folder = Path(tempfile.mkdtemp(prefix=f"hf_zeropp_{name}_"))
        if prepare is not None:
            prepare(folder)
        _started[name] = (folder, _executor.submit(_run_in_background, launch, folder))


def _run_in_background(launch: Callable[[Path], Any], folder: Path) -> Any:
    _in_background.set(True)
    return launch(folder)


def result(fixture: str) -> Any:
    """What ``fixture``'s launches returned, once the background has made them (collection started every registered
    fixture a collected test uses)."""
    return _started[fixture][1].result()


def stop() -> None:
    """At the end of the session: kill the launches still running (a run stopped early) and remove the folders."""
    _stopping.set()
    for process in list(_processes):
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    if _executor is not None:
        _executor.shutdown(wait=True, cancel_futures=True)
    for folder, _ in _started.values():
        shutil.rmtree(folder, ignore_errors=True)


def environ() -> dict[str, str]:
    """The environment to start a launch's processes from: as collection ended, in the background; else now's."""
    return dict(_environ if _in_background.get() else os.environ)


def timeout(seconds: float) -> float:
    """How long to wait for a launch's process: ``seconds``, or in the background BACKGROUND_TIMEOUT."""
    return BACKGROUND_TIMEOUT if _in_background.get() else seconds


def popen(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command, **kwargs)``; in the background at the lowest priority, in a session of its own
    (killed whole by :func:`stop`)."""
    if not _in_background.get():
        return subprocess.Popen(command, **kwargs)
    if _stopping.is_set():
        raise RuntimeError("the test session has ended: no background launch starts")
    env = dict(kwargs.pop("env", None) or environ())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "lowest_priority"), env.get("PYTHONPATH")]))
    process = subprocess.Popen([*LOWEST_PRIORITY, *command], env=env, start_new_session=True, **kwargs)
    _processes.add(process)
    return process


def run(command: list[str], seconds: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=seconds, **kwargs)``, the process started
    by :func:`popen`, waited for :func:`timeout` (``seconds``)."""
    if not _in_background.get():
        return subprocess.run(command, capture_output=True, text=True, timeout=seconds, **kwargs)
    process = popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout(seconds))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    finally:
        _processes.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
