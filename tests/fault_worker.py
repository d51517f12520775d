"""One rank of a fault-injection run (the rank-failure and exact-resume tests): train the tiny GPT-2 for a range of
steps, checkpoint, resume, and — when asked — die by SIGKILL at a chosen point. Started once per rank by
:mod:`rank_launcher` as a plain process (not through torchrun, whose agent would kill the surviving ranks itself and
hide whether they notice the failure).

Usage: ``python tests/fault_worker.py SPEC.json`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment. The spec::

    {"pg_timeout": 20,                       # seconds, the process group's timeout
     "runs": [{"name": "stage3",             # runs execute one after another in the same processes
               "config": {"stage": 3},       # ZeroPPConfig options
               "root": "/tmp/x/stage3",      # checkpoints go to ROOT/checkpoint-<step>
               "resume": false,              # true: load hf_zeropp.latest_checkpoint(root) and continue from it
               "end": 20,                    # train steps [start, end)
               "save_at": [10],              # save after this many steps
               "kill": {"rank": 2, "step": 15, "where": "forward"},  # optional
               "losses": "/tmp/x/stage3-losses.json"}]}

Kill points (``where``): ``forward`` — inside the forward of the last transformer block of step ``step`` (after
that step's first collectives ran); ``dcp_write`` — while saving the checkpoint after ``step`` steps, right after
this rank's DCP shard file was written and before DCP's metadata exists; ``backward_hang`` — SIGSTOP (not
kill) in the backward of step ``step``, when the gradient reaches the last block: a hung rank. Before dying the rank writes the wall
time to ``<losses>.killed`` so the test can time how long the survivors take to exit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train


def _die(marker: Path) -> None:
    """SIGKILL this process: no exception, no atexit, no flushing — what the OOM killer or a node loss does."""
    marker.write_text(json.dumps({"time": time.time(), "rank": dist.get_rank()}))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _freeze(marker: Path) -> None:
    """SIGSTOP this process: it stays alive, holds its sockets open and never answers — a hung rank (deadlock, stuck
    device), which only the process group's timeout can detect."""
    marker.write_text(json.dumps({"time": time.time(), "rank": dist.get_rank()}))
    os.kill(os.getpid(), signal.SIGSTOP)


def _write_json(path: Path, value) -> None:
    """Atomic write, so the test never reads half a file of a rank that was killed."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _arm_dcp_kill(rank_to_kill: int, marker: Path, should_kill) -> None:
    """Kill ``rank_to_kill`` right after its DCP shard is on disk, before DCP gathers the results and writes
    ``.metadata`` — the middle of a checkpoint save."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        future = original(self, plan, planner)
        future.wait()
        if dist.get_rank() == rank_to_kill and should_kill():
            _die(marker)
        return future

    filesystem._FileSystemWriter.write_data = write_data


def _subgroups_inherit_the_world_timeout() -> None:
    """The topology change proposed by the rank-hang investigation, applied from outside: build hf_zeropp's node and
    hpZ meshes with the world process group's timeout instead of torch's 30-minute default for new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    from hf_zeropp.comm import topology
    from hf_zeropp._compat import process_group_timeout

    def mesh(device_type, shape, names):
        ranks = torch.arange(int(torch.tensor(shape).prod())).view(shape)
        if len(shape) == 1:
            return DeviceMesh(device_type, ranks, mesh_dim_names=names)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = process_group_timeout(dist.group.WORLD, device_type)
        return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=((None, options),) * len(shape))

    topology._mesh = mesh


def run(spec: dict) -> None:
    import hf_zeropp

    rank = dist.get_rank()
    model = tiny_gpt2()
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**spec["config"]))
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    root = Path(spec["root"])
    losses_path = Path(spec["losses"])
    marker = losses_path.with_suffix(".killed")
    start = 0
    record: dict = {"losses": {}, "resumed_from": None}
    if spec.get("resume"):
        latest = hf_zeropp.latest_checkpoint(root)
        meta = hf_zeropp.load_checkpoint(latest, model, optimizer, scheduler)
        start = meta["step"]
        record["resumed_from"] = str(latest)
    kill = spec.get("kill")
    saving_step = {"value": None}
    if kill and kill["where"] == "dcp_write":
        _arm_dcp_kill(kill["rank"], marker, lambda: saving_step["value"] == kill["step"])
    if kill and kill["where"] == "forward" and rank == kill["rank"]:
        current = {"step": None}

        def hook(module, args):
            if current["step"] == kill["step"]:
                _die(marker)

        model.transformer.h[-1].register_forward_pre_hook(hook)
    if kill and kill["where"] == "backward_hang" and rank == kill["rank"]:
        current = {"step": None}

        def freeze_in_backward(module, args, output):
            if current["step"] == kill["step"]:  # runs when the gradient reaches this block's output
                hidden = output[0] if isinstance(output, tuple) else output
                hidden.register_hook(lambda grad: _freeze(marker))

        model.transformer.h[-1].register_forward_hook(freeze_in_backward)
    for step in range(start, spec["end"]):
        if kill and kill["where"] in ("forward", "backward_hang") and rank == kill["rank"]:
            current["step"] = step
        (loss,) = train(model, optimizer, range(step, step + 1))
        scheduler.step()
        record["losses"][step] = loss
        if rank == 0:
            _write_json(losses_path, record)
        if step + 1 in spec.get("save_at", []):
            saving_step["value"] = step + 1
            hf_zeropp.save_checkpoint(root / f"checkpoint-{step + 1}", model, optimizer, scheduler, step=step + 1)
            saving_step["value"] = None


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["pg_timeout"]))
    if spec.get("subgroups_inherit_timeout"):
        _subgroups_inherit_the_world_timeout()
    for run_spec in spec["runs"]:
        run(run_spec)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
