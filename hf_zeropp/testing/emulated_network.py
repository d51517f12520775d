"""The network half of the emulated cluster: Linux network namespaces joined by veth links through a bridge, each
node's link shaped with ``tc`` (token bucket for the rate, ``netem`` for delay and packet loss), the links' byte
counters, and the checks that say whether this machine can build it (root, iproute2, namespaces). On kernels without
``sch_netem``, packet loss is a tiny eBPF program on the link's ``clsact`` egress hook that drops each packet with the
given probability (``bpf_get_prandom_u32``), compiled from LLVM IR with ``llc``. :mod:`.emulated_cluster` runs
torchrun on it."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def netem_problem() -> str | None:
    """Why delay cannot be emulated here (the kernel lacks sch_netem, or no namespaces), or None."""
    problem = namespaces_problem()
    if problem:
        return problem
    added = _on_probe_loopback(["qdisc", "add", "dev", "lo", "root", "netem", "loss", "1%"])
    return None if added.returncode == 0 else f"this kernel has no netem qdisc (sch_netem): {added.stderr.strip()}"


def loss_problem() -> str | None:
    """Why packet loss cannot be emulated here (neither netem nor the eBPF dropper works), or None."""
    netem = netem_problem()
    if netem is None:
        return None
    if namespaces_problem() is not None:
        return netem
    try:
        program = loss_program(1.0)
    except SetupError as error:
        return f"{netem}; and no eBPF dropper: {error}"
    added = _on_probe_loopback(["qdisc", "add", "dev", "lo", "clsact"],
                               ["filter", "add", "dev", "lo", "egress", "bpf", "da", "obj", str(program), "sec",
                                "classifier"])
    return None if added.returncode == 0 else f"{netem}; and no eBPF dropper: {added.stderr.strip()}"


def _on_probe_loopback(*tc_commands: list[str]) -> subprocess.CompletedProcess:
    """Run ``tc`` commands on the loopback of a throwaway namespace; the last one's result."""
    probe, ip, tc = f"{PREFIX}{os.getpid()}-n0", find_tool("ip"), find_tool("tc")
    subprocess.run([ip, "netns", "add", probe], capture_output=True)
    try:
        for command in tc_commands:
            done = subprocess.run([ip, "netns", "exec", probe, tc, *command], capture_output=True, text=True)
            if done.returncode != 0:
                break
    finally:
        subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return done


_DROPPER_IR = """target datalayout = "e-m:e-p:64:64-i64:64-i128:128-n32:64-S128"
target triple = "bpf"

@_license = dso_local global [4 x i8] c"GPL\\00", section "license", align 1

define dso_local i32 @drop_random(i8* nocapture readnone %skb) section "classifier" {
entry:
  %prandom = inttoptr i64 7 to i64 ()*
  %draw = call i64 %prandom()
  %low = trunc i64 %draw to i32
  %bucket = urem i32 %low, 1000000
  %drop = icmp ult i32 %bucket, THRESHOLD
  %verdict = select i1 %drop, i32 2, i32 0
  ret i32 %verdict
}
"""  # helper 7 = bpf_get_prandom_u32; verdict 2 = TC_ACT_SHOT (drop), 0 = TC_ACT_OK


def loss_program(percent: float) -> Path:
    """An eBPF object (tc direct-action classifier) that drops ``percent`` % of the packets, compiled with llc."""
    llc = find_tool("llc")
    if llc is None:
        raise SetupError("llc (LLVM's compiler, with the BPF target) is not installed")
    threshold = round(percent * 10_000)  # drops per million packets
    folder = Path(tempfile.gettempdir()) / f"zpp-dropper-{threshold}"
    folder.mkdir(exist_ok=True)
    source = folder / "dropper.ll"
    source.write_text(_DROPPER_IR.replace("THRESHOLD", str(threshold)))
    done = subprocess.run([llc, "-march=bpf", "-filetype=obj", str(source), "-o", str(folder / "dropper.o")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SetupError(f"llc could not build the eBPF dropper: {done.stderr.strip()}")
    return folder / "dropper.o"


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
    loss_percent: float = 0.0  # packets dropped on every node's uplink (netem, else the eBPF dropper)
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")
    ip: str = field(default_factory=lambda: find_tool("ip") or "ip")
    tc: str = field(default_factory=lambda: find_tool("tc") or "tc")
    created: list[str] = field(default_factory=list)
    interface: str = "veth0"  # node-side interface name (names are per namespace)
    loss_by: str | None = None  # what drops the packets of loss_percent

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
        if delay and (self.delay_s or self.loss_percent):
            netem = [*(["delay", f"{self.delay_s * 1e6:.0f}us"] if self.delay_s else []),
                     *(["loss", f"{self.loss_percent:g}%"] if self.loss_percent else [])]
            proc = self.ns(namespace, self.tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", *netem,
                           "limit", "100000", check=False)
            if proc.returncode == 0:
                self.loss_by = "netem"
                parent = ["parent", "1:"]
            elif self.delay_s:
                raise SetupError(
                    f"--latency needs the kernel's netem qdisc (sch_netem), which this kernel does not offer "
                    f"({proc.stderr.strip()}); run without it, or on a kernel with sch_netem")
            else:
                self._drop_randomly(namespace, device)
        if self.rate_bits is None:
            return
        rate_bytes = self.rate_bits / 8
        # burst: >= 1 ms of traffic and >= a few 64 KiB GSO segments, so the bucket never starves TCP;
        # limit: ~50 ms of queue (plus the burst), enough to keep the link busy without unbounded bufferbloat
        burst = int(max(rate_bytes * 1e-3, 3 * 65536))
        limit = int(max(rate_bytes * 0.05, 2 * burst))
        self.ns(namespace, self.tc, "qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf", "rate",
                str(self.rate_bits), "burst", str(burst), "limit", str(limit))

    def _drop_randomly(self, namespace: str, device: str) -> None:
        """``loss_percent`` % packet loss without netem: the eBPF dropper on the device's egress hook."""
        program = loss_program(self.loss_percent)
        self.ns(namespace, self.tc, "qdisc", "add", "dev", device, "clsact")
        self.ns(namespace, self.tc, "filter", "add", "dev", device, "egress", "bpf", "da", "obj", str(program),
                "sec", "classifier")
        self.loss_by = "eBPF dropper on the clsact egress hook (netem is missing)"

    def set_links(self, up: bool) -> None:
        """Every node's link up or down at the switch (a flap of the fabric between nodes; traffic inside a node
        never crosses it)."""
        for i in range(self.nodes):
            self._run(self.ip, "-n", self.switch, "link", "set", f"p{i}", "up" if up else "down")

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

    def drops(self) -> list[dict[str, int]]:
        """Per node, packets its link's queues (and the eBPF dropper) have dropped so far (uplink at the node,
        downlink at the switch)."""
        def dropped(namespace: str, device: str) -> int:
            shown = self.ns(namespace, self.tc, "-s", "-j", "qdisc", "show", "dev", device, check=False).stdout
            return sum(q.get("drops", 0) for q in json.loads(shown or "[]"))

        return [{"uplink": dropped(self.namespace(i), self.interface), "downlink": dropped(self.switch, f"p{i}")}
                for i in range(self.nodes)]

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


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["tx_payload_bytes"] = out["tx_bytes"] - HEADER_BYTES_PER_PACKET * out["tx_packets"]
    out["rx_payload_bytes"] = out["rx_bytes"] - HEADER_BYTES_PER_PACKET * out["rx_packets"]
    return out


