"""The driver side: one emulated cluster per link rate (:mod:`hf_zeropp.testing.emulated_cluster`: network namespaces,
veth links shaped with tc, one torchrun per emulated node), each running ``-m scripts.benchmarks.cluster --worker`` on
every rank.

Needs root, ``ip`` and ``tc`` (:func:`requirements_problem` says what is missing). Each link's raw per-rank results
land in ``<out>/raw_<link>.json`` and the emulator's own counters in ``<out>/counters_<link>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hf_zeropp.testing import emulated_cluster, emulated_network

ROOT = Path(__file__).resolve().parents[2]


def parse_cli(parser: argparse.ArgumentParser, configs: dict, on_request: dict | None = None) -> argparse.Namespace:
    """The options every emulated-cluster benchmark has (``--configs`` out of ``configs``, plus ``on_request``
    where named, ``--python``, ``--threads``, ``--timeout``, and the hidden ``--worker``/``--result`` its ranks run
    with), parsed and checked."""
    known = {**configs, **(on_request or {})}
    parser.add_argument("--configs", default=",".join(configs), help="comma list of: " + ", ".join(known))
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the ranks (one with deepspeed for its configurations); default this one")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank; default 1")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per link before giving up")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in args.configs.split(","):
        if name and name not in known:
            parser.error(f"unknown configuration {name!r}; choose from {', '.join(known)}")
    return args


def output_folder(args: argparse.Namespace, program: str) -> Path | None:
    """``args.out``, created, for a driver run; None (after saying why on stderr) where the emulated cluster cannot
    run here."""
    problem = requirements_problem()
    if problem:
        print(f"{program}: {problem}", file=sys.stderr)
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def requirements_problem() -> str | None:
    """Why the emulated cluster cannot run here (root, ip, tc), or None."""
    return emulated_network.requirements_problem()


def run_emulated(module: str, worker_args: list[str], link: str, raw: Path, counters: Path, *, nodes: int,
                 nproc_per_node: int, threads: int, timeout: float, python: str = sys.executable) -> dict:
    """``python -m module`` (run from the checkout) with ``worker_args`` on every rank of one emulated cluster at
    ``link``; the worker's results (it
    writes ``raw``) plus the emulator's counters and the machine's load average before/after."""
    raw.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", emulated_cluster.__name__, "--nodes", str(nodes), "--nproc-per-node",
           str(nproc_per_node), "--link", link, "--counters-json", str(counters), "--python", python, "--", "-m",
           module, *worker_args]
    print(f"== link {link}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    load_before = os.getloadavg()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the emulator stops its nodes and removes its namespaces
        proc.wait(timeout=60)
        raise SystemExit(f"link {link}: the run exceeded --timeout {timeout} s")
    if status != 0 or not raw.exists():
        raise SystemExit(f"link {link}: the emulated run failed (status {status}); see the output above")
    result = json.loads(raw.read_text())
    result["emulator"] = json.loads(counters.read_text())
    result["loadavg_before_after"] = [load_before, os.getloadavg()]
    return result


def run_link(link: str, args, out: Path, probe_mb: float) -> dict:
    """One emulated cluster at ``link`` running every bench_cluster configuration."""
    raw = out / f"raw_{link}.json"
    worker_args = ["--worker", "--result", str(raw), "--configs", args.configs, "--warmup", str(args.warmup),
                   "--rounds", str(args.rounds), "--steps", str(args.steps), "--probe-mb", str(probe_mb),
                   "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
                   "--vocab", str(args.vocab), "--seq-len", str(args.seq_len),
                   "--batch-per-rank", str(args.batch_per_rank), "--precision", args.precision,
                   "--breakdown-steps", str(args.breakdown_steps)] + (["--untied"] if args.untied else []) + \
        (["--compile", args.compile] if args.compile else [])
    return run_emulated("scripts.benchmarks.cluster", worker_args, link, raw, out / f"counters_{link}.json",
                        nodes=args.nodes, nproc_per_node=args.nproc_per_node, threads=args.threads,
                        timeout=args.timeout, python=args.python)


def run_links(args, out: Path) -> dict[str, dict]:
    """Every link of ``--links`` in turn (the gloo probe on the fastest one); link -> raw results."""
    links = [link for link in args.links.split(",") if link]
    probe_link = "none" if "none" in links else links[-1]
    return {link: run_link(link, args, out, args.probe_mb if link == probe_link else 0) for link in links}
