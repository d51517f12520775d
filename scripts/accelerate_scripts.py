"""Accelerate's own distributed test scripts under ``hf-zeropp launch``: the lane scripts/test_accelerate_scripts.sh runs.

Accelerate ships the scripts its CI launches on several processes (``accelerate/test_utils/scripts/`` and its
``external_deps/``). They run from the installed Accelerate, never copied here, so that a new release's scripts run
as soon as it is installed. Every script found runs under ``hf-zeropp launch`` once per preset: ``zero3`` on 2 CPU
processes, ``zeropp`` (qwZ + hpZ + qgZ) on 4 emulating 2 nodes x 2 ranks (2 x 1 for a script written for 2). Left out
are the scripts in ``OUT``, which do not pass under stock ``accelerate launch`` on 2 CPU processes either (the reason
is given); a script not listed there (a new release's) runs. A check of a DDP-only internal that sharding changes by
design is skipped by name (``SKIPPED``): its script runs through this file's ``run`` mode, which replaces that
function by one that prints the reason (where the check's arguments say so), and fails if the script no longer
defines it. docs/design.md ("Accelerate's own test scripts") lists both.

    python scripts/accelerate_scripts.py                         # every script x preset, under hf-zeropp launch
    python scripts/accelerate_scripts.py --stock                 # the same scripts under stock accelerate launch
    python scripts/accelerate_scripts.py --only test_sync.py --presets zero3

Each launch is one line (script, preset, pass / pass with checks skipped by name / fail, seconds); a failure ends the
run with exit status 1, naming the script and the preset, after the failing launch's first traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STOCK_CPU = ROOT / "recipes" / "accelerate" / "cpu_4proc.yaml"  # stock: MULTI_GPU's torchrun path, gloo on CPU
ONE_FILE = ROOT / "recipes" / "accelerate" / "cpu_2x2.yaml"  # hf-zeropp launch: MULTI_CPU, 4 processes

# preset: (processes, ranks per emulated node); ZeRO++ on 2 nodes x 2 ranks, or 2 x 1 for a script in TWO_PROCESSES
PRESETS = {"zero3": (2, 2), "zeropp": (4, 2)}
STOCK_PROCESSES = 2
ERROR = re.compile(r"\b\w+(Error|Exception): .*|timed out after .*")  # a failed launch's line names its first error
# Scripts written for exactly 2 processes (they fail under stock on 4 as well)
TWO_PROCESSES = {
    "test_script.py": "test_split_between_processes_tensor expects every rank but 0 to get the second of 2 rows",
}

# Scripts that fail (or hang) under stock `accelerate launch` on 2 CPU processes, with the reason (Accelerate 1.16)
OUT = {
    "test_ddp_comm_hook.py": "builds its DDP reference with device_ids=[local rank], which DDP accepts for GPU "
                             "modules only (ValueError on CPU)",
    "test_distributed_data_loop.py": "hangs in test_can_join_uneven_inputs: join_uneven_inputs is multi-GPU only, "
                                     "so on CPU rank 0's second backward waits for an all-reduce rank 1 never joins",
    "test_merge_weights.py": "FSDP: on CPU Accelerate trains with DDP instead, and save_fsdp_model then fails "
                             "(KeyError: None)",
    "test_notebook.py": "starts its own processes with notebook_launcher (run with python, not accelerate launch); "
                        "under accelerate launch its fp16 check fails (ACCELERATE_MIXED_PRECISION is not fp16)",
    "external_deps/test_checkpointing.py": "imports evaluate (not installed); trains bert-base-cased on GLUE MRPC "
                                           "from the Hub",
    "external_deps/test_ds_alst_ulysses_sp.py": "imports deepspeed (not installed): DeepSpeed's sequence parallelism",
    "external_deps/test_ds_multiple_model.py": "imports evaluate (not installed); DeepSpeed engines, a Hub model",
    "external_deps/test_metrics.py": "imports evaluate (not installed); a Hub model and GLUE MRPC",
    "external_deps/test_peak_memory_usage.py": "measures GPU memory; loads a Hub model and GLUE MRPC (no Hub here)",
    "external_deps/test_performance.py": "imports evaluate (not installed); a Hub model and GLUE MRPC",
    "external_deps/test_zero3_integration.py": "DeepSpeed ZeRO-3 on GPUs: an nccl process group, a Hub model",
}


def _always(*args, **kwargs) -> bool:
    return True


# Checks of a DDP internal that sharding changes by design: script -> {function: (when, reason)}. The function is
# replaced by one that skips it where ``when(*its arguments)`` holds and calls it otherwise. At stages 2 and 3 every
# backward reduces its gradients, so that no rank keeps a full unreduced gradient (DeepSpeed refuses no_sync at those
# stages for the same reason): between synchronising steps the gradients already agree across ranks, where DDP's
# still differ. The accumulated result, and so training, is the same (test_sync.py's in-sync checks and
# tests/conformance/test_conformance.py check it).
IN_SYNC_ALREADY = "asserts that gradients differ across ranks between synchronising steps; at stage 3 they agree"
SKIPPED = {
    "test_sync.py": {
        "test_distributed_sync": (_always, IN_SYNC_ALREADY + " (its in-sync half is inlined with it)"),
        "check_model_parameters": (lambda model_a, model_b, did_step, *args, **kwargs: not did_step,
                                   IN_SYNC_ALREADY + " (skipped where did_step is False; its in-sync half runs)"),
    },
}


def scripts_folder() -> Path:
    import accelerate.test_utils

    return Path(accelerate.test_utils.__file__).resolve().parent / "scripts"


def found_scripts() -> list[str]:
    """Every test script of the installed Accelerate, relative to its scripts folder."""
    folder = scripts_folder()
    return sorted(str(path.relative_to(folder)) for path in
                  [*folder.glob("test_*.py"), *folder.glob("external_deps/test_*.py")])


# ---------------------------------------------------------------- run mode: one script, its listed checks skipped

def _skipping(script: str, name: str, original, when, reason: str):
    """``original``, except where ``when`` holds for the call's arguments: then say (once, rank 0) what is skipped."""
    said = []

    def replacement(*args, **kwargs):
        if not when(*args, **kwargs):
            return original(*args, **kwargs)
        if not said and os.environ.get("RANK", "0") == "0":
            print(f"skipped by name: {script}::{name}: {reason}", flush=True)
        said.append(True)

    return replacement


def run_skipping(script: str) -> None:
    """Run ``script`` (relative to the scripts folder) with its ``SKIPPED`` functions replaced, then its ``main``."""
    path = scripts_folder() / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its classes pickle by module name (DataLoader workers, pickled accelerators)
    spec.loader.exec_module(module)
    for name, (when, reason) in SKIPPED.get(script, {}).items():
        if not callable(getattr(module, name, None)):
            raise SystemExit(f"{script} no longer defines {name}, which SKIPPED in {__file__} names: update the list")
        setattr(module, name, _skipping(script, name, getattr(module, name), when, reason))
    module.main()


# ---------------------------------------------------------------- the lane: every script x preset

def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch_command(script: str, preset: str | None) -> list[str]:
    """The launch of ``script`` under ``preset`` (None: stock ``accelerate launch`` on 2 processes)."""
    if preset is None:
        return [str(BIN / "accelerate"), "launch", "--config_file", str(STOCK_CPU), "--num_processes",
                str(STOCK_PROCESSES), "--main_process_port", _port(), str(scripts_folder() / script)]
    processes, node_size = PRESETS[preset]
    if script in TWO_PROCESSES and processes > 2:
        processes, node_size = 2, 1  # ZeRO++ across 2 nodes x 1 rank
    zeropp = json.dumps({"preset": preset, "node_size": node_size})
    target = ([str(Path(__file__).resolve()), "run", script] if script in SKIPPED
              else [str(scripts_folder() / script)])
    return [str(BIN / "hf-zeropp"), "launch", "--config_file", str(ONE_FILE), "--num_processes", str(processes),
            "--zeropp", zeropp, "--main_process_port", _port(), *target]


def _first_failure(output: str) -> str:
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 60))
    return "\n".join(lines[first:first + 60] + ["..."] + lines[-20:])


def run_one(script: str, preset: str | None, timeout: int) -> tuple[str, float, str]:
    """(result, seconds, output) of one launch; result is pass, pass with the skipped checks named, or fail."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("ZEROPP_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if preset is None:
        env["ACCELERATE_USE_CPU"] = "true"
    start = time.monotonic()
    launcher = subprocess.Popen(launch_command(script, preset), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, ok = launcher.communicate(timeout=timeout)[0], launcher.returncode == 0
    except subprocess.TimeoutExpired:
        # SIGTERM: torchrun's agent then ends its workers, which run in sessions of their own (SIGKILL would orphan them)
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            output = launcher.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output = launcher.communicate()[0]
        output, ok = f"{output}\ntimed out after {timeout} s", False
    seconds = time.monotonic() - start
    skipped = [name for name in SKIPPED.get(script, {}) if f"skipped by name: {script}::{name}:" in output]
    if not ok:
        errors = [line for line in output.splitlines() if ERROR.search(line) and "ChildFailedError" not in line]
        return (f"fail: {ERROR.search(errors[0]).group(0)[:100]}" if errors else "fail"), seconds, output
    return (f"pass, skipped by name: {', '.join(skipped)}" if skipped else "pass"), seconds, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", action="store_true", help="stock accelerate launch (2 processes) instead")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated, of: " + ", ".join(PRESETS))
    parser.add_argument("--only", action="append", help="this script only (relative to the scripts folder); repeatable")
    parser.add_argument("--all", action="store_true", help="also the scripts listed as out")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    args = parser.parse_args(argv)
    import accelerate

    scripts = [s for s in found_scripts() if (args.all or s not in OUT) and (not args.only or s in args.only)]
    presets: list[str | None] = [None] if args.stock else args.presets.split(",")
    unknown = [p for p in presets if p is not None and p not in PRESETS]
    if unknown or not scripts:
        parser.error(f"unknown preset {unknown}" if unknown else f"no script matches {args.only}")
    where = "stock accelerate launch" if args.stock else "hf-zeropp launch"
    out = [s for s in found_scripts() if s in OUT and s not in scripts]
    print(f"Accelerate {accelerate.__version__}'s test scripts ({scripts_folder()}) under {where}: {len(scripts)} "
          f"scripts x {len(presets)} presets; out (they fail under stock on CPU): {', '.join(out) or 'none'}",
          flush=True)
    start, failures = time.monotonic(), []
    for script in scripts:
        for preset in presets:
            result, seconds, output = run_one(script, preset, args.timeout)
            print(f"  {script:<42} {preset or 'stock':<7} {result}  ({seconds:.0f} s)", flush=True)
            if result.startswith("fail"):
                failures.append((script, preset, output))
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{len(scripts) * len(presets)} launches: {time.monotonic() - start:.0f} s wall, "
          f"{used.ru_utime + used.ru_stime:.0f} s CPU", flush=True)
    for script, preset, output in failures:
        print(f"\n{_first_failure(output)}", file=sys.stderr)
    for script, preset, _ in failures:
        print(f"FAILED: Accelerate's {script} under {where}" + (f" --zeropp {preset}" if preset else ""),
              file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run_skipping(sys.argv[2])
    else:
        sys.exit(main())
