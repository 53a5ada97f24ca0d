"""Emulated wide-area links on this machine: a network namespace per node, veth pairs to a hub namespace, `tc tbf`
rate limits both ways, and a delay line in the hub (delay + jitter). Nothing touches the host's own namespace.

Command construction is pure (`setup_commands`, `teardown_commands`, ...); `Network` runs it and always removes
what it made (also on errors and Ctrl+C); `remove_leftovers` cleans up after a run that was killed outright.

Topology: node i's namespace holds `wan0` = 10.213.(i+1).2/24, default route via the hub's end `p{i}` =
10.213.(i+1).1. The hub routes between its ports through the delay line's TUN device (policy routing: everything
that did not come out of the TUN goes into it), so a packet from a to b is held for delay(a) + delay(b) (± jitter,
order kept). netem would do the delay in the kernel, but this kernel is built without it (CONFIG_NET_SCH_NETEM).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dlwan-"  # every namespace this module makes: dlwan-<pid>-<hex>-<node>
SUBNET = "10.213"
NODE_IF = "wan0"  # the node's end of its link, the same name in every namespace (GLOO_SOCKET_IFNAME)
TUN = "dlw0"  # the delay line's device in the hub
ROUTE_TABLE = "100"
READY_TIMEOUT_S = 20.0


class NetworkUnavailable(RuntimeError):
    """This machine cannot build the emulated network (not root, or `ip`/`tc` missing)."""


@dataclass(frozen=True)
class Link:
    """One node's link to the hub. `rate_mbit` both ways (None: unlimited); `delay_ms` one way, node to hub."""

    rate_mbit: float | None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if (self.rate_mbit is not None and self.rate_mbit <= 0) or self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"link rate must be > 0 and delays >= 0: {self}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter ({self.jitter_ms} ms) larger than the delay ({self.delay_ms} ms)")

    def describe(self) -> str:
        rate = "unlimited" if self.rate_mbit is None else f"{self.rate_mbit:.3g} Mbit/s"
        return f"{rate}, {self.delay_ms:g}±{self.jitter_ms:g} ms one way"


@dataclass(frozen=True)
class Plan:
    """The namespaces of one emulated network: `nodes` are (name, link) pairs, e.g. ("syncer", Link(...))."""

    tag: str
    nodes: tuple[tuple[str, Link], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.nodes]
        if len(set(names)) != len(names) or not 0 < len(names) <= 250:
            raise ValueError(f"node names must be unique, 1..250 of them: {names}")
        if not self.tag.startswith(PREFIX):
            raise ValueError(f"tag must start with {PREFIX!r}: {self.tag!r}")

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def index(self, node: str) -> int:
        return [n for n, _ in self.nodes].index(node)

    def link(self, node: str) -> Link:
        return dict(self.nodes)[node]

    def address(self, node: str) -> str:
        return f"{SUBNET}.{self.index(node) + 1}.2"

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.ns(n) for n, _ in self.nodes]

    def exec_prefix(self, node: str) -> list[str]:
        """The command prefix that runs a program inside `node`'s namespace."""
        return [tool("ip"), "netns", "exec", self.ns(node)]


def new_plan(nodes: list[tuple[str, Link]]) -> Plan:
    """A plan with a fresh tag naming this process (so `remove_leftovers` can tell a dead run's namespaces)."""
    return Plan(f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}", tuple(nodes))


def tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def setup_commands(plan: Plan) -> list[list[str]]:
    """Namespaces, veth pairs into the hub, addresses, routes, forwarding and the rate limits (before the TUN)."""
    ip = tool("ip")
    cmds = [[ip, "netns", "add", ns] for ns in plan.namespaces()]
    hub = ["-n", plan.hub]
    cmds += [[ip, *hub, "link", "set", "lo", "up"],
             [ip, "netns", "exec", plan.hub, "sysctl", "-qw", "net.ipv4.ip_forward=1",
              "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]]
    for i, (node, link) in enumerate(plan.nodes):
        ns, port, net = plan.ns(node), f"p{i}", f"{SUBNET}.{i + 1}"
        cmds += [[ip, "link", "add", NODE_IF, "netns", ns, "type", "veth", "peer", "name", port, "netns", plan.hub],
                 [ip, "-n", ns, "link", "set", "lo", "up"],
                 [ip, "-n", ns, "addr", "add", f"{net}.2/24", "dev", NODE_IF],
                 [ip, "-n", ns, "link", "set", NODE_IF, "up"],
                 [ip, "-n", ns, "route", "add", "default", "via", f"{net}.1"],
                 [ip, *hub, "addr", "add", f"{net}.1/24", "dev", port],
                 [ip, *hub, "link", "set", port, "up"]]
        cmds += shaping_commands(ns, NODE_IF, link) + shaping_commands(plan.hub, port, link)
    return cmds


def shaping_commands(ns: str, dev: str, link: Link) -> list[list[str]]:
    """tbf on `dev`'s egress: the link's rate, a burst of a few packets, at most ~1 s of queue (no drops)."""
    if link.rate_mbit is None:
        return []
    bits = link.rate_mbit * 1e6
    burst = max(16_000, int(bits / 8 / 100))  # bytes; >= 10 ms at the rate
    limit = max(64_000, int(bits / 8 * 1.0))  # bytes of queue: one second at the rate
    return [[tool("tc"), "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits:.0f}bit",
             "burst", str(burst), "limit", str(limit)]]


def routing_commands(plan: Plan) -> list[list[str]]:
    """Once the delay line's TUN exists in the hub: what arrives from a port goes through it, what it writes back is
    routed to the destination's port."""
    ip, hub = tool("ip"), ["-n", plan.hub]
    return [[ip, *hub, "link", "set", TUN, "up"],
            [ip, *hub, "route", "add", "default", "dev", TUN, "table", ROUTE_TABLE],
            [ip, *hub, "rule", "add", "iif", TUN, "lookup", "main", "pref", "100"],
            [ip, *hub, "rule", "add", "iif", "lo", "lookup", "main", "pref", "101"],
            [ip, *hub, "rule", "add", "lookup", ROUTE_TABLE, "pref", "200"]]


def delay_line_argv(plan: Plan) -> list[str]:
    """The delay line, run inside the hub namespace (see delayline.py)."""
    links = [f"{plan.address(n)}={link.delay_ms:g},{link.jitter_ms:g}" for n, link in plan.nodes]
    return [*[tool("ip"), "netns", "exec", plan.hub], sys.executable, "-m", "diloco_bench.delayline", "--tun", TUN,
            *links]


def teardown_commands(namespaces: list[str]) -> list[list[str]]:
    """Deleting a namespace deletes the veth ends, bridge ports and TUN inside it (and with them their peers)."""
    return [[tool("ip"), "netns", "del", ns] for ns in namespaces]


def ours(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


def stale(names: list[str], alive=lambda pid: Path(f"/proc/{pid}").exists()) -> list[str]:
    """Namespaces of this module whose creating process is gone (a run killed before its cleanup)."""
    out = []
    for n in ours(names):
        pid = n[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not alive(int(pid)):
            out.append(n)
    return out


def list_namespaces() -> list[str]:
    out = subprocess.run([tool("ip"), "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def check_host(euid: int | None = None, find=tool) -> None:
    """Raise NetworkUnavailable with the reason if namespaces cannot be made here (`euid`, `find`: for tests)."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise NetworkUnavailable("the WAN emulation makes network namespaces and needs root (run as root, or in a "
                                 "container with CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    for name in ("ip", "tc"):
        if not os.access(find(name), os.X_OK):
            raise NetworkUnavailable(f"`{name}` not found (PATH or /usr/sbin): install iproute2")
    if not os.path.exists("/dev/net/tun"):
        raise NetworkUnavailable("/dev/net/tun is missing: the delay line needs the TUN driver")


def end_processes_in(ns: str) -> None:
    """SIGKILL every process living in namespace `ns` (`ip netns pids`)."""
    out = subprocess.run([tool("ip"), "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_leftovers() -> list[str]:
    """Delete namespaces of earlier runs whose process died before cleaning up; returns their names."""
    gone = stale(list_namespaces())
    for ns in gone:
        end_processes_in(ns)
    for cmd in teardown_commands(gone):
        subprocess.run(cmd, capture_output=True)
    return gone


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


class Network:
    """The plan's namespaces, links and delay line, for the duration of a `with` block; removed on the way out."""

    def __init__(self, plan: Plan, log_path: Path | None = None):
        self.plan = plan
        self.log_path = log_path
        self.delay_line: subprocess.Popen | None = None

    def __enter__(self) -> "Network":
        check_host()
        remove_leftovers()
        try:
            for cmd in setup_commands(self.plan):
                _run(cmd)
            self._start_delay_line()
            for cmd in routing_commands(self.plan):
                _run(cmd)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_delay_line(self) -> None:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.delay_line = subprocess.Popen(
                [sys.executable, "-m", "diloco_trainer.runtime.guard", str(os.getpid()), *delay_line_argv(self.plan)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        line = _readline(self.delay_line, READY_TIMEOUT_S)
        if line.strip() != b"ready":
            raise RuntimeError(f"the delay line did not start (said {line!r}; exit {self.delay_line.poll()})")

    def close(self) -> None:
        """Stop the delay line, delete every namespace of the plan; raise if any is left."""
        if self.delay_line is not None:
            self.delay_line.terminate()
            try:
                self.delay_line.wait(10)
            except subprocess.TimeoutExpired:
                self.delay_line.kill()
                self.delay_line.wait()
            self.delay_line.stdout.close()
            self.delay_line = None
        mine = set(self.plan.namespaces())
        present = [n for n in list_namespaces() if n in mine]
        # A process still inside would keep its namespace (and the veth in it) alive after the name is gone: only
        # processes this run started can be in there.
        for ns in present:
            end_processes_in(ns)
        for cmd in teardown_commands(present):
            subprocess.run(cmd, capture_output=True)
        left = [n for n in list_namespaces() if n in mine]
        if left:
            raise RuntimeError(f"network namespaces left behind: {left} (remove with `ip netns del NAME`)")

    # ------------------------------------------------------------------ helpers for users of the network

    def launch(self, node: str) -> list[str]:
        return self.plan.exec_prefix(node)

    def address(self, node: str) -> str:
        return self.plan.address(node)


def _readline(proc: subprocess.Popen, timeout: float) -> bytes:
    """One line of `proc`'s stdout, or b"" if it exits or stays silent for `timeout` seconds."""
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 256)
            if not chunk:
                return buf
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0] + b"\n"
        elif proc.poll() is not None:
            return buf
    return buf


# ---------------------------------------------------------------------- probing a link (tests and the benchmark)

PROBE_PORT = 9471


def probe(net: Network, src: str, dst: str, nbytes: int, timeout: float = 120.0) -> dict:
    """Round-trip time (TCP connect, best of 3) and throughput (`nbytes` sent) from node `src` to node `dst`."""
    server = subprocess.Popen([*net.launch(dst), sys.executable, "-m", "diloco_bench.netns", "serve"],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        if _readline(server, READY_TIMEOUT_S).strip() != b"ready":
            raise RuntimeError("the probe server did not start")
        out = subprocess.run([*net.launch(src), sys.executable, "-m", "diloco_bench.netns", "send", net.address(dst),
                              str(nbytes)], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"probe {src} -> {dst} failed: {out.stderr.strip()[-500:]}")
        import json

        return json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait(10)
        server.stdout.close()


def _serve() -> None:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", PROBE_PORT))
        s.listen()
        print("ready", flush=True)
        while True:
            conn, _ = s.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass
                conn.sendall(b"k")


def _send(host: str, nbytes: int) -> None:
    import json
    import socket

    rtts = []
    for _ in range(3):
        t = time.perf_counter()
        socket.create_connection((host, PROBE_PORT), timeout=30).close()
        rtts.append(time.perf_counter() - t)
    with socket.create_connection((host, PROBE_PORT), timeout=60) as conn:
        t = time.perf_counter()
        conn.sendall(bytes(nbytes))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        elapsed = time.perf_counter() - t
    print(json.dumps({"rtt_s": min(rtts), "rtts_s": rtts, "bytes": nbytes, "seconds": elapsed,
                      "mbit_per_s": nbytes * 8 / elapsed / 1e6}))


if __name__ == "__main__":  # the probe's two ends, run inside namespaces by `probe`
    if sys.argv[1] == "serve":
        _serve()
    else:
        _send(sys.argv[2], int(sys.argv[3]))
