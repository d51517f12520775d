#!/usr/bin/env python3
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
* The addresses (10.213.0.0/24 by default, ``--subnet``) exist only on the namespaces' own interfaces; nothing
  is routed out of them, so no traffic leaves the machine.

Each node runs ``torchrun --nnodes N --node_rank i --nproc_per_node D --master_addr <node 0's address>`` with
``GLOO_SOCKET_IFNAME`` set to the node's veth, followed by the command given after ``--`` (with ``--raw`` the
command runs as is, once per node, with ``ZPP_NODE_RANK``/``ZPP_MASTER_ADDR``/``ZPP_NODE_ADDRS`` set). Output
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
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

PREFIX = "zpp-"
_NS_RE = re.compile(r"^zpp-(\d+)-(?:n\d+|sw)$")
COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
# bytes of Ethernet + IPv4 + TCP (with the timestamp option Linux uses by default) headers per packet: the wire
# bytes of a TCP stream minus this per packet are its payload (a pure ACK is exactly this size)
HEADER_BYTES_PER_PACKET = 14 + 20 + 32


class SetupError(RuntimeError):
    pass


def find_tool(name: str) -> str | None:
    path = shutil.which(name)
    if path:
        return path
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def requirements_problem() -> str | None:
    """Why this machine cannot run the emulator, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ("the emulated cluster needs root: it creates network namespaces, veth links and tc qdiscs. "
                "Run it as root (e.g. `sudo .venv/bin/python -m hf_zeropp.testing.emulated_cluster ...`).")
    missing = [tool for tool in ("ip", "tc") if find_tool(tool) is None]
    if missing:
        return (f"the emulated cluster needs the iproute2 tools {' and '.join(missing)} (not found on PATH, /usr/sbin "
                f"or /sbin); install iproute2 (e.g. `apt-get install iproute2`).")
    return None


def namespaces_problem() -> str | None:
    """Why the emulator cannot run here (no root, no iproute2, or a kernel that refuses network namespaces), or
    None: :func:`requirements_problem` plus one namespace made and removed."""
    problem = requirements_problem()
    if problem:
        return problem
    probe = f"{PREFIX}{os.getpid()}-n0"  # this script's naming: a leftover is cleaned by the emulator's next start
    ip = find_tool("ip")
    made = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here ({made.stderr.strip()})"
    subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return None


def parse_rate(text: str) -> int | None:
    """``100mbit`` -> 100_000_000 bits/s; ``none`` -> None. Accepts tc's bit units (kbit, mbit, gbit, bit)."""
    if text.lower() in ("none", "off", "unshaped", "0"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"link rate {text!r}: use e.g. 100mbit, 1gbit, 500kbit or none")
    value, scale, unit = match.groups()
    bits = float(value) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[scale] * (8 if unit == "bps" else 1)
    if bits < 8000:
        raise argparse.ArgumentTypeError(f"link rate {text!r} is below 8kbit")
    return int(bits)


def parse_delay(text: str) -> float | None:
    """``1ms`` -> 0.001 s; ``0``/``none`` -> None."""
    if text.lower() in ("none", "0", "0ms", "0us", "0s"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"latency {text!r}: use e.g. 500us, 1ms, 20ms or none")
    value, unit = match.groups()
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


@dataclass
class Cluster:
    nodes: int
    subnet: ipaddress.IPv4Network
    rate_bits: int | None
    delay_s: float | None
    mtu: int
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")
    ip: str = field(default_factory=lambda: find_tool("ip") or "ip")
    tc: str = field(default_factory=lambda: find_tool("tc") or "tc")
    created: list[str] = field(default_factory=list)
    interface: str = "veth0"  # node-side interface name (names are per namespace)

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        return str(self.subnet.network_address + 1 + node)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise SetupError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def ns(self, namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run(self.ip, "netns", "exec", namespace, *args, check=check)

    def build(self) -> None:
        if self.subnet.num_addresses < self.nodes + 2:
            raise SetupError(f"subnet {self.subnet} is too small for {self.nodes} nodes")
        for name in [self.switch] + [self.namespace(i) for i in range(self.nodes)]:
            self._run(self.ip, "netns", "add", name)
            self.created.append(name)
            self._run(self.ip, "-n", name, "link", "set", "lo", "up")
        sw = self.switch
        self._run(self.ip, "-n", sw, "link", "add", "br0", "type", "bridge")
        self._run(self.ip, "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            node_ns, port = self.namespace(i), f"p{i}"
            # created directly inside the namespaces: no name ever appears in the host's namespace
            self._run(self.ip, "link", "add", self.interface, "netns", node_ns, "mtu", str(self.mtu), "type", "veth",
                      "peer", "name", port, "netns", sw, "mtu", str(self.mtu))
            self._run(self.ip, "-n", sw, "link", "set", port, "master", "br0")
            self._run(self.ip, "-n", sw, "link", "set", port, "up")
            self._run(self.ip, "-n", node_ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev",
                      self.interface)
            self._run(self.ip, "-n", node_ns, "link", "set", self.interface, "up")
            self._shape(node_ns, self.interface, delay=True)  # upload: node -> switch
            self._shape(sw, port, delay=False)  # download: switch -> node
        self._wait_reachable()

    def _shape(self, namespace: str, device: str, delay: bool) -> None:
        parent = ["root"]
        if delay and self.delay_s:
            proc = self.ns(namespace, self.tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", "delay",
                           f"{self.delay_s * 1e6:.0f}us", "limit", "100000", check=False)
            if proc.returncode != 0:
                raise SetupError(
                    f"--latency needs the kernel's netem qdisc (sch_netem), which this kernel does not offer "
                    f"({proc.stderr.strip()}); run with --latency none, or on a kernel with sch_netem")
            parent = ["parent", "1:"]
        if self.rate_bits is None:
            return
        rate_bytes = self.rate_bits / 8
        # burst: >= 1 ms of traffic and >= a few 64 KiB GSO segments, so the bucket never starves TCP;
        # limit: ~50 ms of queue (plus the burst), enough to keep the link busy without unbounded bufferbloat
        burst = int(max(rate_bytes * 1e-3, 3 * 65536))
        limit = int(max(rate_bytes * 0.05, 2 * burst))
        self.ns(namespace, self.tc, "qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf", "rate",
                str(self.rate_bits), "burst", str(burst), "limit", str(limit))

    def _wait_reachable(self) -> None:
        """The bridge forwards after its ports come up; give it a moment (no ping needed: check operstate)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = [self._operstate(self.namespace(i), self.interface) for i in range(self.nodes)]
            if all(s in ("UP", "UNKNOWN") for s in states):
                return
            time.sleep(0.05)
        raise SetupError(f"veth links did not come up: {states}")

    def _operstate(self, namespace: str, device: str) -> str:
        proc = self._run(self.ip, "-n", namespace, "-j", "link", "show", "dev", device, check=False)
        try:
            return json.loads(proc.stdout)[0].get("operstate", "?")
        except (ValueError, IndexError):
            return "?"

    def counters(self) -> list[dict[str, int]]:
        """Byte and packet counters of every node's veth (what left / entered the node over the link)."""
        result = []
        for i in range(self.nodes):
            proc = self._run(self.ip, "-n", self.namespace(i), "-s", "-j", "link", "show", "dev", self.interface)
            stats = json.loads(proc.stdout)[0]["stats64"]
            result.append({"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                           "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]})
        return result

    def qdiscs(self) -> dict[str, str]:
        out = {}
        for i in range(self.nodes):
            out[f"n{i}:{self.interface}"] = self.ns(self.namespace(i), self.tc, "qdisc", "show", "dev",
                                                    self.interface, check=False).stdout.strip()
            out[f"sw:p{i}"] = self.ns(self.switch, self.tc, "qdisc", "show", "dev", f"p{i}", check=False).stdout.strip()
        return out

    def destroy(self) -> None:
        for name in reversed(self.created):
            self._run(self.ip, "netns", "del", name, check=False)
        self.created.clear()


def remove_stale_namespaces(ip: str) -> list[str]:
    """Delete namespaces of *this script's* prefix whose creating process is gone (a run that was SIGKILLed)."""
    proc = subprocess.run([ip, "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NS_RE.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _is_emulator(pid):
            continue  # a parallel run: not ours to touch
        subprocess.run([ip, "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


def _is_emulator(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"emulated_cluster" in handle.read()
    except OSError:
        return False


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


def _signal_to_exception(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["tx_payload_bytes"] = out["tx_bytes"] - HEADER_BYTES_PER_PACKET * out["tx_packets"]
    out["rx_payload_bytes"] = out["rx_bytes"] - HEADER_BYTES_PER_PACKET * out["rx_packets"]
    return out


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
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the veth links; default 1500")
    parser.add_argument("--subnet", type=ipaddress.IPv4Network, default=ipaddress.IPv4Network("10.213.0.0/24"),
                        help="private subnet that exists only inside the namespaces; default 10.213.0.0/24")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--counters-json", help="write the per-node veth counters (before/after/delta) here")
    parser.add_argument("--raw", action="store_true",
                        help="run the command itself once per node instead of under torchrun")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [n<i>]")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs torchrun; default this one")
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

    cluster = Cluster(args.nodes, args.subnet, args.link, args.latency, args.mtu)
    launcher = Launcher()
    previous = {sig: signal.signal(sig, _signal_to_exception) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    report: dict = {
        "nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "link": "none" if args.link is None else
        link_text, "rate_bits_per_s": args.link, "latency_s": args.latency, "mtu": args.mtu,
        "interface": cluster.interface, "header_bytes_per_packet": HEADER_BYTES_PER_PACKET, "command": command,
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
                            "--node_rank", str(i), "--nproc_per_node", str(args.nproc_per_node),
                            "--master_addr", addresses[0], "--master_port", str(args.master_port), *command]
            launcher.start(i, [cluster.ip, "netns", "exec", cluster.namespace(i), *node_cmd], env,
                           prefix_output=not args.no_prefix)
        status = launcher.wait(args.grace)
        report["wall_s"] = time.monotonic() - start
        after = cluster.counters()
        report["per_node"] = [
            {"node": i, "namespace": cluster.namespace(i), "address": addresses[i], "before": before[i],
             "after": after[i], "delta": delta(before[i], after[i])} for i in range(args.nodes)]
        report["returncode"] = status
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
