"""hf_zeropp under torchrun's failure handling: the traceback of the rank that failed first, as the last thing a
failed launch prints, and restarts that can bring the workers back.

torchrun (and ``accelerate launch``, and ``hf-zeropp launch``, which both run torchrun's agent) ends a failed job with
a summary whose last entry is the "root cause": among the ranks of its own node, the one whose failure it saw first,
compared in whole seconds. Two things go wrong there. A worker that does not write torchelastic's error file is shown
as "To enable traceback see ...", with no traceback at all. And on a node whose ranks only failed because a rank of
another node died first, the root cause is one of them, with a "Connection closed by peer" that says nothing.

Imported in a torchelastic worker (``TORCHELASTIC_ERROR_FILE`` set), hf_zeropp therefore installs an excepthook that
writes that error file, as torch's ``record`` decorator does, and orders the failures through the job's store: the
first rank to fail publishes its traceback, and every later one appends it to its own. Whichever rank a node's agent
names, the summary ends with the first failure's traceback. Without a process group (a failure before
``init_process_group``) the rank's own traceback is written; the store is given a few seconds at most.

Restarts (``torchrun --max-restarts``) on torch 2.13 with gloo bring the workers back only through the c10d
rendezvous, with a fresh store for every rendezvous round. The default store is shared by all rounds, so a restarted
worker reads the previous attempt's gloo addresses and fails with "Connection refused" (pytorch#135712); under the
static rendezvous the surviving nodes never join a new round. Stock scripts fail the same way; hf_zeropp says so on
rank 0 when restarts are asked for without that fix (:func:`restart_problem`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

from .._compat import default_store

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
FRESH_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RESTART_FIX = (f"set {FRESH_STORE_VARIABLE}=1 and use the c10d rendezvous (torchrun --rdzv-backend c10d, or "
               f"--standalone on one machine)")
FIRST_FAILURE_KEY = "hf_zeropp/first_failure"
FAILURE_COUNT_KEY = "hf_zeropp/failures"
STORE_TIMEOUT = timedelta(seconds=5)

_previous_hook: Any = None


def install() -> None:
    """Report uncaught exceptions to the launcher, when this process is one of its workers (idempotent)."""
    global _previous_hook
    if _previous_hook is None and os.environ.get(ERROR_FILE_VARIABLE):
        _previous_hook = sys.excepthook
        sys.excepthook = _report_then_print
        problem = restart_problem(os.environ)
        if problem and os.environ.get("RANK") == "0":
            warnings.warn(f"hf_zeropp: {problem}", stacklevel=3)


def restart_problem(environment: dict[str, str] | os._Environ) -> str | None:
    """Why torchrun's restarts of these workers would fail, or None. Read from the worker's environment, which
    carries the agent's: the restart count it allows and whether its rendezvous store is shared by all rounds."""
    restarts = int(environment.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if restarts == 0 or environment.get(FRESH_STORE_VARIABLE) == "1":
        return None
    return (f"torchrun may restart these workers (TORCHELASTIC_MAX_RESTARTS={restarts}), but its rendezvous store "
            f"is shared by every restart ({FRESH_STORE_VARIABLE} is not 1): a restarted worker would read the "
            f"previous attempt's gloo addresses and fail with 'Connection refused' (pytorch#135712). To restart, "
            f"{RESTART_FIX}")


def _report_then_print(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    if issubclass(kind, Exception):
        try:
            _write_error_file(kind, error, trace)
        except Exception as failure:  # the report must never hide the error it reports
            print(f"hf_zeropp: could not write the error file for torchrun ({failure!r})", file=sys.stderr)
    _previous_hook(kind, error, trace)


def _write_error_file(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    own = "".join(traceback.format_exception(kind, error, trace))
    first = _first_failure(own)
    callstack = own
    if first is not None and first["traceback"] != own:
        callstack = f"{own}\nRank {first['rank']} failed before this rank; its traceback:\n{first['traceback']}"
    extra = {"py_callstack": callstack, "timestamp": str(int(time.time()))}
    if first is not None:
        extra["first_failed_rank"] = first["rank"]
    path = os.environ[ERROR_FILE_VARIABLE]
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        json.dump({"message": {"message": f"{kind.__name__}: {error}", "extraInfo": extra}}, file)
    os.replace(partial, path)


def _first_failure(own: str) -> dict[str, Any] | None:
    """The first failing rank's record ``{"rank", "traceback"}`` from the job's store, publishing this rank's if it
    is the first; None without a reachable store."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = default_store()
        store.set_timeout(STORE_TIMEOUT)
        rank = dist.get_rank()
        if store.add(FAILURE_COUNT_KEY, 1) == 1:
            store.set(FIRST_FAILURE_KEY, json.dumps({"rank": rank, "traceback": own}))
            return {"rank": rank, "traceback": own}
        return json.loads(store.get(FIRST_FAILURE_KEY))
    except Exception:  # the store's host is gone or unreachable: this rank's own traceback is all there is
        return None
