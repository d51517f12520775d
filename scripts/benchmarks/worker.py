"""The per-rank worker, on every rank under torchrun inside the emulated cluster (``-m scripts.benchmarks.cluster --worker``).

Builds every configuration side by side (same GPT-2 from config, same seed), then: a gloo probe of each collective
alone between veth counter reads (``--probe-mb``), ``--warmup`` steps each, ``--rounds`` rounds of ``--steps``
steps per configuration (order rotating every round; the step times, the veth counters around each window and the
hf_zeropp meter per window are kept), and ``--breakdown-steps`` extra steps per hf_zeropp configuration under
``torch.profiler`` (see :mod:`benchmarks.breakdown`). Rank 0 writes everything, per rank, to ``--result``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

import hf_zeropp
from hf_zeropp.comm.comm_meter import all_gather_single, reduce_scatter_single
from hf_zeropp._compat import fsdp_param_groups, group_parameters, group_reshards_after_forward

from . import breakdown
from .compiled import compile_if_asked, eager_and_compiled, run_name
from .configs import CONFIGS, DEEPSPEED, HF_TWINS, ON_REQUEST
from .wire import KINDS, counter_delta, read_counters, wire_factors


def _probe(node_size: int, megabytes: float) -> dict:
    """Each collective alone between counter reads: measured node wire bytes per logical byte."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // node_size
    inter_groups = [dist.new_group([n * node_size + l for n in range(nodes)]) for l in range(node_size)]
    inter = inter_groups[rank % node_size]
    nbytes = int(megabytes * 1e6) // (4 * world) * 4 * world  # full buffer, divisible into world fp32 chunks
    n = nbytes // 4
    d, g = node_size, world
    logical_node = {  # logical inter-node bytes per node (meter rule) for each probe
        "all_gather (world)": d * (g - d) / g * nbytes,
        "reduce_scatter (world)": d * (g - d) / g * nbytes,
        "reduce_scatter (world, hf_zeropp)": d * (g - d) / g * nbytes,
        "all_reduce (world)": 2 * d * (g - d) / g * nbytes,
        "all_to_all (world)": d * (g - d) / g * nbytes,
        "all_to_all (one rank per node)": d * (nodes - 1) / nodes * nbytes,
    }
    x = torch.ones(n)
    ops = {
        "all_gather (world)": lambda: all_gather_single(torch.empty(n), x[: n // g], None),
        "reduce_scatter (world)": lambda: dist.reduce_scatter_tensor(torch.empty(n // g), x),
        "reduce_scatter (world, hf_zeropp)": lambda: reduce_scatter_single(torch.empty(n // g), x, None,
                                                                            dist.ReduceOp.SUM, ranks_per_node=d),
        "all_reduce (world)": lambda: dist.all_reduce(x.clone()),
        "all_to_all (world)": lambda: dist.all_to_all_single(torch.empty(n), x),
        "all_to_all (one rank per node)": lambda: dist.all_to_all_single(torch.empty(n), x, group=inter),
    }
    factors = wire_factors(g, d)
    rule = {"all_gather (world)": factors["fwd_allgather"], "reduce_scatter (world)": factors["torch_reduce_scatter"],
            "reduce_scatter (world, hf_zeropp)": factors["grad_reduce_scatter"],
            "all_reduce (world)": factors["grad_allreduce"], "all_to_all (world)": 1.0,
            "all_to_all (one rank per node)": 1.0}
    result = {}
    for name, op in [("barriers only", lambda: None), *ops.items()]:
        dist.barrier()
        before = read_counters()
        dist.barrier()
        op()
        dist.barrier()
        after = read_counters()
        deltas = [None] * world
        dist.all_gather_object(deltas, counter_delta(before, after))
        node_payload = [deltas[nd * node_size]["tx_payload_bytes"] if deltas[nd * node_size] else None
                        for nd in range(nodes)]
        entry = {"node_tx_payload_bytes": node_payload}
        if name in logical_node:
            entry.update(logical_node_bytes=logical_node[name], rule_factor=rule[name],
                         measured_factor=[p / logical_node[name] if p is not None else None for p in node_payload])
        result[name] = entry
    result["buffer_bytes"] = nbytes
    return result


def _build(name: str, options: dict | None, args, node_size: int):
    """One configuration's model (same weights for all: seed 0) and AdamW; the kernel backend (``"ZeRO++ ref"``:
    the reference) is the config's own ``kernel_backend``, so configurations sharing this process do not touch
    each other's kernels."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.n_embd,
                                       n_layer=args.n_layer, n_head=args.n_head, bos_token_id=0, eos_token_id=0,
                                       tie_word_embeddings=not args.untied))
    params = sum(p.numel() for p in model.parameters())
    backend = None
    if name in DEEPSPEED:
        return {"name": name, "model": _deepspeed_engine(model, DEEPSPEED[name], args, node_size), "optimizer": None,
                "backend": None, "params": params, "metered": False, "times": [], "windows": [], "stats": None}
    if name in HF_TWINS:  # DeepSpeed's zero_optimization dict, read by hf_zeropp as a DeepSpeed config
        config = hf_zeropp.ZeroPPConfig.from_deepspeed(_deepspeed_config(HF_TWINS[name], args, node_size))
        hf_zeropp.shard_model(model, dataclasses.replace(config, reduce_dtype=args.precision))
        return {"name": name, "model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
                "backend": None, "params": params, "metered": True, "times": [], "windows": [], "stats": None}
    if options is None:  # the peer: stock FSDP2 FULL_SHARD, same units and precision, torch's own collectives
        dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        options = dict(options)
        preset = options.pop("preset", None)
        backend = options.pop("kernel_backend", None)  # None: the compiled kernels for the device, else reference
        settings = {"mixed_precision": args.precision if args.precision != "fp32" else "no",
                    "reduce_dtype": args.precision, "kernel_backend": backend, **options}
        config = (hf_zeropp.ZeroPPConfig.preset(preset, **settings) if preset
                  else hf_zeropp.ZeroPPConfig(**settings))
        hf_zeropp.shard_model(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {"name": name, "model": model, "optimizer": optimizer, "backend": backend, "params": params,
            "metered": options is not None, "times": [], "windows": [], "stats": None}


def _deepspeed_engine(model, zero: dict, args, node_size: int):
    """DeepSpeed's engine around ``model``: its ZeRO stage 3 with ``zero`` and the same precision (bf16 weights and
    gradient reduction, fp32 master weights) and optimizer (torch's AdamW, lr 1e-4) as the other configurations."""
    import deepspeed

    config = {**_deepspeed_config(zero, args, node_size), "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    return engine


def _deepspeed_config(zero: dict, args, node_size: int) -> dict:
    """The DeepSpeed config of a DeepSpeed row and of its ``hf `` twin: ``zero`` (``"node"``: the ranks per node),
    the batch and the precision."""
    zero = {key: node_size if value == "node" else value for key, value in zero.items()}
    return {"train_micro_batch_size_per_gpu": args.batch_per_rank, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": args.precision == "bf16"}, "zero_optimization": zero}


def _runs(name: str, options: dict | None, args, node_size: int, step) -> tuple[dict | None, str | None]:
    """The configuration built and one step run, or why it cannot run here: DeepSpeed's quantized collectives have
    no CPU implementation and raise, at initialization (qwZ) or in the first backward (qgZ), on every rank alike."""
    if name not in DEEPSPEED:
        return _build(name, options, args, node_size), None
    try:
        entry = _build(name, options, args, node_size)
        step(entry)
        return entry, None
    except ValueError as error:
        return None, f"{type(error).__name__}: {error}"


def _fsdp_logical_per_step(model, world: int, node_size: int, param_bytes: int, reduce_bytes: int,
                           reduce_kind: str) -> dict:
    """Logical inter-node bytes this rank sends per step under the meter's rule, derived from FSDP2's own unit
    layout (for the stock peer, which has no meter): per unit, the forward all-gather of its padded shards, the
    backward all-gather again unless the unit keeps its weights after forward (FSDP2's root does by default),
    and the reduce-scatter whose chunk is the padded shard, as ``reduce_kind`` (torch's or hf_zeropp's: their
    wire factors on gloo differ)."""
    inter_peers = world - node_size
    out = {kind: {"intra_node": 0, "inter_node": 0, "calls": 0}
           for kind in ("fwd_allgather", "bwd_allgather", reduce_kind)}
    intra_peers = node_size - 1
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            numel = sum(padded for _, padded in group_parameters(group))
            kinds = [("fwd_allgather", param_bytes), (reduce_kind, reduce_bytes)]
            if group_reshards_after_forward(group):
                kinds.append(("bwd_allgather", param_bytes))
            for kind, size in kinds:
                out[kind]["inter_node"] += numel * size * inter_peers
                out[kind]["intra_node"] += numel * size * intra_peers
                out[kind]["calls"] += 1
    return out


def _step(entry, ids) -> None:
    if entry["optimizer"] is None:  # a DeepSpeed engine: its own backward and step
        engine = entry["model"]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        return
    with torch.profiler.record_function(breakdown.FORWARD_RANGE):
        loss = entry["model"](input_ids=ids, labels=ids).loss
    with torch.profiler.record_function(breakdown.BACKWARD_RANGE):
        loss.backward()
    entry["optimizer"].step()
    entry["optimizer"].zero_grad(set_to_none=True)


def _accumulate(total: dict | None, stats: dict) -> dict:
    total = total or {}
    for kind in KINDS:
        if kind in stats:
            slot = total.setdefault(kind, {"intra_node": 0, "inter_node": 0, "calls": 0})
            for key in slot:
                slot[key] += stats[kind][key]
    if "implementations" in stats:
        total["implementations"] = stats["implementations"]
    return total


def worker(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def say(text: str) -> None:
        if rank == 0:
            print(f"[bench {os.environ.get('ZPP_CLUSTER_LINK', '?')}] {text}", flush=True)

    probe = _probe(node_size, args.probe_mb) if args.probe_mb > 0 else None
    generator = torch.Generator().manual_seed(1234 + rank)

    def batch():
        return torch.randint(0, args.vocab, (args.batch_per_rank, args.seq_len), generator=generator)

    entries, not_run = [], {}
    for name, backend in eager_and_compiled([n for n in args.configs.split(",") if n], args.compile):
        options = {**CONFIGS, **ON_REQUEST, **HF_TWINS}.get(name)
        if backend is not None and (options is None or name in DEEPSPEED):
            not_run[run_name(name, backend)] = "--compile compiles hf_zeropp's configurations (compile_units)"
            continue
        entry, reason = _runs(name, options, args, node_size, lambda entry: _step(entry, batch()))
        if entry is None:
            not_run[name] = reason
            say(f"{name} does not run here: {reason}")
        else:
            entry["name"] = run_name(name, backend)
            compile_if_asked(entry["model"], backend)
            entries.append(entry)
    names = [entry["name"] for entry in entries]
    say(f"GPT-2 {entries[0]['params'] / 1e6:.2f}M params, {world} ranks ({world // node_size} nodes x {node_size}), "
        f"{args.batch_per_rank} x {args.seq_len} tokens per rank; configs: {', '.join(names)}")

    for entry in entries:  # warm-up (lazy init, allocator, kernel JIT load; a compiled run's compile)
        start = time.perf_counter()
        for index in range(args.warmup):
            _step(entry, batch())
            if index == 0:
                entry["first_step"] = time.perf_counter() - start
        say(f"warm-up {entry['name']}: {(time.perf_counter() - start) / max(args.warmup, 1):.2f} s/step, first "
            f"step {entry.get('first_step', 0):.1f} s")
    for entry in entries:
        if entry["metered"]:
            hf_zeropp.comm_stats(entry["model"], reset=True)

    for rnd in range(args.rounds):
        shift = rnd % len(entries)
        for entry in entries[shift:] + entries[:shift]:
            dist.barrier()
            before = read_counters()
            dist.barrier()
            window_start = time.perf_counter()
            for _ in range(args.steps):
                ids = batch()
                start = time.perf_counter()
                _step(entry, ids)
                entry["times"].append(time.perf_counter() - start)
            dist.barrier()
            window = time.perf_counter() - window_start
            after = read_counters()
            entry["windows"].append({"seconds": window, "steps": args.steps, "counters": counter_delta(before, after)})
            if entry["metered"]:
                entry["stats"] = _accumulate(entry["stats"], hf_zeropp.comm_stats(entry["model"], reset=True))
        say(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{e['name']} {statistics.median(e['times'][-args.steps:]):.2f}s" for e in entries))

    for entry in entries:  # where the time goes in the quantized configurations (not part of the timing above)
        if args.breakdown_steps <= 0 or not entry["metered"]:
            continue
        n = args.breakdown_steps
        wall = []

        def profiled(entry=entry, wall=wall) -> None:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                _step(entry, batch())
            wall.append(time.perf_counter() - start)

        events = breakdown.profile_steps(profiled)
        sections = breakdown.attribute(events)
        entry["breakdown_phases"] = {k: v / n for k, v in breakdown.phases(events).items()}
        entry["breakdown"] = {"step": wall[0] / n, **{k: v / n for k, v in sections["seconds"].items()}}
        entry["breakdown_kernels"] = {k: v / n for k, v in sections["kernels"].items()}
        entry["breakdown_events"] = {k: v / n for k, v in sections["events"].items()}
        if entry["metered"]:
            hf_zeropp.comm_stats(entry["model"], reset=True)

    itemsize = 2 if args.precision == "bf16" else 4
    for entry in entries:
        if entry["name"] in ("FSDP2", "ZeRO-3"):  # ZeRO-3's derivation is checked against its meter
            reduce_kind = "torch_reduce_scatter" if entry["name"] == "FSDP2" else "grad_reduce_scatter"
            per_step = _fsdp_logical_per_step(entry["model"], world, node_size, itemsize, itemsize, reduce_kind)
            steps = sum(w["steps"] for w in entry["windows"])
            entry["derived_stats"] = {k: {kk: vv * steps for kk, vv in v.items()} for k, v in per_step.items()}
    mine = {e["name"]: {"times": e["times"], "windows": e["windows"], "stats": e["stats"],
                        "derived_stats": e.get("derived_stats"), "breakdown": e.get("breakdown"),
                        "breakdown_kernels": e.get("breakdown_kernels"),
                        "breakdown_events": e.get("breakdown_events"),
                        "breakdown_phases": e.get("breakdown_phases"), "first_step": e.get("first_step")}
            for e in entries}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {"world": world, "node_size": node_size, "link": os.environ.get("ZPP_CLUSTER_LINK"),
                  "params": entries[0]["params"], "probe": probe, "per_rank": everyone, "not_run": not_run,
                  "implementations": {e["name"]: (e["stats"] or {}).get("implementations") for e in entries}}
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()

