"""How many ranks share a node: from the launcher's environment, else from the ranks' host names.

ZeRO++'s hpZ and qgZ depend on it: with the wrong node size a "node-local" gather crosses the slow link, or a
cluster is treated as one node and the 2-hop qgZ collapses into one world-wide hop. torchrun and accelerate set
``LOCAL_WORLD_SIZE``; SLURM, Open MPI, MPICH/Intel MPI and MVAPICH set their own variables; a custom launcher may
set none, and then the ranks' host names tell (one all-gather of a short string at ``shard_model``).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

import torch.distributed as dist

# (variable, launcher) in order of precedence; each holds the number of ranks on this rank's node
LOCAL_SIZE_VARIABLES = (
    ("LOCAL_WORLD_SIZE", "torchrun / accelerate launch"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALNRANKS", "MPICH / Intel MPI"),
    ("MV2_COMM_WORLD_LOCAL_SIZE", "MVAPICH"),
    ("SLURM_NTASKS_PER_NODE", "SLURM"),
)


def node_size_from_environment(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """(ranks per node, where it was read) from a launcher's variables, or None if no launcher set one."""
    environ = os.environ if environ is None else environ
    for variable, launcher in LOCAL_SIZE_VARIABLES:
        value = environ.get(variable, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{variable}={value!r} (set by {launcher}) is not a positive number of ranks per "
                                 f"node; fix the launch or set hf_zeropp's node_size")
            return int(value), f"{variable} ({launcher})"
    tasks = environ.get("SLURM_TASKS_PER_NODE", "").strip()  # e.g. "4(x2)" or "4,4" or "4(x2),3"
    if tasks:
        counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", tasks)}
        if len(counts) != 1:
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks!r}: nodes run different numbers of ranks, which hpZ and "
                             f"qgZ cannot split into equal nodes; launch the same number of tasks on every node")
        return counts.pop(), "SLURM_TASKS_PER_NODE (SLURM)"
    return None


def node_size_from_hostnames() -> tuple[int, str]:
    """(ranks per node, "host names") from every rank's host name (collective). Ranks must be numbered node by node
    (rank = node * node_size + local rank), as every common launcher numbers them by default."""
    hostnames: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hostnames, socket.gethostname())
    runs = []  # consecutive ranks on the same host
    for name in hostnames:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    sizes = {count for _, count in runs}
    if len({name for name, _ in runs}) != len(runs) or len(sizes) != 1:
        layout = ", ".join(f"{name} x{count}" for name, count in runs)
        raise ValueError(f"ranks are not numbered node by node with the same count per node (host of each rank run: "
                         f"{layout}); launch with block placement (SLURM --distribution=block, mpirun --map-by "
                         f"node:PE=1 --rank-by slot) or set hf_zeropp's node_size")
    return sizes.pop(), f"host names ({len(runs)} host(s))"


def detect_node_size(world_size: int) -> tuple[int, str]:
    """(ranks per node, how it was found): launcher variables first, then the ranks' host names."""
    found = node_size_from_environment()
    if found is not None:
        return found
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        return node_size_from_hostnames()
    return world_size, "a single process"
