"""``hf-zeropp launch``: ``accelerate launch`` for scripts that do not import hf_zeropp.

Accelerate has no extension point for a third-party backend: its ``distributed_type`` is a closed enum and its
launch YAML refuses unknown keys. So this launcher takes every ``accelerate launch`` option (it parses them with
Accelerate's own parser), reads what is hf_zeropp's out of them, and starts ``accelerate launch`` with the rest:

- the ZeRO++ config: ``--zeropp VALUE``, else a top-level ``zeropp:`` key of the Accelerate YAML (removed before
  Accelerate reads the file), else the Accelerate DeepSpeed settings (``distributed_type: DEEPSPEED`` with a
  ``deepspeed_config_file`` or ``zero_stage``; ``--use_deepspeed``), else ``ZEROPP_CONFIG`` / ``ZEROPP_*``; a
  Trainer script's own ``--deepspeed`` / ``--zeropp`` replaces it, as its Trainer will. It is checked here against
  the launch (world size, ranks per node), then handed to the workers as JSON in ``ZEROPP_CONFIG`` (the DeepSpeed
  settings' config also as Accelerate's plugin would hold it: :mod:`hf_zeropp.integrations.deepspeed_plugin`);
- the Accelerate FSDP settings (``distributed_type: FSDP`` with its ``fsdp_config``; ``--use_fsdp`` and the
  ``--fsdp_*`` options) keep their meaning on top of that config (:mod:`hf_zeropp.config.fsdp_settings`: the wrap policy
  gives the units, the resharding the stage, and offload, activation checkpointing and CPU-RAM-efficient loading
  their hf_zeropp counterparts); with no config named, they run as zero3. No ``FSDP_*`` variable reaches a worker;
- each worker runs ``python -m hf_zeropp.integrations.dropin SCRIPT ARGS`` (:mod:`hf_zeropp.integrations.dropin`), which
  installs hf_zeropp in accelerate, transformers and TRL and then runs the script unchanged;
- on a machine without GPUs, several processes take Accelerate's torchrun path with ``ACCELERATE_USE_CPU=true``
  (Accelerate's own CPU path would start one process, or need MPI).

Every refusal (a bad config, a conflicting ``distributed_type``, an unsupported DeepSpeed or FSDP key, a missing script)
is one line on standard error and exit status 2, before any worker starts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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

from ..config.config import ZeroPPConfig
from ..interop.deepspeed.training import check_batch_sizes
from ..engine.failure_report import FRESH_STORE_VARIABLE
from ..config.fsdp_keys import PARALLELISM_CONFIG_REFUSED
from ..config.fsdp_settings import (CONFIG_GIVEN_VARIABLE, SETTINGS_VARIABLE, FsdpSettings, from_accelerate,
                                    from_training_arguments, zeropp_given)
from ..comm.topology import Topology
from .deepspeed_plugin import PLUGIN_VARIABLE

CONFIG_KEY = "zeropp"
WORKER_MODULE = "hf_zeropp.integrations.dropin"
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
# ... and these become the DeepSpeed config through Accelerate's DeepSpeedPlugin (YAML key -> plugin field)
PLUGIN_FIELDS = {"zero_stage": "zero_stage", "offload_optimizer_device": "offload_optimizer_device",
                 "offload_param_device": "offload_param_device",
                 "offload_optimizer_nvme_path": "offload_optimizer_nvme_path",
                 "offload_param_nvme_path": "offload_param_nvme_path",
                 "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "gradient_clipping"}


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
    ``accelerate launch`` with every worker started through :mod:`hf_zeropp.integrations.dropin`."""
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
    fsdp = _fsdp_settings(args, settings)
    given = _config_named(args, settings)
    value, deepspeed = _config_value(args, settings)
    script = _script_config(args.training_script_args, fsdp)
    if script is not None:  # its Trainer takes it in place of the launch's, as under stock Accelerate
        given, value, deepspeed = f"the script's {' '.join(script)}", script[1], None
    config = _resolve(value, args, settings, fsdp, given, script[0] if script is not None else None)
    environment = {"ZEROPP_CONFIG": json.dumps(config.to_dict()), CONFIG_GIVEN_VARIABLE: given or ""}
    if deepspeed is not None:  # what scripts written for Accelerate's DeepSpeed path read (accelerator.state)
        environment[PLUGIN_VARIABLE] = json.dumps(deepspeed)
    if args.load_in_slices or (fsdp is not None and fsdp.load_in_slices):
        environment[LOAD_IN_SLICES] = "1"
    if fsdp is not None:
        environment[SETTINGS_VARIABLE] = fsdp.to_json()
    _check_script_fsdp(args.training_script_args)
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
    if fsdp is not None and int(args.machine_rank or settings.get("machine_rank") or 0) == 0:
        for setting, why in fsdp.warnings.items():  # once, from the first machine's launcher, as the launch goes on
            print(f"hf-zeropp launch: warning: {setting} in {fsdp.where}: {why}", file=sys.stderr)
    return environment


def _restart_environment(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, str]:
    """``--max_restarts``: restarted workers come back only through the c10d rendezvous with a fresh store per round
    (:mod:`hf_zeropp.engine.failure_report`), so the static rendezvous is refused and the fresh store is asked for."""
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


def _config_value(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """The hf_zeropp config as given: ``--zeropp``, the YAML's ``zeropp:``, the DeepSpeed settings, or None (the
    environment); and the DeepSpeed config where it is the DeepSpeed settings' (else None). Removes hf_zeropp's and
    DeepSpeed's settings from ``args`` and ``settings``, and refuses a ``distributed_type`` hf_zeropp cannot run
    under."""
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
        return args.zeropp, None
    if from_yaml is not None and deepspeed is not None:
        raise LaunchError(f"the config file sets both `zeropp:` and DeepSpeed ({deepspeed!r}); keep one of them")
    return (from_yaml, None) if from_yaml is not None else (deepspeed, deepspeed)


def _deepspeed_settings(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """Accelerate's DeepSpeed settings (YAML ``distributed_type: DEEPSPEED`` / ``--use_deepspeed``) as the DeepSpeed
    config Accelerate's workers would train with, or None; the launch continues as MULTI_GPU. The config is what
    Accelerate's own ``DeepSpeedPlugin`` makes of them (the YAML's accumulation steps, clipping, stage and offload
    fill the file's "auto" values, or make the config when there is no file), so it means what it means under
    DeepSpeed."""
    from accelerate.utils import DeepSpeedPlugin

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
    file = fields.pop("deepspeed_config_file", None)
    if file is not None and not Path(file).is_file():
        raise LaunchError(f"deepspeed_config_file {file!r} does not exist")
    unknown = set(fields) - set(PLUGIN_FIELDS)
    if unknown:
        raise LaunchError(f"deepspeed_config {', '.join(sorted(unknown))} has no hf_zeropp equivalent; remove it")
    plugin_fields = {PLUGIN_FIELDS[k]: v for k, v in fields.items()}
    for name in ("gradient_accumulation_steps", "gradient_clipping"):
        if name in plugin_fields and plugin_fields[name] != "auto":
            plugin_fields[name] = (int if name == "gradient_accumulation_steps" else float)(plugin_fields[name])
    with _config_errors_refused():
        if file is not None:
            written = json.loads(Path(file).read_text()) if not str(file).endswith((".yaml", ".yml")) else \
                yaml.safe_load(Path(file).read_text())
            plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(written), **plugin_fields)
        else:
            written = {}
            plugin = DeepSpeedPlugin(**plugin_fields)
    config = plugin.deepspeed_config
    if "steps_per_print" not in written:
        config.pop("steps_per_print", None)  # Accelerate's own addition, to silence DeepSpeed's logging
    return config


def _fsdp_settings(args: argparse.Namespace, settings: dict[str, Any]) -> FsdpSettings | None:
    """Accelerate's FSDP settings (YAML ``distributed_type: FSDP`` with its ``fsdp_config``, or ``--use_fsdp``, with
    the ``--fsdp_*`` options given on top, as Accelerate reads them) as hf_zeropp options, or None. They are taken
    out of ``args`` and ``settings``: the launch continues as MULTI_GPU, so no ``ACCELERATE_USE_FSDP`` / ``FSDP_*``
    variable reaches a worker (transformers would load models on the meta device, Accelerate would wrap in FSDP)."""
    fsdp_config = dict(settings.pop("fsdp_config", None) or {})
    fsdp_config.update({name: getattr(args, name) for name in sorted(getattr(args, "nondefault", ()))
                        if name.startswith("fsdp_")})
    other_flags = [f"--{flag}" for flag in ("use_deepspeed", "use_megatron_lm", "multi_gpu", "tpu")
                   if getattr(args, flag)]
    if args.use_fsdp and other_flags:
        raise LaunchError(f"--use_fsdp and {other_flags[0]} are both given; keep one (accelerate launch takes one)")
    in_yaml = str(settings.get("distributed_type", "")).upper() == "FSDP"
    chosen = args.use_fsdp or (in_yaml and not other_flags)
    args.use_fsdp = False
    if chosen or in_yaml:  # FSDP's settings become hf_zeropp's, or another type flag overrides the YAML's
        settings["distributed_type"] = "MULTI_GPU"
    if not chosen:
        return None
    parallelism = settings.pop("parallelism_config", None)
    if parallelism or getattr(args, "use_parallelism_config", False):
        raise LaunchError(f"parallelism_config: {PARALLELISM_CONFIG_REFUSED}")
    with _config_errors_refused():
        return from_accelerate(fsdp_config, args.mixed_precision or settings.get("mixed_precision"))


def _config_named(args: argparse.Namespace, settings: dict[str, Any]) -> str | None:
    """How the user named the hf_zeropp config, for messages that set it against the FSDP settings: ``--zeropp``,
    the YAML's ``zeropp:``, Accelerate's DeepSpeed settings, the environment, or None (nothing: zero3)."""
    if args.zeropp is not None:
        return f"--zeropp {args.zeropp}"
    if settings.get(CONFIG_KEY) is not None:
        return f"`zeropp: {json.dumps(settings[CONFIG_KEY])}` in the Accelerate config"
    if args.use_deepspeed or str(settings.get("distributed_type", "")).upper() == "DEEPSPEED":
        return "the Accelerate config's DeepSpeed settings"
    return zeropp_given(os.environ)


def _resolve(value: Any, args: argparse.Namespace, settings: dict[str, Any], fsdp: FsdpSettings | None = None,
             given: str | None = None, script_flag: str | None = None) -> ZeroPPConfig:
    """The config every worker will read (``value`` under the ``ZEROPP_*`` variables, with the FSDP settings on top
    where the launch has them; ``given`` says how the user named the config), checked against the launch's world
    size and ranks per node when those are known here. With ``script_flag`` the value is the script's own, which its
    Trainer reads as it is (``ZeroPPConfig.coerce``: no ``ZEROPP_*`` option on top)."""
    with _config_errors_refused():
        # a preset, a file, a dict or JSON text
        base = ZeroPPConfig.coerce(value, argument=f"the script's {script_flag}" if script_flag else "zeropp")
        config = base if script_flag else ZeroPPConfig.from_env({**os.environ,
                                                                 "ZEROPP_CONFIG": json.dumps(base.to_dict())})
        if fsdp is not None:
            config = fsdp.apply(config, given)
        processes = args.num_processes or settings.get("num_processes")
        machines = args.num_machines or settings.get("num_machines") or 1
        if processes and int(processes) > 1:
            Topology.from_config(config, int(processes), local_world_size=max(1, int(processes) // int(machines)))
        if processes and config.deepspeed_training is not None:
            check_batch_sizes(config.deepspeed_training, int(processes))
    return config


@contextlib.contextmanager
def _config_errors_refused() -> Iterator[None]:
    """A config error (bad value, missing file) as a :class:`LaunchError`: its message on one line."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise LaunchError(" ".join(str(error).split())) from None


def _script_config(script_args: list[str], fsdp: FsdpSettings | None) -> tuple[str, str] | None:
    """The config the script's own ``--deepspeed`` / ``--zeropp`` (the Trainer's flags, ``--flag VALUE`` or
    ``--flag=VALUE``) names, as ``(flag, value)``, or None: its Trainer trains with it in place of the launch's, so
    it is the config the start line describes and the launch is checked against, here, once, instead of failing on
    every worker. Refuses what the Trainer would (both flags) and a ``ZEROPP_*`` option or FSDP settings of the
    launch, which that Trainer would silently not apply."""
    named = []
    for index, arg in enumerate(script_args):
        for flag in ("--deepspeed", "--zeropp"):
            if arg.startswith(flag + "="):
                named.append((flag, arg.split("=", 1)[1]))
            elif arg == flag and index + 1 < len(script_args):
                named.append((flag, script_args[index + 1]))
    if not named:
        return None
    if len({flag for flag, _ in named}) > 1:
        raise LaunchError("the script is given both --deepspeed and --zeropp; its Trainer takes one config: drop "
                          "--deepspeed, or pass the DeepSpeed file as --zeropp")
    flag, value = named[-1]  # argparse keeps the last
    if fsdp is not None:
        raise LaunchError(f"the Accelerate config's FSDP settings and the script's {flag} {value} both configure the "
                          f"sharding, and its Trainer would take only the script's; keep one of them")
    options = sorted(name for name in os.environ if name.startswith("ZEROPP_")
                     and name not in ("ZEROPP_CONFIG", "ZEROPP_NODE_SIZE"))
    if options:
        raise LaunchError(f"{', '.join(options)} set in the environment would not apply: the script's {flag} {value} "
                          f"is the config its Trainer takes as it is; put the option in that config, or unset it")
    return flag, value


def _check_script_fsdp(script_args: list[str]) -> None:
    """The script's ``--fsdp`` / ``--fsdp_config`` (the Trainer's flags) are read now, as
    :func:`hf_zeropp.integrations.trainer.take_fsdp_config` will read them, so that an FSDP setting hf_zeropp refuses
    fails once here instead of on every worker."""
    values: dict[str, Any] = {}
    for index, arg in enumerate(script_args):
        for flag in ("--fsdp", "--fsdp_config"):
            if arg.startswith(flag + "="):
                values[flag] = arg.split("=", 1)[1]
            elif arg == flag:
                following = script_args[index + 1] if index + 1 < len(script_args) else "--"
                values[flag] = True if flag == "--fsdp" and following.startswith("--") else following
    if values.get("--fsdp"):
        with _config_errors_refused():
            from_training_arguments(values["--fsdp"], values.get("--fsdp_config"))


def _runs_on_cpu(args: argparse.Namespace, settings: dict[str, Any]) -> bool:
    """Several processes and no GPU wanted or present."""
    import torch

    processes = args.num_processes or settings.get("num_processes") or 1
    wants_cpu = args.cpu or settings.get("use_cpu") or str(settings.get("distributed_type")).upper() == "MULTI_CPU"
    return int(processes) > 1 and (bool(wants_cpu) or not torch.cuda.is_available())


def _worker_entry(args: argparse.Namespace) -> dict[str, str]:
    """Point ``args`` at ``python -m hf_zeropp.integrations.dropin``, and return the environment that starts it as
    Python starts the script: ``python SCRIPT`` searches the script's folder first, ``python -m MODULE`` the working
    directory."""
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
    :mod:`hf_zeropp.engine.failure_report`), so that the cause is the last thing on the screen, below every other rank's
    timeouts and torchrun's summary."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"hf-zeropp launch: the workers failed ({type(error).__name__}: {error})"
    # torchrun's own "first failure" compares timestamps in whole seconds; the error files' times are finer
    rank, failure = min(failures.items(), key=lambda item: (_written_at(item[1].error_file), item[0]))
    message, first = failure.message, rank
    if isinstance(message, dict):  # written by hf_zeropp.engine.failure_report: it knows the job's first failure
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
