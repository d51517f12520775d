"""The ``hf-zeropp`` command (also ``python -m hf_zeropp``).

- ``hf-zeropp launch [accelerate launch options] [--zeropp CONFIG] SCRIPT [ARGS]``: run a script that does not
  import hf_zeropp with ZeRO++ (:mod:`hf_zeropp.integrations.launch`).
- ``hf-zeropp env [--zeropp CONFIG] [--world N --node-size D]``: versions, kernel backends, the config and the
  topology this launch would get — everything a bug report needs, without starting any process group.
- ``hf-zeropp from-deepspeed SOURCE OUTPUT`` / ``hf-zeropp to-deepspeed SOURCE OUTPUT``: a DeepSpeed checkpoint into
  an hf_zeropp one, and an hf_zeropp checkpoint into DeepSpeed's universal format
  (:mod:`hf_zeropp.checkpoint.deepspeed_convert`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import torch


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def env(zeropp: str | None, world: int | None, node_size: int | None) -> int:
    from . import __version__, kernels
    from ._compat.tested_versions import LOCK, WATCHED, untested_line
    from .config.config import ZeroPPConfig
    from .comm.topology import Topology

    print(f"hf_zeropp {__version__}, Python {platform.python_version()} on {platform.platform()}")
    for package in WATCHED:
        print(f"  {package:<15} {_version(package)}")
    print(untested_line() or f"versions: none newer than the tested ones ({LOCK.name})")
    print(f"  CUDA            {torch.version.cuda or 'none'} (GPUs visible: {torch.cuda.device_count()})")
    print("kernel backends:")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        backend = kernels.active_backend(device)
        failure = kernels._build.failure(
            kernels._build.CPU_EXTENSION if device == "cpu" else kernels._build.CUDA_EXTENSION)
        print(f"  {device}: {backend}" + (f" (compiled backend failed: {failure.splitlines()[0]})" if failure else ""))
    config = ZeroPPConfig.coerce(zeropp, argument="--zeropp")
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    print("config:", {k: v for k, v in config.to_dict().items() if v not in (None, False)})
    try:
        # no process group: the node size comes from the config, --node-size or the launcher's variables
        topology = Topology.from_config(config, world, local_world_size=node_size)
        labels = {"given": "--node-size"}
        if world > 1:
            labels["a single process"] = "no launcher variable: one node assumed"
        source = labels.get(topology.node_size_source, topology.node_size_source)
        print(f"topology: world {topology.world_size} = {topology.nodes} node(s) x {topology.node_size} ranks "
              f"(node size from {source}); hpZ group size {topology.hpz_size}")
    except ValueError as error:
        print(f"topology: INVALID for world {world}: {error}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # every other argument is accelerate launch's or the script's
        from .integrations.launch import launch

        return launch(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-zeropp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", add_help=False, help="accelerate launch with hf_zeropp installed in every worker "
                                                  "(see `hf-zeropp launch --help`)")
    env_parser = sub.add_parser("env", help="print versions, kernel backends, config and topology")
    env_parser.add_argument("--zeropp", default=None, help="preset, config file or JSON dict (default: ZEROPP_* environment)")
    env_parser.add_argument("--world", type=int, default=None, help="world size (default: WORLD_SIZE or 1)")
    env_parser.add_argument("--node-size", type=int, default=None, help="ranks per node (default: the launcher's, e.g. LOCAL_WORLD_SIZE)")
    from_ds = sub.add_parser("from-deepspeed", help="convert a DeepSpeed checkpoint (ZeRO-1/2/3 or universal; a Trainer "
                                                    "checkpoint-N folder too) into an hf_zeropp checkpoint")
    from_ds.add_argument("source", help="a save_checkpoint folder (with 'latest'), a tag folder, or checkpoint-N")
    from_ds.add_argument("output", help="the hf_zeropp checkpoint folder to write")
    from_ds.add_argument("--tag", default=None, help="the DeepSpeed tag to read (default: the one 'latest' names)")
    to_ds = sub.add_parser("to-deepspeed", help="export an hf_zeropp checkpoint as a DeepSpeed universal checkpoint "
                                                "(resume it with \"checkpoint\": {\"load_universal\": true})")
    to_ds.add_argument("source", help="an hf_zeropp checkpoint folder, or a Trainer checkpoint-N folder")
    to_ds.add_argument("output", help="the folder to write global_step<N>/ and latest_universal into")
    args = parser.parse_args(argv)
    if args.command in ("from-deepspeed", "to-deepspeed"):
        from .checkpoint.deepspeed_convert import convert_deepspeed_checkpoint, export_deepspeed_universal

        try:
            written = (convert_deepspeed_checkpoint(args.source, args.output, tag=args.tag)
                       if args.command == "from-deepspeed" else export_deepspeed_universal(args.source, args.output))
        except (ValueError, FileNotFoundError) as error:  # a bad checkpoint: one line naming the file, no traceback
            print(f"hf-zeropp {args.command}: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {written}")
        return 0
    return env(args.zeropp, args.world, args.node_size)


if __name__ == "__main__":
    sys.exit(main())
