#!/usr/bin/env python3
"""The ZeRO++ paper's low-bandwidth result on one machine: 2 emulated nodes x 2 ranks over shaped links.

    sudo .venv/bin/python scripts/bench_cluster.py --out out/bench_cluster          # ~7 min
    sudo .venv/bin/python scripts/bench_cluster.py --out out/bench_cluster --quick  # ~3 min

For each link rate (100mbit, 1gbit, unshaped) one emulated cluster is built with scripts/emulate_cluster.py
(2 network namespaces, 2 gloo ranks each, veth links shaped with tc tbf) and, in that one launch, every
configuration is trained side by side (random token batches of the same shape):

* ``FSDP2``        stock ``torch.distributed.fsdp.fully_shard`` per GPT-2 block + root (FULL_SHARD), no hf_zeropp
* ``ZeRO-3``       ``hf_zeropp.ZeroPPConfig(stage=3)``
* ``+qwZ``         ``quantized_weights=True`` (INT8 block-quantized forward all-gather)
* ``+hpZ``         ``hpz_partition_size="node"`` (backward all-gather stays inside the node)
* ``+qgZ``         ``quantized_gradients=True`` (2-hop INT4 all-to-all instead of the reduce-scatter)
* ``ZeRO++``       ``ZeroPPConfig.preset("zeropp")`` (all three), compiled kernels
* ``ZeRO++ ref``   the same with ``kernel_backend="reference"`` (plain torch quantization; the paper's Table 3)

All run bf16 weights and bf16 gradient reduction (``mixed_precision="bf16", reduce_dtype="bf16"``; the stock
peer gets the same ``MixedPrecisionPolicy``), fp32 master weights, AdamW.

Model (default): GPT2LMHeadModel from config, n_embd 256, 6 layers, 4 heads, vocab 4096, 128 positions — 5.8 M
parameters, M = 11.6 MB of bf16 weights — with 1 sequence of 128 tokens per rank (512 tokens per step). At
100 Mbit/s one ZeRO-3 step moves ~3 M across each node's link (gloo's ring all-gather and all-reduce based
reduce-scatter, see below), ~2.8 s, against ~0.1 s of compute per rank: communication dominates.

Timing: every configuration gets ``--warmup`` steps, then ``--rounds`` rounds in which each configuration runs
``--steps`` steps (the order rotates every round, so load drift on a shared machine hits all alike). A step's
time is the slowest rank's; the table shows the median over all timed steps and tokens/s = global tokens per step
/ median step time.

Meter cross-check: ``hf_zeropp.comm_stats`` counts LOGICAL bytes (what each rank must deliver to each peer,
algorithm-independent, see hf_zeropp/comm_meter.py). gloo's algorithms put a fixed multiple of that on the wire
between nodes; with g ranks in node order, d per node, a ring crossing every node boundary once:

* all-gather (gloo::allgather, ring): a node sends (g-1)/g of the buffer across, logically d(g-d)/g
  -> wire = logical x (g-1)/(d(g-d))        (2x2: 0.75)
* reduce-scatter (ProcessGroupGloo runs a full ring all-reduce, then keeps its chunk): 2(g-1)/g across, logically
  d(g-d)/g -> wire = logical x 2(g-1)/(d(g-d))   (2x2: 1.5)
* all-to-all (pairwise): wire = logical x 1; qgZ's inter-node hop (a group of one rank per node) likewise.

The benchmark measures these factors once per run (``probe``: each collective alone between counter reads) and
compares, per configuration and node, the expected wire bytes (meter x factor) with the veth counters over the
same steps: TCP payload = tx_bytes - 66 B x tx_packets (Ethernet + IPv4 + TCP-with-timestamps headers; a pure
ACK counts 0). The stock FSDP2 peer has no meter: its logical bytes are derived from its own FSDP2 units with the
meter's rule (padded shard sizes per unit; forward all-gather, backward all-gather unless the unit keeps its
weights after forward — FSDP2's root does by default — and reduce-scatter); the same derivation applied to
hf_zeropp's ZeRO-3 is checked against its meter (``derived_vs_meter`` in results.json).

Writes ``results.json``, ``results.md`` and ``results.png`` under ``--out``. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CONFIGS: dict[str, dict | None] = {
    "FSDP2": None,  # stock torch FSDP2
    "ZeRO-3": {"stage": 3},
    "+qwZ": {"stage": 3, "quantized_weights": True},
    "+hpZ": {"stage": 3, "hpz_partition_size": "node"},
    "+qgZ": {"stage": 3, "quantized_gradients": True},
    "ZeRO++": {"preset": "zeropp"},
    "ZeRO++ ref": {"preset": "zeropp", "kernel_backend": "reference"},
}
LINKS = ("100mbit", "1gbit", "none")
KINDS = ("fwd_allgather", "bwd_allgather", "grad_reduce_scatter", "grad_allreduce", "qgz_intra", "qgz_inter")


# ---------------------------------------------------------------------------------------------------------------
# the wire rule: how many bytes gloo puts on a node's link per logical (meter) byte
# ---------------------------------------------------------------------------------------------------------------

def wire_factors(world: int, node_size: int) -> dict[str, float]:
    """Inter-node wire bytes per logical inter-node byte, per meter kind, for gloo with ranks in node order."""
    g, d = world, node_size
    if g == d:
        return {kind: 0.0 for kind in KINDS}
    ring = (g - 1) / (d * (g - d))
    return {
        "fwd_allgather": ring,              # world-group ring all-gather (qwZ: codes and scales alike)
        "bwd_allgather": ring,              # world group without hpZ; with hpZ the meter's inter bytes are 0
        "grad_reduce_scatter": 2 * ring,    # gloo reduce-scatter = ring all-reduce of the whole buffer
        "grad_allreduce": ring,             # meter counts 2 M (g-1)/g per rank, the ring sends 2 M (g-1)/g per node
        "qgz_intra": 1.0,                   # node-local (inter bytes are 0)
        "qgz_inter": 1.0,                   # pairwise all-to-all among one rank per node
    }


def expected_node_wire(per_rank_stats: list[dict], world: int, node_size: int) -> list[float]:
    factors = wire_factors(world, node_size)
    out = [0.0] * (world // node_size)
    for rank, stats in enumerate(per_rank_stats):
        for kind in KINDS:
            out[rank // node_size] += stats.get(kind, {}).get("inter_node", 0) * factors[kind]
    return out


# ---------------------------------------------------------------------------------------------------------------
# worker: runs on every rank under torchrun inside the emulated cluster
# ---------------------------------------------------------------------------------------------------------------

def _read_counters() -> dict[str, int] | None:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    if not base.exists():
        return None
    return {name: int((base / name).read_text()) for name in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")}


def _counter_delta(before, after) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    out = {k: after[k] - before[k] for k in before}
    out["tx_payload_bytes"] = out["tx_bytes"] - 66 * out["tx_packets"]
    out["rx_payload_bytes"] = out["rx_bytes"] - 66 * out["rx_packets"]
    return out


def _probe(dist, torch, node_size: int, megabytes: float) -> dict:
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
        "all_reduce (world)": 2 * d * (g - d) / g * nbytes,
        "all_to_all (world)": d * (g - d) / g * nbytes,
        "all_to_all (one rank per node)": d * (nodes - 1) / nodes * nbytes,
    }
    x = torch.ones(n)
    ops = {
        "all_gather (world)": lambda: dist.all_gather_into_tensor(torch.empty(n), x[: n // g]),
        "reduce_scatter (world)": lambda: dist.reduce_scatter_tensor(torch.empty(n // g), x),
        "all_reduce (world)": lambda: dist.all_reduce(x.clone()),
        "all_to_all (world)": lambda: dist.all_to_all_single(torch.empty(n), x),
        "all_to_all (one rank per node)": lambda: dist.all_to_all_single(torch.empty(n), x, group=inter),
    }
    factors = wire_factors(g, d)
    rule = {"all_gather (world)": factors["fwd_allgather"], "reduce_scatter (world)": factors["grad_reduce_scatter"],
            "all_reduce (world)": factors["grad_allreduce"], "all_to_all (world)": 1.0,
            "all_to_all (one rank per node)": 1.0}
    result = {}
    for name, op in [("barriers only", lambda: None), *ops.items()]:
        dist.barrier()
        before = _read_counters()
        dist.barrier()
        op()
        dist.barrier()
        after = _read_counters()
        deltas = [None] * world
        dist.all_gather_object(deltas, _counter_delta(before, after))
        node_payload = [deltas[nd * node_size]["tx_payload_bytes"] if deltas[nd * node_size] else None
                        for nd in range(nodes)]
        entry = {"node_tx_payload_bytes": node_payload}
        if name in logical_node:
            entry.update(logical_node_bytes=logical_node[name], rule_factor=rule[name],
                         measured_factor=[p / logical_node[name] if p is not None else None for p in node_payload])
        result[name] = entry
    result["buffer_bytes"] = nbytes
    return result


def _build(name: str, options: dict | None, args, torch, dist):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.n_embd,
                                       n_layer=args.n_layer, n_head=args.n_head, bos_token_id=0, eos_token_id=0))
    params = sum(p.numel() for p in model.parameters())
    backend = None
    if options is None:  # the peer: stock FSDP2 FULL_SHARD, same units and precision, torch's own collectives
        dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        options = dict(options)
        preset = options.pop("preset", None)
        precision = {"mixed_precision": args.precision if args.precision != "fp32" else "no",
                     "reduce_dtype": args.precision}
        config = (hf_zeropp.ZeroPPConfig.preset(preset, **precision, **options) if preset
                  else hf_zeropp.ZeroPPConfig(**precision, **options))
        backend = config.kernel_backend
        hf_zeropp.kernels.set_default_backend(None)
        hf_zeropp.shard_model(model, config)
        hf_zeropp.kernels.set_default_backend(None)  # set per step below: configs share the process
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {"name": name, "model": model, "optimizer": optimizer, "backend": backend, "params": params,
            "metered": options is not None, "times": [], "windows": [], "stats": None}


def _fsdp_logical_per_step(model, world: int, node_size: int, param_bytes: int, reduce_bytes: int) -> dict:
    """Logical inter-node bytes this rank sends per step under the meter's rule, derived from FSDP2's own unit
    layout (for the stock peer, which has no meter): per unit, the forward all-gather of its padded shards, the
    backward all-gather again unless the unit keeps its weights after forward (FSDP2's root does by default),
    and the reduce-scatter whose chunk is the padded shard."""
    from torch.distributed.fsdp import FSDPModule

    inter_peers = world - node_size
    out = {kind: {"intra_node": 0, "inter_node": 0, "calls": 0}
           for kind in ("fwd_allgather", "bwd_allgather", "grad_reduce_scatter")}
    intra_peers = node_size - 1
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            kinds = [("fwd_allgather", param_bytes), ("grad_reduce_scatter", reduce_bytes)]
            if group.post_forward_mesh_info is not None:
                kinds.append(("bwd_allgather", param_bytes))
            for kind, size in kinds:
                out[kind]["inter_node"] += numel * size * inter_peers
                out[kind]["intra_node"] += numel * size * intra_peers
                out[kind]["calls"] += 1
    return out


class _Breakdown:
    """Wall-clock attribution of a step, by wrapping (at runtime, in this process only) hf_zeropp's all-gather and
    reduce-scatter hooks and its kernel entry points: time inside each hook, and the quantization kernels inside
    each (the rest of such a call is waiting on gloo)."""

    KERNELS = ("quantize", "dequantize", "swizzle_quantize", "dequant_reduce_quant", "dequant_reduce")

    def __init__(self) -> None:
        import collections

        self.seconds = collections.defaultdict(float)
        self.inside: str | None = None
        self._restore: list = []

    def __enter__(self):
        import hf_zeropp.kernels as kernels
        from hf_zeropp.qgz import QuantizedReduceScatter
        from hf_zeropp.qwz import QuantizedAllGather

        self._wrap(QuantizedAllGather, "__call__", "gather")
        self._wrap(QuantizedReduceScatter, "__call__", "reduce")
        for name in self.KERNELS:
            self._wrap(kernels, name, None)
        return self

    def _wrap(self, owner, attr: str, section: str | None) -> None:
        original = getattr(owner, attr)
        timer = self

        def wrapped(*args, **kwargs):
            outer = timer.inside
            if section is not None:
                timer.inside = section
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if section is not None:
                    timer.inside = outer
                    timer.seconds[f"{section} call"] += spent
                else:
                    timer.seconds[f"{outer or 'other'} kernels"] += spent

        setattr(owner, attr, wrapped)
        self._restore.append((owner, attr, original))

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)


def _step(entry, ids, torch) -> None:
    import hf_zeropp

    hf_zeropp.kernels.set_default_backend(entry["backend"])
    loss = entry["model"](input_ids=ids, labels=ids).loss
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
    import torch
    import torch.distributed as dist

    import hf_zeropp

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def say(text: str) -> None:
        if rank == 0:
            print(f"[bench {os.environ.get('ZPP_CLUSTER_LINK', '?')}] {text}", flush=True)

    probe = _probe(dist, torch, node_size, args.probe_mb) if args.probe_mb > 0 else None
    names = [n for n in args.configs.split(",") if n]
    entries = [_build(name, CONFIGS[name], args, torch, dist) for name in names]
    say(f"GPT-2 {entries[0]['params'] / 1e6:.2f}M params, {world} ranks ({world // node_size} nodes x {node_size}), "
        f"{args.batch_per_rank} x {args.seq_len} tokens per rank; configs: {', '.join(names)}")
    generator = torch.Generator().manual_seed(1234 + rank)

    def batch():
        return torch.randint(0, args.vocab, (args.batch_per_rank, args.seq_len), generator=generator)

    for entry in entries:  # warm-up (lazy init, allocator, kernel JIT load)
        start = time.perf_counter()
        for _ in range(args.warmup):
            _step(entry, batch(), torch)
        say(f"warm-up {entry['name']}: {(time.perf_counter() - start) / max(args.warmup, 1):.2f} s/step")
    for entry in entries:
        if entry["metered"]:
            hf_zeropp.comm_stats(entry["model"], reset=True)

    for rnd in range(args.rounds):
        shift = rnd % len(entries)
        for entry in entries[shift:] + entries[:shift]:
            dist.barrier()
            before = _read_counters()
            dist.barrier()
            window_start = time.perf_counter()
            for _ in range(args.steps):
                ids = batch()
                start = time.perf_counter()
                _step(entry, ids, torch)
                entry["times"].append(time.perf_counter() - start)
            dist.barrier()
            window = time.perf_counter() - window_start
            after = _read_counters()
            entry["windows"].append({"seconds": window, "steps": args.steps, "counters": _counter_delta(before, after)})
            if entry["metered"]:
                entry["stats"] = _accumulate(entry["stats"], hf_zeropp.comm_stats(entry["model"], reset=True))
        say(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{e['name']} {statistics.median(e['times'][-args.steps:]):.2f}s" for e in entries))

    for entry in entries:  # where the time goes in the quantized configurations (not part of the timing above)
        if args.breakdown_steps <= 0 or not entry["metered"]:
            continue
        with _Breakdown() as breakdown:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.breakdown_steps):
                _step(entry, batch(), torch)
            total = time.perf_counter() - start
        entry["breakdown"] = {"step": total / args.breakdown_steps,
                              **{k: v / args.breakdown_steps for k, v in breakdown.seconds.items()}}
        if entry["metered"]:
            hf_zeropp.comm_stats(entry["model"], reset=True)

    itemsize = 2 if args.precision == "bf16" else 4
    for entry in entries:
        if entry["name"] in ("FSDP2", "ZeRO-3"):  # ZeRO-3's derivation is checked against its meter
            per_step = _fsdp_logical_per_step(entry["model"], world, node_size, itemsize, itemsize)
            steps = sum(w["steps"] for w in entry["windows"])
            entry["derived_stats"] = {k: {kk: vv * steps for kk, vv in v.items()} for k, v in per_step.items()}
    mine = {e["name"]: {"times": e["times"], "windows": e["windows"], "stats": e["stats"],
                        "derived_stats": e.get("derived_stats"), "breakdown": e.get("breakdown")} for e in entries}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {"world": world, "node_size": node_size, "link": os.environ.get("ZPP_CLUSTER_LINK"),
                  "params": entries[0]["params"], "probe": probe, "per_rank": everyone,
                  "implementations": {e["name"]: (e["stats"] or {}).get("implementations") for e in entries}}
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# driver: builds the clusters, then analyses
# ---------------------------------------------------------------------------------------------------------------

def _emulator():
    sys.path.insert(0, str(HERE))
    import emulate_cluster

    return emulate_cluster


def run_link(link: str, args, out: Path, probe_mb: float) -> dict:
    raw = out / f"raw_{link}.json"
    counters = out / f"counters_{link}.json"
    raw.unlink(missing_ok=True)
    worker_args = ["--worker", "--result", str(raw), "--configs", args.configs, "--warmup", str(args.warmup),
                   "--rounds", str(args.rounds), "--steps", str(args.steps), "--probe-mb", str(probe_mb),
                   "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
                   "--vocab", str(args.vocab), "--seq-len", str(args.seq_len),
                   "--batch-per-rank", str(args.batch_per_rank), "--precision", args.precision,
                   "--breakdown-steps", str(args.breakdown_steps)]
    cmd = [sys.executable, str(HERE / "emulate_cluster.py"), "--nodes", str(args.nodes), "--nproc-per-node",
           str(args.nproc_per_node), "--link", link, "--counters-json", str(counters), "--",
           str(HERE / "bench_cluster.py"), *worker_args]
    print(f"== link {link}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    load_before = os.getloadavg()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        status = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the emulator stops its nodes and removes its namespaces
        proc.wait(timeout=60)
        raise SystemExit(f"link {link}: the run exceeded --timeout {args.timeout} s")
    if status != 0 or not raw.exists():
        raise SystemExit(f"link {link}: the emulated run failed (status {status}); see the output above")
    result = json.loads(raw.read_text())
    result["emulator"] = json.loads(counters.read_text())
    result["loadavg_before_after"] = [load_before, os.getloadavg()]
    return result


def analyse(link_results: dict[str, dict], args) -> dict:
    summary: dict = {"links": {}}
    for link, res in link_results.items():
        world, node_size = res["world"], res["node_size"]
        nodes = world // node_size
        tokens_per_step = world * args.batch_per_rank * args.seq_len
        per_rank = res["per_rank"]
        rows = {}
        for name in per_rank[0]:
            steps = [max(r[name]["times"][i] for r in per_rank) for i in range(len(per_rank[0][name]["times"]))]
            median = statistics.median(steps)
            n_steps = len(steps)
            metered = per_rank[0][name]["stats"] is not None
            key = "stats" if metered else "derived_stats"
            quartiles = statistics.quantiles(steps, n=4) if len(steps) > 1 else [median, median, median]
            row = {"median_step_s": median, "mean_step_s": statistics.fmean(steps), "steps": steps,
                   "p25_step_s": quartiles[0], "p75_step_s": quartiles[2],
                   "tokens_per_s": tokens_per_step / median, "timed_steps": n_steps}
            if per_rank[0][name].get(key) is not None:
                stats = [r[name][key] for r in per_rank]
                meter_steps = sum(w["steps"] for w in per_rank[0][name]["windows"])
                logical = sum(s.get(k, {}).get("inter_node", 0) for s in stats for k in KINDS)
                expected = expected_node_wire(stats, world, node_size)
                row.update(meter_source="comm_stats" if metered else "derived from FSDP2 units",
                           logical_inter_bytes_per_step=logical / meter_steps,
                           logical_inter_by_kind_per_step={
                               k: sum(s.get(k, {}).get("inter_node", 0) for s in stats) / meter_steps
                               for k in KINDS if any(k in s for s in stats)},
                           expected_wire_per_node_per_step=[e / meter_steps for e in expected])
            windows = per_rank[0][name]["windows"]
            measured = []
            for nd in range(nodes):
                counters = [w["counters"] for w in per_rank[nd * node_size][name]["windows"]]
                if all(c is not None for c in counters):
                    measured.append(sum(c["tx_payload_bytes"] for c in counters) / n_steps)
                    row.setdefault("measured_wire_raw_per_node_per_step", []).append(
                        sum(c["tx_bytes"] for c in counters) / n_steps)
            if measured:
                row["measured_wire_per_node_per_step"] = measured
            if measured and "expected_wire_per_node_per_step" in row:
                row["wire_error"] = [m / e - 1 if e else None
                                     for m, e in zip(measured, row["expected_wire_per_node_per_step"])]
            row["window_s_per_step"] = sum(w["seconds"] for w in windows) / n_steps
            breakdowns = [r[name].get("breakdown") for r in per_rank if r[name].get("breakdown")]
            if breakdowns:
                keys = sorted({k for b in breakdowns for k in b})
                row["breakdown_s_per_step"] = {k: statistics.fmean(b.get(k, 0.0) for b in breakdowns) for k in keys}
            derived = per_rank[0][name].get("derived_stats")
            if metered and derived is not None:  # the unit-layout derivation against the meter (ZeRO-3)
                derived_total = sum(r[name]["derived_stats"][k]["inter_node"] for r in per_rank
                                    for k in r[name]["derived_stats"])
                row["derived_vs_meter"] = derived_total / (row["logical_inter_bytes_per_step"] * n_steps) - 1
            rows[name] = row
        base = rows.get("FSDP2")
        z3 = rows.get("ZeRO-3")
        for row in rows.values():
            if base:
                row["speedup_vs_fsdp2"] = base["median_step_s"] / row["median_step_s"]
            if z3:
                row["speedup_vs_zero3"] = z3["median_step_s"] / row["median_step_s"]
        summary["links"][link] = {"rows": rows, "probe": res.get("probe"), "params": res["params"],
                                  "loadavg_before_after": res.get("loadavg_before_after"),
                                  "tokens_per_step": tokens_per_step, "implementations": res["implementations"],
                                  "emulator": {k: v for k, v in res["emulator"].items() if k != "command"}}
    summary["targets"] = targets(summary["links"])
    return summary


def targets(links: dict) -> list[dict]:
    out = []
    slow = links.get("100mbit", {}).get("rows", {})
    fast = links.get("none", {}).get("rows", {})
    if "ZeRO++" in slow and "FSDP2" in slow:
        ratio = slow["FSDP2"]["median_step_s"] / slow["ZeRO++"]["median_step_s"]
        out.append({"target": "ZeRO++ >= 3x faster per step than stock FSDP2 at 100 Mbit/s",
                    "value": f"{ratio:.2f}x", "met": ratio >= 3.0})
    if "ZeRO++" in fast and "ZeRO-3" in fast:
        slower = fast["ZeRO++"]["median_step_s"] / fast["ZeRO-3"]["median_step_s"] - 1
        out.append({"target": "ZeRO++ <= 10 % slower than hf_zeropp ZeRO-3 on unshaped links",
                    "value": f"{slower * 100:+.1f} %", "met": slower <= 0.10})
    for name in ("+qwZ", "+hpZ", "+qgZ"):
        if name in slow and "ZeRO-3" in slow:
            ratio = slow["ZeRO-3"]["median_step_s"] / slow[name]["median_step_s"]
            out.append({"target": f"{name} faster than ZeRO-3 at 100 Mbit/s", "value": f"{ratio:.2f}x",
                        "met": ratio > 1.0})
    return out


def _link_label(link: str) -> str:
    return {"none": "unshaped", "100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s"}.get(link, link)


def markdown(summary: dict, args) -> str:
    first = next(iter(summary["links"].values()))
    lines = [
        f"GPT-2 from config: n_embd {args.n_embd}, {args.n_layer} layers, {args.n_head} heads, vocab {args.vocab}, "
        f"{first['params'] / 1e6:.2f}M parameters; {args.batch_per_rank} x {args.seq_len} tokens per rank, "
        f"{first['tokens_per_step']} tokens per step; {args.nodes} emulated nodes x {args.nproc_per_node} ranks "
        f"(gloo), {args.precision} weights and gradient reduction. Median step time over "
        f"{args.rounds * args.steps} timed steps per configuration (rounds interleaved) after {args.warmup} warm-up; "
        "a step's time is the slowest rank's. Load average of the machine before/after each link's run: " +
        ", ".join(f"{_link_label(l)} {d['loadavg_before_after'][0][0]:.1f}/{d['loadavg_before_after'][1][0]:.1f}"
                  for l, d in summary["links"].items() if d.get("loadavg_before_after")) + ".",
        "",
        "Wire bytes are per node per step over the node's veth (TCP payload = tx_bytes - 66 B x packets); "
        "'expected' = comm_stats logical inter-node bytes x gloo's algorithm factor (all-gather ring "
        "(g-1)/(d(g-d)), reduce-scatter = ring all-reduce 2(g-1)/(d(g-d)), all-to-all 1). Stock FSDP2 has no "
        "meter: its logical bytes are derived from its FSDP2 units with the meter's rule (the same derivation "
        "applied to ZeRO-3 matches ZeRO-3's meter; see results.json derived_vs_meter).",
        "",
        "| link | config | step s (p25–p75) | tokens/s | vs FSDP2 | vs ZeRO-3 | logical inter (MB/step, all ranks) "
        "| expected wire (MB/node/step) | measured wire (MB/node/step) | meter vs counter |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link, data in summary["links"].items():
        for name, row in data["rows"].items():
            logical = row.get("logical_inter_bytes_per_step")
            expected = row.get("expected_wire_per_node_per_step")
            measured = row.get("measured_wire_per_node_per_step")
            error = row.get("wire_error")
            cells = [_link_label(link), name,
                     f"{row['median_step_s']:.3f} ({row['p25_step_s']:.2f}–{row['p75_step_s']:.2f})",
                     f"{row['tokens_per_s']:.0f}",
                     f"{row['speedup_vs_fsdp2']:.2f}x" if "speedup_vs_fsdp2" in row else "-",
                     f"{row['speedup_vs_zero3']:.2f}x" if "speedup_vs_zero3" in row else "-",
                     f"{logical / 1e6:.2f}" if logical is not None else "-"]
            lines.append("| " + " | ".join(cells) + " | ")
            lines[-1] += (" / ".join(f"{e / 1e6:.2f}" for e in expected) if expected else "-") + " | "
            lines[-1] += (" / ".join(f"{m / 1e6:.2f}" for m in measured) if measured else "-") + " | "
            lines[-1] += (" / ".join(f"{x * 100:+.1f} %" for x in error if x is not None) if error else "-") + " |"
    lines += ["", "Targets (ratios from the same launch per link):", ""]
    for t in summary["targets"]:
        lines.append(f"* {'MET' if t['met'] else 'MISSED'}: {t['target']} — {t['value']}")
    kernel_rows = []
    for link, data in summary["links"].items():
        rows = data["rows"]
        if "ZeRO++" in rows and "ZeRO++ ref" in rows:
            kernel_rows.append(f"| {_link_label(link)} | {rows['ZeRO++']['median_step_s']:.3f} | "
                               f"{rows['ZeRO++ ref']['median_step_s']:.3f} | "
                               f"{rows['ZeRO++ ref']['median_step_s'] / rows['ZeRO++']['median_step_s']:.2f}x |")
    if kernel_rows:
        lines += ["", "Quantization kernels (ZeRO++ step time): compiled vs reference (plain torch)", "",
                  "| link | compiled (s) | reference (s) | reference / compiled |", "|---|---:|---:|---:|",
                  *kernel_rows]
    breakdown_rows = []
    for link, data in summary["links"].items():
        for name, row in data["rows"].items():
            b = row.get("breakdown_s_per_step")
            if not b:
                continue
            cells = [b.get("gather call", 0.0), b.get("gather kernels", 0.0), b.get("reduce call", 0.0),
                     b.get("reduce kernels", 0.0)]
            breakdown_rows.append(f"| {_link_label(link)} | {name} | {b['step']:.3f} | " + " | ".join(
                f"{c:.3f}" for c in cells) + f" | {cells[0] - cells[1] + cells[2] - cells[3]:.3f} |")
    if breakdown_rows:
        lines += ["", "Where the time goes (instrumented extra steps, mean over ranks, seconds per step): gather / "
                  "reduce = wall time inside hf_zeropp's all-gather hook (qwZ when on, else the plain gather) and "
                  "gradient reduce-scatter hook (qgZ when on, else the plain reduce-scatter); FSDP2 calls both "
                  "synchronously on CPU, so this is the whole collective. kernels = "
                  "quantization kernels inside them, wait = the rest of those calls (gloo transfers, and peers "
                  "that are still computing: 4 ranks share 2 cores)", "",
                  "| link | config | step | gather | gather kernels | reduce | reduce kernels | wait in both |",
                  "|---|---|---:|---:|---:|---:|---:|---:|", *breakdown_rows]
    probe = next((d["probe"] for d in summary["links"].values() if d.get("probe")), None)
    if probe:
        lines += ["", f"gloo probe (each collective alone, {probe['buffer_bytes'] / 1e6:.1f} MB buffer): node wire bytes "
                  f"per logical inter-node byte", "", "| collective | rule | measured (node 0 / node 1) |",
                  "|---|---:|---:|"]
        for name, entry in probe.items():
            if isinstance(entry, dict) and "rule_factor" in entry:
                measured = " / ".join(f"{m:.4f}" for m in entry["measured_factor"] if m is not None)
                lines.append(f"| {name} | {entry['rule_factor']:.4f} | {measured} |")
        if "barriers only" in probe:
            lines.append(f"| (barriers around a window, bytes) | - | "
                         f"{' / '.join(str(b) for b in probe['barriers only']['node_tx_payload_bytes'])} |")
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(summary["links"])
    names = list(next(iter(summary["links"].values()))["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(links))]
        tps = [summary["links"][l]["rows"][name]["tokens_per_s"] for l in links]
        sp = [summary["links"][l]["rows"][name].get("speedup_vs_fsdp2", 0) for l in links]
        axes[0].bar(xs, tps, width, label=name)
        axes[1].bar(xs, sp, width, label=name)
    for ax, title in zip(axes, ("throughput (tokens/s, higher is better)", "speedup per step vs stock FSDP2")):
        ax.set_xticks(range(len(links)), [_link_label(l) for l in links])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].axhline(3.0, color="red", lw=0.8, ls="--", label="3x target")
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle("ZeRO++ ablation on 2 emulated nodes x 2 ranks (gloo, tc-shaped veth links)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_cluster", help="folder for results.json/.md/.png")
    parser.add_argument("--quick", action="store_true", help="fewer steps (1 warm-up, 3 rounds x 1 step, 1 breakdown step)")
    parser.add_argument("--links", default=",".join(LINKS), help="comma list of link rates; default %(default)s")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1, help="steps per configuration per round")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=1)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank; default 1")
    parser.add_argument("--probe-mb", type=float, default=4.0, help="buffer of the gloo probe (on the fastest link)")
    parser.add_argument("--breakdown-steps", type=int, default=2,
                        help="extra instrumented steps per quantized configuration (time in qwZ/qgZ calls and "
                             "their kernels); 0 = off")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per link before giving up")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in args.configs.split(","):
        if name and name not in CONFIGS:
            parser.error(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 3, 1
        args.breakdown_steps = min(args.breakdown_steps, 1)
    problem = _emulator().requirements_problem()
    if problem:
        print(f"bench_cluster: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    links = [l for l in args.links.split(",") if l]
    probe_link = "none" if "none" in links else links[-1]
    started = time.monotonic()
    results = {}
    for link in links:
        results[link] = run_link(link, args, out, args.probe_mb if link == probe_link else 0)
    summary = analyse(results, args)
    summary["settings"] = {k: v for k, v in vars(args).items() if k not in ("worker", "result")}
    summary["wall_s"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    table = markdown(summary, args)
    (out / "results.md").write_text(table)
    chart(summary, out / "results.png")
    print(table)
    print(f"bench_cluster: wrote {out}/results.json, results.md, results.png in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
