"""What ``hf-zeropp launch`` installs in each worker before the user's script runs, and the workers' entry point.

``python -m hf_zeropp.integrations.dropin SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``) installs hf_zeropp, then runs
the script as ``python SCRIPT`` / ``python -m MODULE`` would. Installing changes these stock names, and nothing else:

- ``accelerate.Accelerator`` is :class:`hf_zeropp.Accelerator`, whose config comes from ``ZEROPP_CONFIG`` (the
  launcher puts the resolved config there as JSON);
- every ``transformers.Trainer`` — TRL's trainers and the script's own subclasses included — gets
  :class:`~hf_zeropp.ZeroPPTrainerMixin` in front of its class when it is built, as
  ``class X(ZeroPPTrainerMixin, SFTTrainer)`` would. This is done when the trainer is built, not by replacing the
  name ``Trainer``: TRL's classes may subclass Trainer before any script line runs;
- ``HfArgumentParser`` (and TRL's copy of it) gives every ``TrainingArguments`` class (TRL's configs too) a
  ``--zeropp`` option;
- ``TrainingArguments(deepspeed=...)`` takes the DeepSpeed config as the hf_zeropp config instead of importing
  DeepSpeed (:func:`hf_zeropp.integrations.trainer.take_deepspeed_config`);
- ``accelerate.utils.DummyOptim`` / ``DummyScheduler``, which Accelerate exports only when DeepSpeed is importable,
  are there for scripts written for DeepSpeed configs (hf_zeropp's Accelerator turns them into the config's
  optimizer and scheduler, and shows the launch's DeepSpeed config to the scripts that choose them by reading
  ``accelerator.state.deepspeed_plugin``: :mod:`hf_zeropp.integrations.deepspeed_plugin`);
- ``TrainingArguments(fsdp=..., fsdp_config=...)`` takes the FSDP settings as hf_zeropp options on top of the
  config instead of setting up Accelerate's FSDP plugin (:func:`hf_zeropp.integrations.trainer.take_fsdp_config`);
- with ``--load_in_slices`` only (or FSDP settings with ``cpu_ram_efficient_loading``, from the launch or from
  TrainingArguments): ``PreTrainedModel.from_pretrained`` (so every ``AutoModel*`` class) is
  :func:`hf_zeropp.from_pretrained` once the process group exists: the model is built on the meta device and each
  rank reads its own slices when it is sharded.

Rank 0 says in one line what was installed and the resolved config, and at exit, for each model sharded outside the
Trainer (whose logs carry them), the bytes it sent intra and inter node. ``import hf_zeropp`` replaces none
of these names (in a torchrun worker it only adds :mod:`hf_zeropp.engine.failure_report`'s excepthook); :func:`install`
does, :func:`uninstall` undoes it.

At exit every worker destroys its process group while the interpreter is still whole: gloo's worker threads can
otherwise still hold finished work when Python finalizes, and the process aborts (SIGABRT, "terminate called without
an active exception") after the script has succeeded. Stock scripts that never call ``destroy_process_group`` show
that abort under ``accelerate launch`` too; under the launcher they exit cleanly.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
from typing import Any

import accelerate
import accelerate.accelerator
import accelerate.utils
import accelerate.utils.deepspeed
import torch.distributed as dist

from .._compat.tested_versions import untested_line
from .accelerate_integration import Accelerator
from ..config.config import ZeroPPConfig
from ..config.fsdp_settings import CONFIG_GIVEN_VARIABLE, SETTINGS_VARIABLE, FsdpSettings, remember, remembered
from .launch import LOAD_IN_SLICES, RESTORE_ENVIRONMENT
from ..engine.materialize import load_in_slices
from ..engine.runtime import comm_stats
from ..engine.state import sharded_models, zeropp_state
from ..comm.topology import Topology
from .post_import import after_import, forget_pending

_originals: dict[tuple[Any, str], Any] = {}


_ABSENT = object()  # a name install() adds where the stock module has none (uninstall deletes it again)


def _replace(owner: Any, name: str, value: Any) -> None:
    _originals[(owner, name)] = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)


def installed() -> bool:
    return bool(_originals)


def install(load_in_slices: bool = False) -> None:
    """Make the stock names listed in the module docstring run on hf_zeropp (idempotent).

    The Trainer's, the argument parsers' and ``from_pretrained``'s replacements are made when the script first imports
    their modules (at once where it already has): a script that never imports the Trainer does not pay for importing
    it, about 3 CPU seconds per rank."""
    if installed():
        return
    _replace(accelerate, "Accelerator", Accelerator)
    _replace(accelerate.accelerator, "Accelerator", Accelerator)
    for name in ("DummyOptim", "DummyScheduler"):  # exported by accelerate.utils only when DeepSpeed is importable
        if not hasattr(accelerate.utils, name):
            _replace(accelerate.utils, name, getattr(accelerate.utils.deepspeed, name))
    if load_in_slices:
        after_import("transformers.modeling_utils", lambda module: _install_loading_in_slices())
    after_import("transformers.trainer", _install_in_trainer)
    after_import("transformers.hf_argparser", _install_in_argument_parser)
    after_import("trl.scripts._hf_argparser", _install_in_argument_parser)  # TRL >= 1.0 parses with its own copy
    after_import("transformers.training_args", _install_in_training_arguments)


def _install_in_trainer(module: Any) -> None:
    _replace(module.Trainer, "__init__", _with_mixin_at_init(module.Trainer.__init__))


def _install_in_argument_parser(module: Any) -> None:
    parser_class = module.HfArgumentParser
    if (parser_class, "__init__") not in _originals:  # a module re-exporting transformers' class: changed once
        _replace(parser_class, "__init__", _with_zeropp_fields(parser_class.__init__))


def _install_in_training_arguments(module: Any) -> None:
    arguments = module.TrainingArguments
    _replace(arguments, "__post_init__", _taking_fsdp_config(_taking_deepspeed_config(arguments.__post_init__)))


def uninstall() -> None:
    """Give the stock names their stock values back."""
    forget_pending()
    for (owner, name), value in _originals.items():
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    _originals.clear()


@functools.cache
def _class_with_mixin(trainer_class: type) -> type:
    """``trainer_class`` with the mixin in front, under the same name (what its logs and errors show)."""
    from .trainer import ZeroPPTrainerMixin

    return type(trainer_class.__name__, (ZeroPPTrainerMixin, trainer_class),
                {"__module__": trainer_class.__module__, "__qualname__": trainer_class.__qualname__,
                 "__doc__": trainer_class.__doc__})


def _with_mixin_at_init(stock_init: Any) -> Any:
    @functools.wraps(stock_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from .trainer import ZeroPPTrainerMixin  # at call time: it imports the modules being changed

        if not isinstance(self, ZeroPPTrainerMixin):  # a script that already uses the mixin keeps its class
            self.__class__ = _class_with_mixin(type(self))
        stock_init(self, *args, **kwargs)
    return __init__


def _with_zeropp_fields(stock_init: Any) -> Any:
    @functools.wraps(stock_init)
    def __init__(self, dataclass_types: Any = None, **kwargs: Any) -> None:
        from .trainer import with_zeropp_field

        if dataclass_types is not None:
            types = [dataclass_types] if isinstance(dataclass_types, type) else list(dataclass_types)
            dataclass_types = [with_zeropp_field(t) if _lacks_zeropp_field(t) else t for t in types]
        stock_init(self, dataclass_types, **kwargs)
    return __init__


def _lacks_zeropp_field(dataclass_type: Any) -> bool:
    from transformers import TrainingArguments

    return (isinstance(dataclass_type, type) and issubclass(dataclass_type, TrainingArguments)
            and "zeropp" not in getattr(dataclass_type, "__dataclass_fields__", {}))


def _install_loading_in_slices() -> None:
    from transformers import PreTrainedModel

    if (PreTrainedModel, "from_pretrained") not in _originals:
        _replace(PreTrainedModel, "from_pretrained", _loading_in_slices(PreTrainedModel.__dict__["from_pretrained"]))


def _loading_in_slices(stock: classmethod) -> classmethod:
    load = stock.__func__

    @functools.wraps(load)
    def from_pretrained(cls: type, name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        by_itself = ("device_map" in kwargs or "state_dict" in kwargs or "gguf_file" in kwargs
                     or not isinstance(name_or_path, (str, os.PathLike)))
        if by_itself or not (dist.is_available() and dist.is_initialized()):
            return load(cls, name_or_path, *args, **kwargs)  # placed by the script, or before the process group
        return load_in_slices(cls, functools.partial(load, cls), name_or_path, *args, **kwargs)
    return classmethod(from_pretrained)


def _taking_deepspeed_config(stock_post_init: Any) -> Any:
    @functools.wraps(stock_post_init)
    def __post_init__(self) -> None:
        from .trainer import take_deepspeed_config

        take_deepspeed_config(self)
        stock_post_init(self)
    return __post_init__


def _taking_fsdp_config(stock_post_init: Any) -> Any:
    """TrainingArguments' FSDP settings become hf_zeropp options; where they ask for CPU-RAM-efficient loading, every
    ``from_pretrained`` from then on reads per-rank slices (the script loads its model after parsing its
    arguments)."""
    @functools.wraps(stock_post_init)
    def __post_init__(self) -> None:
        from .trainer import take_fsdp_config

        take_fsdp_config(self)  # a no-op where a ZeroPP TrainingArguments class has taken them already
        stock_post_init(self)
        settings = remembered()
        if settings is not None and settings.load_in_slices:
            _install_loading_in_slices()
    return __post_init__


def describe(config: ZeroPPConfig, topology: Topology, load_in_slices: bool = False,
             fsdp: FsdpSettings | None = None, given: str | None = None) -> str:
    """The one line rank 0 prints at start: what runs on hf_zeropp, the config (and the launch's FSDP settings, on
    ``given``: how the user named the config), and the nodes."""
    techniques = [f"stage {config.stage}"]
    if config.quantized_weights:
        techniques.append(f"qwZ int{config.weight_bits}")
    if topology.hpz_size > 1:
        techniques.append(f"hpZ over {topology.hpz_size} ranks")
    if config.quantized_gradients:
        intra = config.gradient_intra_bits or config.gradient_bits
        techniques.append(f"qgZ int{intra}/int{config.gradient_bits}")
    if config.quantized_nontrainable_weights:
        techniques.append("frozen weights INT8")
    if config.shard_group == "node":
        bits = config.hybrid_gradient_bits
        techniques.append(f"hybrid (sharded in the node; cross-node all-reduce {f'int{bits}' if bits else 'full'})")
    if config.shard_group == "auto":
        techniques.append("auto (zero3, zeropp, hybrid or hybrid-q, INT4 or INT8 gradients, chosen when sharding "
                          "starts)")
    if config.mixed_precision != "no":
        techniques.append(config.mixed_precision)
    return (f"hf_zeropp launch: accelerate.Accelerator, transformers.Trainer (TRL's trainers too) and "
            f"HfArgumentParser (--zeropp, --deepspeed, --fsdp) run on hf_zeropp"
            f"{'; from_pretrained builds on meta, each rank reads its slices' if load_in_slices else ''}; "
            f"config: {', '.join(techniques)}; "
            f"{fsdp.describe(given) + '; ' if fsdp is not None else ''}"
            f"{topology.nodes} node(s) x {topology.node_size} ranks (node size from {topology.node_size_source})")


def bytes_at_exit() -> list[str]:
    """One line per sharded model whose byte counts cover its whole run (nothing reset them; the Trainer resets them
    every step and puts them in its logs instead): what this rank sent, intra and inter node, per collective."""
    lines = []
    for model in sharded_models():
        if zeropp_state(model).meter.resets:
            continue
        stats = comm_stats(model)
        kinds = [kind for kind in stats if kind not in ("total", "implementations", "quantization_error")]
        per_kind = ", ".join(f"{kind} {stats[kind]['intra_node'] / 1e6:.3f}/{stats[kind]['inter_node'] / 1e6:.3f}"
                             for kind in kinds)
        total = stats["total"]
        lines.append(f"hf_zeropp launch: {type(model).__name__}: this rank sent {total['intra_node'] / 1e6:.3f} MB "
                     f"intra-node and {total['inter_node'] / 1e6:.3f} MB inter-node since it was sharded (MB "
                     f"intra/inter per collective: {per_kind})")
    return lines


def _print_bytes_at_exit() -> None:
    for line in bytes_at_exit():
        print(line, flush=True)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Install, put the user's environment back, then run ``SCRIPT ARGS`` or ``-m MODULE ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m hf_zeropp.integrations.dropin SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    for name, value in json.loads(os.environ.pop(RESTORE_ENVIRONMENT, "{}")).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    config = ZeroPPConfig.coerce(None, argument="ZEROPP_CONFIG")
    topology = Topology.from_config(config, int(os.environ.get("WORLD_SIZE", "1")))
    load_in_slices = os.environ.pop(LOAD_IN_SLICES, "") == "1"
    # left in the environment: a Trainer's own fsdp settings are refused beside the launch's (take_fsdp_config)
    fsdp = FsdpSettings.from_json(os.environ[SETTINGS_VARIABLE]) if SETTINGS_VARIABLE in os.environ else None
    if fsdp is not None:
        remember(fsdp)
    install(load_in_slices)
    atexit.register(_destroy_process_group)  # registered first, so it runs after the script's and the byte line's
    if os.environ.get("RANK", "0") == "0":
        print(describe(config, topology, load_in_slices, fsdp, os.environ.get(CONFIG_GIVEN_VARIABLE) or None),
              flush=True)
        if untested_line() is not None:
            print(f"hf_zeropp launch: {untested_line()}", flush=True)
        atexit.register(_print_bytes_at_exit)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()  # a failure's traceback reaches torchrun through hf_zeropp.engine.failure_report (installed on import)
