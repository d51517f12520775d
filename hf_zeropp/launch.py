"""``hf-zeropp launch``: ``accelerate launch`` for scripts that do not import hf_zeropp.

Accelerate has no extension point for a third-party backend: its ``distributed_type`` is a closed enum and its
launch YAML refuses unknown keys. So this launcher takes every ``accelerate launch`` option (it parses them with
Accelerate's own parser), reads what is hf_zeropp's out of them, and starts ``accelerate launch`` with the rest:

- the ZeRO++ config: ``--zeropp VALUE``, else a top-level ``zeropp:`` key of the Accelerate YAML (removed before
  Accelerate reads the file), else the Accelerate DeepSpeed settings (``distributed_type: DEEPSPEED`` with a
  ``deepspeed_config_file`` or ``zero_stage``; ``--use_deepspeed``), else ``ZEROPP_CONFIG`` / ``ZEROPP_*``. It is
  checked here against the launch (world size, ranks per node), then handed to the workers as JSON in
  ``ZEROPP_CONFIG``;
- each worker runs ``python -m hf_zeropp.dropin SCRIPT ARGS`` (:mod:`hf_zeropp.dropin`), which installs hf_zeropp in
  accelerate, transformers and TRL and then runs the script unchanged;
- on a machine without GPUs, several processes take Accelerate's torchrun path with ``ACCELERATE_USE_CPU=true``
  (Accelerate's own CPU path would start one process, or need MPI).

Every refusal (a bad config, a conflicting ``distributed_type``, an unsupported DeepSpeed key, a missing script)
is one line on standard error and exit status 2, before any worker starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from .config import ZeroPPConfig
from .failure_report import FRESH_STORE_VARIABLE
from .topology import Topology

CONFIG_KEY = "zeropp"
WORKER_MODULE = "hf_zeropp.dropin"
# Environment set only to start a worker as Python starts a script (the script's folder first on the module search
# path): the worker puts these variables' own values, kept here as JSON, back before the script runs.
RESTORE_ENVIRONMENT = "HF_ZEROPP_RESTORE_ENVIRONMENT"
LOAD_IN_SLICES = "HF_ZEROPP_LOAD_IN_SLICES"  # set by --load_in_slices; the workers' dropin reads it
# Accelerate's distributed types that hf_zeropp.Accelerator runs under (it replaces DDP there)
RUNS_ON = {"NO", "MULTI_GPU", "MULTI_CPU"}
# Accelerate's DeepSpeed settings (YAML ``deepspeed_config`` keys = ``accelerate launch`` option names)
DEEPSPEED_SETTINGS = (
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names",
)
# ... of which these only steer DeepSpeed's own launcher or its model init and save: nothing to map
DEEPSPEED_LAUNCH_ONLY = {"zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile",
                         "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_multinode_launcher"}


class LaunchError(ValueError):
    """A launch refused before any worker starts; the message is the one line the user sees."""


def parser() -> argparse.ArgumentParser:
    """Accelerate's ``accelerate launch`` parser plus ``--zeropp``."""
    from accelerate.commands.launch import launch_command_parser

    launch_parser = launch_command_parser()
    launch_parser.prog = "hf-zeropp launch"
    launch_parser.add_argument(
        "--zeropp", default=None,
        help="hf_zeropp config: a preset (zero3, zeropp, ...), a YAML/JSON file (hf_zeropp or DeepSpeed format) or a "
             "JSON object of options; overrides the config file's `zeropp:` key")
    launch_parser.add_argument(
        "--load_in_slices", action="store_true",
        help="every from_pretrained in the script builds the model on the meta device, and sharding reads each "
             "rank's own slices of its safetensors files (hf_zeropp.from_pretrained): no full copy on any rank. "
             "A model used before it is prepared (moved, resized, run) fails: it has no weights until then")
    return launch_parser


def launch(argv: list[str]) -> int:
    """Parse ``argv`` as ``accelerate launch`` does, move hf_zeropp's settings out of it, then run
    ``accelerate launch`` with every worker started through :mod:`hf_zeropp.dropin`."""
    args = parser().parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="hf_zeropp_launch_") as scratch:
            environment = prepare(args, Path(scratch))
            return _run_accelerate(args, environment)
    except LaunchError as error:
        print(f"hf-zeropp launch: error: {error}", file=sys.stderr)
        return 2


def prepare(args: argparse.Namespace, scratch: Path) -> dict[str, str]:
    """Check the launch and rewrite ``args`` in place for ``accelerate launch``; return the environment the workers
    need on top of this process's. Raises :class:`LaunchError`."""
    if args.no_python:
        raise LaunchError("--no_python runs a program that is not Python, where hf_zeropp cannot be installed; "
                          "launch a Python script or module")
    _check_script(args)
    config_file, settings = _accelerate_settings(args)
    value = _config_value(args, settings)
    environment = {"ZEROPP_CONFIG": json.dumps(_resolve(value, args, settings).to_dict())}
    if args.load_in_slices:
        environment[LOAD_IN_SLICES] = "1"
    _check_script_options(args.training_script_args)
    environment.update(_restart_environment(args, settings))
    if _runs_on_cpu(args, settings):
        # Accelerate's torchrun path; each worker's Accelerator then runs on CPU with gloo
        args.cpu, args.multi_gpu = False, True
        settings.update(distributed_type="MULTI_GPU", use_cpu=False)
        environment["ACCELERATE_USE_CPU"] = "true"
    if config_file is not None:
        args.config_file = str(scratch / "accelerate_config.yaml")
        Path(args.config_file).write_text(yaml.safe_dump(settings))
    environment.update(_worker_entry(args))
    return environment


def _restart_environment(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, str]:
    """``--max_restarts``: restarted workers come back only through the c10d rendezvous with a fresh store per round
    (:mod:`hf_zeropp.failure_report`), so the static rendezvous is refused and the fresh store is asked for."""
    if not getattr(args, "max_restarts", 0):
        return {}
    backend = args.rdzv_backend if args.rdzv_backend != "static" else settings.get("rdzv_backend", "static")
    if backend == "static":
        raise LaunchError(f"--max_restarts {args.max_restarts} needs --rdzv_backend c10d: under the static rendezvous "
                          f"restarted workers cannot rejoin the others")
    return {FRESH_STORE_VARIABLE: "1"}


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        top = script.split(".")[0]
        found = (importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
                 or importlib.util.find_spec(top))  # python -m looks in the working directory first
        if found is None:
            raise LaunchError(f"module {script!r} (-m) is not importable from {os.getcwd()} or the installed packages")
    elif not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist (working directory {os.getcwd()})")


def _accelerate_settings(args: argparse.Namespace) -> tuple[Path | None, dict[str, Any]]:
    """The Accelerate YAML that ``accelerate launch`` would read (``--config_file`` or the default one), as a dict."""
    from accelerate.commands.config import default_config_file

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) and not args.cpu
                                else None)
    if path is None:
        return None, {}
    path = Path(path)
    if not path.is_file():
        raise LaunchError(f"--config_file {str(path)!r} does not exist")
    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise LaunchError(f"cannot parse {str(path)!r}: {' '.join(str(error).split())}") from None
    if not isinstance(settings, dict):
        raise LaunchError(f"{str(path)!r} must hold a mapping of Accelerate settings")
    return path, settings


def _config_value(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """The hf_zeropp config as given: ``--zeropp``, the YAML's ``zeropp:``, the DeepSpeed settings, or None (the
    environment). Removes hf_zeropp's and DeepSpeed's settings from ``args`` and ``settings``, and refuses a
    ``distributed_type`` hf_zeropp cannot run under."""
    from_yaml = settings.pop(CONFIG_KEY, None)
    deepspeed = _deepspeed_settings(args, settings)
    for flag, name in (("use_fsdp", "FSDP"), ("use_megatron_lm", "MEGATRON_LM"), ("tpu", "XLA")):
        if getattr(args, flag, False):
            settings["distributed_type"] = name
    kind = str(settings.get("distributed_type", "NO")).upper()
    if kind not in RUNS_ON:
        raise LaunchError(f"distributed_type {kind} conflicts with hf_zeropp, which shards the model itself; use "
                          f"MULTI_GPU (MULTI_CPU on CPUs) and put the ZeRO settings under `zeropp:`")
    for key in ("fsdp_config", "megatron_lm_config"):
        settings.pop(key, None)  # Accelerate ignores them outside FSDP / Megatron-LM
    if args.zeropp is not None:
        return args.zeropp
    if from_yaml is not None and deepspeed is not None:
        raise LaunchError(f"the config file sets both `zeropp:` and DeepSpeed ({deepspeed!r}); keep one of them")
    return from_yaml if from_yaml is not None else deepspeed


def _deepspeed_settings(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """Accelerate's DeepSpeed settings (YAML ``distributed_type: DEEPSPEED`` / ``--use_deepspeed``) as an hf_zeropp
    config value, or None; the launch continues as MULTI_GPU."""
    fields = dict(settings.pop("deepspeed_config", None) or {})
    for name in DEEPSPEED_SETTINGS:
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
            setattr(args, name, None)
    chosen = args.use_deepspeed or str(settings.get("distributed_type", "")).upper() == "DEEPSPEED"
    args.use_deepspeed = False
    if not chosen:
        return None
    settings["distributed_type"] = "MULTI_GPU"
    fields = {k: v for k, v in fields.items() if v is not None and k not in DEEPSPEED_LAUNCH_ONLY}
    for key in ("offload_optimizer_device", "offload_param_device"):
        device = fields.pop(key, None)
        if device is not None and str(device).lower() != "none":
            raise LaunchError(f"deepspeed_config {key}={device!r} (offload) is not supported by hf_zeropp; remove it: "
                              f"hf_zeropp shards parameters, gradients and optimizer states over the ranks instead "
                              f"(stage 3)")
    for key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
        fields.pop(key, None)
    steps = fields.pop("gradient_accumulation_steps", None)
    if steps not in (None, 1, "1", "auto"):
        raise LaunchError(f"deepspeed_config gradient_accumulation_steps={steps} is applied by DeepSpeed's engine; "
                          f"pass it to the script (Accelerator(gradient_accumulation_steps={steps}), Trainer: "
                          f"--gradient_accumulation_steps {steps}) and remove it")
    clipping = fields.pop("gradient_clipping", None)
    if clipping not in (None, "auto"):
        raise LaunchError(f"deepspeed_config gradient_clipping={clipping} is applied by DeepSpeed's engine; clip in "
                          f"the script (accelerator.clip_grad_norm_(params, {clipping}), Trainer: --max_grad_norm "
                          f"{clipping}) and remove it")
    file, stage = fields.pop("deepspeed_config_file", None), fields.pop("zero_stage", None)
    if fields:
        raise LaunchError(f"deepspeed_config {', '.join(sorted(fields))} has no hf_zeropp equivalent; remove it")
    if file is not None:
        if not Path(file).is_file():
            raise LaunchError(f"deepspeed_config_file {file!r} does not exist")
        return str(file)
    return {"zero_optimization": {"stage": int(stage) if stage is not None else 2}}  # Accelerate's default stage


def _resolve(value: Any, args: argparse.Namespace, settings: dict[str, Any]) -> ZeroPPConfig:
    """The config every worker will read (``value`` under the ``ZEROPP_*`` variables), checked against the launch's
    world size and ranks per node when those are known here."""
    with _config_errors_refused():
        base = ZeroPPConfig.coerce(value, argument="zeropp")  # a preset, a file, a dict or JSON text
        config = ZeroPPConfig.from_env({**os.environ, "ZEROPP_CONFIG": json.dumps(base.to_dict())})
        processes = args.num_processes or settings.get("num_processes")
        machines = args.num_machines or settings.get("num_machines") or 1
        if processes and int(processes) > 1:
            Topology.from_config(config, int(processes), local_world_size=max(1, int(processes) // int(machines)))
    return config


@contextlib.contextmanager
def _config_errors_refused() -> Iterator[None]:
    """A config error (bad value, missing file) as a :class:`LaunchError`: its message on one line."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise LaunchError(" ".join(str(error).split())) from None


def _check_script_options(script_args: list[str]) -> None:
    """``--zeropp`` / ``--deepspeed`` given to the script (the Trainer's flags) are checked now, as the Trainer will
    read them, so that a bad one fails once here instead of on every worker."""
    for flag in ("--zeropp", "--deepspeed"):
        for index, arg in enumerate(script_args):
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            elif arg == flag and index + 1 < len(script_args):
                value = script_args[index + 1]
            else:
                continue
            with _config_errors_refused():
                ZeroPPConfig.coerce(value, argument=f"the script's {flag}")


def _runs_on_cpu(args: argparse.Namespace, settings: dict[str, Any]) -> bool:
    """Several processes and no GPU wanted or present."""
    import torch

    processes = args.num_processes or settings.get("num_processes") or 1
    wants_cpu = args.cpu or settings.get("use_cpu") or str(settings.get("distributed_type")).upper() == "MULTI_CPU"
    return int(processes) > 1 and (bool(wants_cpu) or not torch.cuda.is_available())


def _worker_entry(args: argparse.Namespace) -> dict[str, str]:
    """Point ``args`` at ``python -m hf_zeropp.dropin``, and return the environment that starts it as Python starts
    the script: ``python SCRIPT`` searches the script's folder first, ``python -m MODULE`` the working directory."""
    target = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script, args.module = WORKER_MODULE, True
    args.training_script_args = [*target, *args.training_script_args]
    if target[0] == "-m":
        return {}
    restore = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONSAFEPATH")}
    script_folder = str(Path(target[0]).resolve().parent)
    return {"PYTHONSAFEPATH": "1",  # not the working directory (python -m's default) ...
            "PYTHONPATH": os.pathsep.join(filter(None, [script_folder, os.environ.get("PYTHONPATH")])),  # ... this
            RESTORE_ENVIRONMENT: json.dumps(restore)}


def _first_failure(error: Exception) -> str:
    """The traceback of the rank that failed first (torchrun's record of it, written by
    :mod:`hf_zeropp.failure_report`), so that the cause is the last thing on the screen, below every other rank's
    timeouts and torchrun's summary."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"hf-zeropp launch: the workers failed ({type(error).__name__}: {error})"
    # torchrun's own "first failure" compares timestamps in whole seconds; the error files' times are finer
    rank, failure = min(failures.items(), key=lambda item: (_written_at(item[1].error_file), item[0]))
    message, first = failure.message, rank
    if isinstance(message, dict):  # written by hf_zeropp.failure_report: it knows the job's first failure
        first = int(message.get("extraInfo", {}).get("first_failed_rank", rank))
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    cause = str(message).strip() or f"no traceback recorded (signal or exit code {failure.exitcode}); see above"
    where = (f"exit code {failure.exitcode}" if first == rank else
             f"on another machine; here rank {rank} failed after it, exit code {failure.exitcode}")
    return f"hf-zeropp launch: the workers failed; rank {first} failed first ({where}):\n{cause}"


def _written_at(path: str) -> float:
    try:
        return os.stat(path).st_mtime_ns
    except (OSError, TypeError):
        return float("inf")  # no error file: killed by a signal, or a failure after the first


def _run_accelerate(args: argparse.Namespace, environment: dict[str, str]) -> int:
    from accelerate.commands.launch import launch_command

    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        launch_command(args)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except Exception as error:  # a worker failed: torchrun has printed its summary and the workers their tracebacks
        print(_first_failure(error), file=sys.stderr)
        return 1
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0
