"""Emulate a multi-node cluster on one machine with Linux network namespaces, then run torchrun on every "node".

    sudo .venv/bin/python -m hf_zeropp.testing.emulated_cluster --nodes 2 --nproc-per-node 2 --link 100mbit \\
        --counters-json out/counters.json -- scripts/train_demo.py --preset zeropp

Topology (star through a switch namespace; all names carry this run's prefix ``zpp-<pid>-`` so parallel runs never
collide, and leftovers of dead runs with that prefix are removed at start):

    zpp-<pid>-n0 [lo + veth0 10.213.0.1] ──┐
    zpp-<pid>-n1 [lo + veth0 10.213.0.2] ──┼── zpp-<pid>-sw [bridge br0, ports p0 p1 ...]
    ...                                   ─┘

* A node's ranks run inside its namespace; traffic between them goes to the node's own address and is delivered
  over that namespace's loopback (never shaped). Traffic between nodes crosses the node's veth, the bridge and the
  peer's veth.
* ``--link RATE`` shapes every node's link in *both* directions with a token-bucket filter (``tc tbf``): egress of
  the node-side veth (upload) and egress of the switch port towards the node (download), like a full-duplex NIC
  of that rate. ``--link none`` leaves the links unshaped (veth speed, several Gbit/s).
* ``--latency DELAY`` adds a one-way delay on every node's uplink with ``netem`` (RTT = 2 x DELAY). This needs
  the kernel's sch_netem; without it the script stops and says so rather than silently run without the delay.
* Faults: ``--loss PERCENT`` drops that share of the packets on every node's uplink (``netem loss``, where the
  kernel has sch_netem; the qdiscs' drops are counted per node in the report); ``--flap AT,FOR`` takes every
  node's link down at the switch ``AT`` seconds after the launch, for ``FOR`` seconds. TCP retransmits, or the
  collectives time out.
* The addresses (10.213.0.0/24 by default, ``--subnet``) exist only on the namespaces' own interfaces; nothing
  is routed out of them, so no traffic leaves the machine.

Each node runs ``torchrun --nnodes N --node_rank i --nproc_per_node D --master_addr <node 0's address>`` with
``GLOO_SOCKET_IFNAME`` set to the node's veth, followed by the command given after ``--`` (with ``--raw`` the
command runs as is, once per node, with ``ZPP_NODE_RANK``/``ZPP_MASTER_ADDR``/``ZPP_NODE_ADDRS`` set). With
``--max-restarts N`` the nodes instead meet through torchrun's c10d rendezvous on node 0's address, each agent restarts
its workers up to N times, and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every rendezvous round a fresh store
(:func:`hf_zeropp.engine.failure_report.restart_problem` says why both are needed). Output
lines are prefixed with ``[n<i>]``. The veth byte/packet counters of every node are read before and after the run
and printed (and written to ``--counters-json``). Namespaces, links and the processes this script started are
always removed (normal exit, errors, Ctrl-C, SIGTERM).

Needs root and the ``ip`` and ``tc`` tools (iproute2); says so and exits with status 2 otherwise. The exit status
is otherwise the first non-zero status of a node's launcher (0 when all succeed).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time

from .emulated_network import (HEADER_BYTES_PER_PACKET, Cluster, SetupError, delta, parse_delay, parse_rate,
                               remove_stale_namespaces, requirements_problem)

class Launcher:
    """One process per node inside its namespace; output prefixed per node; terminated as a group on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def start(self, node: int, argv: list[str], env: dict[str, str], prefix_output: bool) -> None:
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                stdout=subprocess.PIPE if prefix_output else None,
                                stderr=subprocess.STDOUT if prefix_output else None)
        self.procs.append(proc)
        if prefix_output:
            thread = threading.Thread(target=self._pump, args=(proc, f"[n{node}] "), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pump(self, proc: subprocess.Popen, prefix: str) -> None:
        for raw in iter(proc.stdout.readline, b""):
            with self.lock:
                sys.stdout.write(prefix + raw.decode(errors="replace"))
                sys.stdout.flush()

    def wait(self, grace_s: float) -> int:
        """Wait for every node; when one fails, give the others ``grace_s`` to notice, then stop them."""
        first_failure: int | None = None
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            for code in codes:
                if code not in (None, 0) and first_failure is None:
                    first_failure, failed_at = code, time.monotonic()
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                print(f"emulated_cluster: a node failed (status {first_failure}); stopping the others",
                      file=sys.stderr, flush=True)
                self.stop()
                break
            time.sleep(0.1)
        for thread in self.threads:
            thread.join(timeout=5)
        return first_failure or 0

    def stop(self) -> None:
        """SIGTERM each launched process group (torchrun forwards it to its ranks), SIGKILL after 10 s."""
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in alive:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _kill_leftovers_in(cluster: Cluster, launched_groups: set[int]) -> None:
    """Processes still inside our namespaces that belong to the process groups we launched (e.g. a rank that
    ignored SIGTERM): SIGKILL them by pid before the namespaces go."""
    for name in list(cluster.created):
        proc = subprocess.run([cluster.ip, "netns", "pids", name], capture_output=True, text=True)
        for token in proc.stdout.split():
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                pid = int(token)
                if os.getpgid(pid) in launched_groups:
                    os.kill(pid, signal.SIGKILL)


def _flap(text: str) -> tuple[float, float]:
    try:
        at, duration = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--flap {text!r}: use AT,FOR in seconds, e.g. 20,5") from None
    return at, duration


def _flap_links(cluster: Cluster, at: float, duration: float, start: float, events: list) -> None:
    """Links down ``at`` seconds after ``start`` for ``duration`` seconds; each change lands in ``events``."""
    for when, up in ((at, False), (at + duration, True)):
        time.sleep(max(0.0, start + when - time.monotonic()))
        cluster.set_links(up)
        events.append({"t_s": round(time.monotonic() - start, 3), "links": "up" if up else "down"})
        print(f"emulated_cluster: links {'up' if up else 'down'} at {events[-1]['t_s']} s", file=sys.stderr,
              flush=True)


def _signal_to_exception(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def _rendezvous(args: argparse.Namespace, node: int, addresses: list[str]) -> list[str]:
    """torchrun's options for meeting the other nodes: static (fixed node ranks), or c10d when workers restart (a
    node's restarted workers must join the others' new round, which only the c10d rendezvous has)."""
    if not args.max_restarts:
        return ["--node_rank", str(node), "--master_addr", addresses[0], "--master_port", str(args.master_port)]
    # torchrun finds a node's address, and whether it hosts the store, from the host name: inside a namespace that
    # is the machine's, so both are given
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addresses[0]}:{args.master_port}",
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", addresses[node],
            "--rdzv-id", f"emulated-cluster-{os.getpid()}", "--max-restarts", str(args.max_restarts)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    else:
        command = []
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] -- TRAINING_SCRIPT [ARGS...]")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (one namespace each); default 2")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2, help="ranks per node; default 2")
    parser.add_argument("--link", type=parse_rate, default=parse_rate("100mbit"),
                        help="per-node link rate, both directions (tc tbf): e.g. 100mbit, 1gbit, or none; "
                             "default 100mbit")
    parser.add_argument("--latency", type=parse_delay, default=None,
                        help="one-way delay on every node's uplink (tc netem), e.g. 1ms; default none")
    parser.add_argument("--loss", type=float, default=0.0,
                        help="percent of packets dropped on every uplink (netem; an eBPF dropper where the kernel "
                             "has no netem)")
    parser.add_argument("--flap", type=_flap, default=None, metavar="AT,FOR",
                        help="take the links down AT seconds after the launch for FOR seconds")
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the veth links; default 1500")
    parser.add_argument("--subnet", type=ipaddress.IPv4Network, default=ipaddress.IPv4Network("10.213.0.0/24"),
                        help="private subnet that exists only inside the namespaces; default 10.213.0.0/24")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--counters-json", help="write the per-node veth counters (before/after/delta) here")
    parser.add_argument("--raw", action="store_true",
                        help="run the command itself once per node instead of under torchrun")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [n<i>]")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs torchrun; default this one")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restarts of each node's workers after a failure (torchrun's c10d rendezvous); default 0")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds the other nodes get to exit after one node failed; default 30")
    args = parser.parse_args(argv)
    link_text = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--link"),
                     next((a.split("=", 1)[1] for a in argv if a.startswith("--link=")), "100mbit"))
    if not command:
        parser.error("give the command to run after `--`, e.g. `-- scripts/train_demo.py --preset zeropp`")
    if args.nodes < 1 or args.nproc_per_node < 1:
        parser.error("--nodes and --nproc-per-node must be at least 1")

    problem = requirements_problem()
    if problem:
        print(f"emulated_cluster: {problem}", file=sys.stderr)
        return 2

    cluster = Cluster(args.nodes, args.subnet, args.link, args.latency, args.mtu, args.loss)
    launcher = Launcher()
    previous = {sig: signal.signal(sig, _signal_to_exception) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    report: dict = {
        "nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "link": "none" if args.link is None else
        link_text, "rate_bits_per_s": args.link, "latency_s": args.latency, "mtu": args.mtu,
        "interface": cluster.interface, "header_bytes_per_packet": HEADER_BYTES_PER_PACKET, "command": command,
        "loss_percent": args.loss, "flap": [],
    }
    status = 1
    try:
        stale = remove_stale_namespaces(cluster.ip)
        if stale:
            print(f"emulated_cluster: removed leftover namespaces of dead runs: {' '.join(stale)}", file=sys.stderr)
        try:
            cluster.build()
        except SetupError as error:
            print(f"emulated_cluster: could not build the emulated cluster: {error}", file=sys.stderr)
            return 2
        report["qdiscs"] = cluster.qdiscs()
        addresses = [cluster.address(i) for i in range(args.nodes)]
        rate = "unshaped" if args.link is None else f"{args.link / 1e6:g} Mbit/s"
        delay = f", one-way delay {args.latency * 1e3:g} ms" if args.latency else ""
        print(f"emulated_cluster: {args.nodes} nodes x {args.nproc_per_node} ranks, links {rate}{delay}; "
              f"namespaces {cluster.prefix}n0..n{args.nodes - 1}, addresses {', '.join(addresses)}",
              file=sys.stderr, flush=True)
        before = cluster.counters()
        start = time.monotonic()
        for i in range(args.nodes):
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            env.update(GLOO_SOCKET_IFNAME=cluster.interface, ZPP_NODE_RANK=str(i), ZPP_NNODES=str(args.nodes),
                       ZPP_MASTER_ADDR=addresses[0], ZPP_NODE_ADDRS=",".join(addresses),
                       ZPP_CLUSTER_IFNAME=cluster.interface, ZPP_CLUSTER_LINK=report["link"])
            if args.raw:
                node_cmd = command
            else:
                node_cmd = [args.python, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                            "--nproc_per_node", str(args.nproc_per_node), *_rendezvous(args, i, addresses),
                            *command]
                if args.max_restarts:
                    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            launcher.start(i, [cluster.ip, "netns", "exec", cluster.namespace(i), *node_cmd], env,
                           prefix_output=not args.no_prefix)
        if args.flap is not None:
            threading.Thread(target=_flap_links, args=(cluster, *args.flap, start, report["flap"]), daemon=True).start()
        status = launcher.wait(args.grace)
        report["wall_s"] = time.monotonic() - start
        after = cluster.counters()
        report["per_node"] = [
            {"node": i, "namespace": cluster.namespace(i), "address": addresses[i], "before": before[i],
             "after": after[i], "delta": delta(before[i], after[i])} for i in range(args.nodes)]
        report["returncode"] = status
        report["drops"] = cluster.drops()
        report["loss_by"] = cluster.loss_by
        for entry in report["per_node"]:
            d = entry["delta"]
            print(f"emulated_cluster: node {entry['node']} {cluster.interface}: sent {d['tx_bytes']} B "
                  f"({d['tx_packets']} packets, ~{d['tx_payload_bytes']} B TCP payload), received {d['rx_bytes']} B "
                  f"({d['rx_packets']} packets)", file=sys.stderr)
        if args.counters_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.counters_json)), exist_ok=True)
            with open(args.counters_json, "w") as handle:
                json.dump(report, handle, indent=2)
        return status
    except KeyboardInterrupt as interrupt:
        print(f"emulated_cluster: interrupted ({interrupt or 'Ctrl-C'}); cleaning up", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not abort the cleanup
        launched_groups = {p.pid for p in launcher.procs}
        launcher.stop()
        _kill_leftovers_in(cluster, launched_groups)
        cluster.destroy()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
