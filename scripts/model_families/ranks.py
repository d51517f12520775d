"""What each rank runs: every family in turn on one process group, stock against a preset.

Per family, every rank builds the tiny model; rank 0 also trains a second copy one AdamW step as stock does on one
process (the loss the mean of the ranks' micro-batch losses, as DDP averages gradients). Then every rank shards its
copy with the preset and takes the same step on its own micro-batch. Rank 0 compares the losses before and after the
step and the gradients, and appends the family's record to the progress file as one JSON line.

A family that hangs or crashes a rank cannot take the sweep with it: a watchdog thread ends the rank once a family
outlives its time, and where the ranks' outcomes differ (one raised inside a collective the other still waits in) they
stop, since the process group may be out of step. The driver (``run.py``) then starts the ranks again on the families
left.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .catalog import NotBuilt, batch, build, loss, tiny_config
from .explained import explain

LR = 1e-3
HF_ZEROPP = str(Path(__import__("hf_zeropp").__file__).parent)
REFUSAL_TYPES = (ValueError, NotImplementedError, RuntimeError, TypeError)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]


def _is_refusal(error: BaseException) -> bool:
    """Raised on purpose by hf_zeropp: the innermost frame is hf_zeropp's own and the type is one it raises."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(HF_ZEROPP) and isinstance(error, REFUSAL_TYPES)


def _optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01)


def _stock(head: str, family: str, config, world: int) -> dict:
    """One process: the mean of every rank's micro-batch loss, its gradients, one AdamW step, the loss again."""
    model = build(head, family, config)
    optimizer = _optimizer(model)
    before = torch.stack([loss(model, batch(head, config, r), r) for r in range(world)]).mean()
    before.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = torch.stack([loss(model, batch(head, config, r), r) for r in range(world)]).mean()
    return {"loss": float(before), "grads": grads, "loss_after": float(after)}


def _mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def sharded_step(head: str, family: str, config, preset: str, node_size: int, observe=None) -> dict:
    """This rank's micro-batch under ``preset``: the mean loss, the full gradients (on rank 0), the loss after.
    ``observe(model)``, if given, is called on the sharded model before its forward."""
    import hf_zeropp
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    config_of_preset = hf_zeropp.ZeroPPConfig.preset(preset, node_size=node_size)
    model = hf_zeropp.shard_model(build(head, family, config), config_of_preset)
    if observe is not None:
        observe(model)
    optimizer = _optimizer(model)
    inputs = batch(head, config, rank)
    value = loss(model, inputs, rank)
    value.backward()
    named = [(name, p.grad) for name, p in model.named_parameters()]
    present = [name for name, grad in named if grad is not None]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, present)
    if any(names != present for names in everyone):
        raise AssertionError(f"ranks hold gradients for different parameters: {[len(n) for n in everyone]}")
    grads = {name: (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
             for name, grad in named if grad is not None}
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = loss(model, inputs, rank)
    stats = hf_zeropp.comm_stats(model)["implementations"]
    return {"loss": _mean(value), "grads": grads if rank == 0 else {}, "loss_after": _mean(after),
            "notes": sorted(stats)}


def _compare(stock: dict, ours: dict, tolerance: dict) -> dict:
    """Relative errors: the losses, the whole gradient (L2) and the worst parameter's gradient, normalised by the
    larger of its own norm and 1 % of the whole gradient's (a near-zero gradient's rounding is not a failure)."""
    names = sorted(stock["grads"])
    missing = [n for n in names if n not in ours["grads"] and bool(stock["grads"][n].any())]
    extra = [n for n in ours["grads"] if n not in stock["grads"]]
    total = torch.cat([stock["grads"][n].reshape(-1) for n in names]).norm() if names else torch.tensor(0.0)
    diffs = {n: float((ours["grads"][n] - stock["grads"][n]).norm()
                      / max(float(stock["grads"][n].norm()), 0.01 * float(total), 1e-12))
             for n in names if n in ours["grads"]}
    whole = (torch.cat([(ours["grads"][n] - stock["grads"][n]).reshape(-1) for n in diffs]).norm()
             / max(float(total), 1e-12)) if diffs else torch.tensor(0.0)
    worst = max(diffs, key=diffs.get) if diffs else None
    errors = {"loss": abs(ours["loss"] - stock["loss"]) / max(abs(stock["loss"]), 1e-12),
              "grad": float(whole), "worst_grad": diffs.get(worst, 0.0),
              "loss_after": abs(ours["loss_after"] - stock["loss_after"]) / max(abs(stock["loss_after"]), 1e-12)}
    problems = [f"{key} {value:.1e} > {tolerance[key]:g}" for key, value in errors.items() if value > tolerance[key]]
    if missing or extra:
        problems.append(f"gradients missing {missing[:3]} / extra {extra[:3]}")
    if problems and worst:
        problems.append(f"worst gradient: {worst}")
    return {"class": "fail" if problems else "pass", "reason": "; ".join(problems), "errors": errors,
            "params": len(names), "worst": worst, "grad_norm": float(total)}


def _agree(status: tuple) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, status)
    return everyone


def one_family(head: str, family: str, preset: str, node_size: int, tolerance: dict) -> tuple[dict, bool]:
    """The family's record (on rank 0) and whether the ranks may go on to the next family together."""
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"head": head, "family": family, "preset": preset}
    stock = None
    try:
        config = tiny_config(head, family)
        if rank == 0:
            stock = _stock(head, family, config, world)
        status = ("ok", "")
    except NotBuilt as error:
        status = ("not-built", str(error))
    except Exception as error:  # stock itself cannot build or train this config: not ours to judge
        status = ("stock-cannot-build", _one_line(error))
    statuses = _agree(status)
    failed = next((s for s in statuses if s[0] != "ok"), None)
    if failed:
        return {**record, "class": failed[0], "reason": failed[1]}, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ours = sharded_step(head, family, config, preset, node_size)
            status = ("ok", "")
        except Exception as error:
            ours = None
            status = ("refused" if _is_refusal(error) else "fail", _one_line(error))
            if status[0] == "fail" and rank == 0:
                traceback.print_exc()
    statuses = _agree(status)
    warned = sorted({" ".join(str(w.message).split())[:200] for w in caught
                     if w.filename.startswith(HF_ZEROPP)})
    record["warnings"] = warned
    if any(s != statuses[0] for s in statuses) or statuses[0][0] != "ok":
        outcome = next(s for s in statuses if s[0] != "ok")
        record.update({"class": outcome[0], "reason": outcome[1]})
        return record, all(s == statuses[0] for s in statuses)
    if rank == 0:
        record.update(_compare(stock, ours, tolerance))
        record["notes"] = ours["notes"]
        if preset != "zero3":  # zero3 is exact: nothing there is explained by quantization
            record = explain(record, tolerance)
    return record, True


def _watchdog(seconds: float, family: str) -> threading.Timer:
    def expire() -> None:
        print(f"model_families: {family} outlived {seconds:.0f} s; ending rank {dist.get_rank()}", file=sys.stderr,
              flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def sweep_ranks(entries: list, preset: str, node_size: int, progress: str, family_timeout: float,
                tolerance: dict) -> None:
    """Every (head, family) of ``entries`` in turn; rank 0 appends ``started`` and then the record for each."""
    import transformers

    transformers.logging.set_verbosity_error()
    rank = dist.get_rank()
    for head, family in entries:
        if rank == 0:
            _append(progress, {"started": [head, family]})
        timer = _watchdog(family_timeout, f"{head}/{family}")
        start = time.monotonic()
        try:
            record, in_step = one_family(head, family, preset, node_size, tolerance)
        finally:
            timer.cancel()
        record["seconds"] = round(time.monotonic() - start, 2)
        if rank == 0:
            _append(progress, {"record": record})
        gc.collect()
        if not in_step:
            return


def _append(path: str, line: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
