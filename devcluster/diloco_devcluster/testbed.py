"""A real local Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) on loopback,
optionally with a real node (kubelet, kube-proxy, CoreDNS on containerd; see realnode.py) beside the fake pools.

Used by the operator and e2e tests (session fixtures) and by `diloco devcluster`. Binaries come from
hack/build-testbed.sh.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from diloco_devcluster import realnode
from diloco_devcluster.pools import DEFAULT_POOLS, node_objects
from diloco_kube.labels import KWOK_ANNOTATION

VERSIONS = "k8s-1.36.3-etcd-3.6.8-kwok-0.8.0-coredns-1.15.0"  # must match hack/build-testbed.sh
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
# Stages passed to kwok (passing any Stage replaces kwok's defaults, so all needed ones are listed).
STAGES = (
    "node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
    "volume/fast/pv-bind.yaml", "volume/fast/pv-delete.yaml", "volume/fast/pvc-provision.yaml",
    "volume/fast/pvc-delete.yaml",
)
ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-testbed.sh"


class TestbedUnavailable(RuntimeError):
    """The binaries are missing or the control plane did not come up; the message says why and what to run."""

    __test__ = False  # not a pytest test class


def default_dir() -> Path:
    """Where hack/build-testbed.sh caches this version's binaries (DILOCO_TESTBED_DIR wins when set)."""
    if os.environ.get("DILOCO_TESTBED_DIR"):
        return Path(os.environ["DILOCO_TESTBED_DIR"])
    cache = Path(os.environ.get("DILOCO_TESTBED_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                 / "diloco-testbed")
    return cache / VERSIONS


def check_binaries(testbed_dir: Path) -> None:
    """Raise TestbedUnavailable naming every missing binary or stage file and the command that builds them."""
    missing = [b for b in BINARIES if not os.access(testbed_dir / "bin" / b, os.X_OK)]
    missing += [s for s in STAGES if not (testbed_dir / "stages" / s).is_file()]
    if missing:
        raise TestbedUnavailable(
            f"testbed binaries missing in {testbed_dir}: {', '.join(missing)}; build them with "
            f"`bash {BUILD_SCRIPT}` (cold build 10-25 min) and export DILOCO_TESTBED_DIR=<its last output line>"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_pki(pki: Path) -> None:
    """A CA, a serving cert for 127.0.0.1/localhost (and, for pods, the bridge gateway and the `kubernetes`
    Service), and the service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "3650", "-subj", "/CN=diloco-testbed-ca", cwd=pki)
    ext = pki / "san.ext"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,IP:{realnode.GATEWAY},IP:{realnode.KUBERNETES_SERVICE_IP},"
                   "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
                   "DNS:kubernetes.default.svc.cluster.local\n"
                   "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=pki)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "3650", "-extfile", "san.ext", cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


@dataclass
class Testbed:
    """A running control plane: where it lives, how to reach it, and the PIDs to stop."""

    workdir: str
    kubeconfig: str
    server: str
    token: str
    pids: dict[str, int] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)  # each process's command line (start_process)
    etcd_dir: str = ""
    bin_dir: str = ""
    real_node: bool = False  # a kubelet runs pods for real (realnode.py)
    engine_started: bool = False  # `start` started the container engine, so `stop` stops it

    # --- API access (synchronous: used only outside event loops, by fixtures and the CLI) ---
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
        """One authenticated API call; raises urllib.error.HTTPError on a non-2xx answer."""
        ctx = ssl.create_default_context(cafile=str(Path(self.workdir) / "pki" / "ca.crt"))
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
        })
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}

    def create(self, path: str, obj: dict) -> dict:
        """Create an object, tolerating one that already exists (bootstrap is idempotent)."""
        try:
            return self.request("POST", path, obj)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise
            return {}

    def spawn(self, name: str, argv: list[str]) -> None:
        """Start a process of the testbed, its output appended to logs/<name>.log; `stop` stops it."""
        out = open(Path(self.workdir) / "logs" / f"{name}.log", "ab")
        # A new session: the processes outlive `diloco devcluster up` and ignore the terminal's Ctrl-C.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        self.pids[name], self.commands[name] = proc.pid, argv
        self.save()

    def stop_process(self, name: str, grace_s: float = 10.0) -> None:
        """Stop one process as its service manager would (SIGTERM, SIGKILL after `grace_s`), e.g. the real node's
        kubelet: its containers keep running, as they do when a node's kubelet stops. `start_process` starts it again."""
        stop_pids({name: self.pids[name]}, grace_s=grace_s)

    def start_process(self, name: str) -> None:
        """Start a process stopped by `stop_process` again, with the command line it had."""
        if _pid_alive(self.pids[name]):
            raise RuntimeError(f"{name} (pid {self.pids[name]}) is running")
        self.spawn(name, self.commands[name])

    def alive(self) -> dict[str, bool]:
        """Which of the started processes are still running."""
        return {name: _pid_alive(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        """Stop every process by PID (newest first), then remove the working directories. A real node is
        drained first (controllers stopped, its pods deleted, their containers gone), then torn down."""
        self.stop_processes()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.etcd_dir:
            shutil.rmtree(self.etcd_dir, ignore_errors=True)

    def stop_processes(self) -> None:
        """Stop every process (a real node drained and torn down first); the working directory stays."""
        if self.real_node and self.pids:
            self._stop_real_node()
        stop_pids(self.pids)
        self.pids = {}

    def _stop_real_node(self) -> None:
        controllers = ("kube-controller-manager", "kube-scheduler", "kwok")
        stop_pids({n: p for n, p in self.pids.items() if n in controllers})
        if self.alive().get("kube-apiserver") and self.alive().get("kubelet"):
            realnode.drain(self.request)
        else:
            realnode.drain(lambda *_a, **_k: {})  # no API: kill the containers through containerd
        stop_pids({n: p for n, p in self.pids.items() if n in realnode.BINARIES})
        realnode.cleanup(Path(self.workdir), Path(self.bin_dir))
        if self.engine_started:
            realnode.engine("down")

    def save(self) -> Path:
        path = Path(self.workdir) / "testbed.json"
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, workdir: str | Path) -> "Testbed":
        return cls(**json.loads((Path(workdir) / "testbed.json").read_text()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def stop_pids(pids: dict[str, int], grace_s: float = 5.0) -> None:
    """SIGTERM each PID in reverse start order, SIGKILL whatever outlives the grace period."""
    order = list(pids.items())[::-1]
    for _, pid in order:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for _, pid in order:
        while _pid_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.05)
        if _pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_by = time.monotonic() + 2.0  # return only once it is gone (ports and files free)
        while _pid_alive(pid) and time.monotonic() < killed_by:
            _reap(pid)
            time.sleep(0.02)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kubeconfig(server: str, ca: Path, token: str, user: str = "admin") -> dict:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "diloco-testbed",
        "clusters": [{"name": "diloco-testbed", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "diloco-testbed", "context": {"cluster": "diloco-testbed", "user": user,
                                                             "namespace": "default"}}],
    }


PORT_ATTEMPTS = 3  # a start whose port was taken meanwhile is tried again on other ports, this often in all


def start(testbed_dir: Path | None = None, workdir: Path | None = None, *, pools=DEFAULT_POOLS,
          real_node: bool = False, log: Callable[[str], None] = lambda _m: None, timeout_s: float = 120.0) -> Testbed:
    """Start the control plane, wait for /readyz, create the fake node pools; with `real_node`, also a real
    node (pool `real-cpu`) that takes the place of the fake `cpu` pool. Stops everything on failure.

    The ports are free when picked but only bound when each process starts: on a busy machine another process (an
    outgoing connection's ephemeral port, often) can take one in between. A start that failed so is made again on
    new ports (seen in CI: a second control plane's apiserver, `bind: address already in use`)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _start(testbed_dir, workdir, pools=pools, real_node=real_node, log=log, timeout_s=timeout_s)
        except TestbedUnavailable as exc:
            if "address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
            log(f"a port was taken before its process bound it (attempt {attempt} of {PORT_ATTEMPTS}); "
                "starting again on other ports")
    raise AssertionError("unreachable")


def _start(testbed_dir: Path | None, workdir: Path | None, *, pools, real_node: bool,
           log: Callable[[str], None], timeout_s: float) -> Testbed:
    testbed_dir = Path(testbed_dir or default_dir())
    check_binaries(testbed_dir)
    bin_dir = testbed_dir / "bin"
    if real_node:
        try:
            realnode.check_host(bin_dir)
        except realnode.RealNodeUnavailable as exc:
            raise TestbedUnavailable(str(exc)) from exc
        pools = tuple(p for p in pools if p.name != "cpu")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="diloco-testbed-"))
    work.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    etcd_dir = Path(tempfile.mkdtemp(prefix="diloco-etcd-", dir=shm))
    (work / "logs").mkdir(exist_ok=True)
    started = time.monotonic()
    log("generating certificates")
    _make_pki(work / "pki")
    tokens = _write_tokens(work, real_node)
    etcd_port, peer_port, api_port, kwok_port = (_free_port() for _ in range(4))
    server = f"https://127.0.0.1:{api_port}"
    tb = Testbed(str(work), str(work / "kubeconfig"), server, tokens["admin"], etcd_dir=str(etcd_dir),
                 bin_dir=str(bin_dir), real_node=real_node)
    Path(tb.kubeconfig).write_text(yaml.safe_dump(_kubeconfig(server, work / "pki" / "ca.crt", tokens["admin"])))
    pki = work / "pki"

    def spawn(name: str, args: list[str]) -> None:
        tb.spawn(name, [str(bin_dir / name), *args])

    try:
        if real_node:
            tb.engine_started = not realnode.engine("status")
            if tb.engine_started:
                log("starting the container engine (hack/container-engine.sh up)")
                realnode.engine("up", log)
            tb.save()
            realnode.setup_network()
            realnode.pki_extras(pki, _openssl)
        log(f"starting etcd on 127.0.0.1:{etcd_port}")
        spawn("etcd", _etcd_args(etcd_dir, etcd_port, peer_port))
        log(f"starting kube-apiserver on {server}")
        spawn("kube-apiserver", _apiserver_args(work, etcd_port, api_port, real_node))
        _wait_ready(tb, deadline=started + timeout_s, log=log)
        log(f"control plane API ready after {time.monotonic() - started:.1f}s; starting controllers and kwok")
        for name, args in _controller_args(tb.kubeconfig, pki).items():
            spawn(name, args)
        spawn("kwok", _kwok_args(tb.kubeconfig, work, testbed_dir / "stages", kwok_port, real_node))
        _create_storage_and_nodes(tb, work, testbed_dir / "stages", pools, real_node)
        if real_node:
            log(f"starting the real node {realnode.NODE_NAME}: kubelet, kube-proxy, coredns")
            ca = pki / "ca.crt"
            for name, args in realnode.process_args(
                    work, tokens, lambda token, user: _kubeconfig(server, ca, token, user), _free_port).items():
                spawn(name, args)
        _wait_nodes_ready(tb, sum(p.nodes for p in pools) + int(real_node), deadline=started + timeout_s, log=log)
        log(f"testbed up in {time.monotonic() - started:.1f}s: {tb.kubeconfig}")
        return tb
    except BaseException:
        tb.stop_processes()
        if not workdir:  # a temporary dir is ours to remove; a user's dir keeps its logs
            tb.stop()
        raise


def _write_tokens(work: Path, real_node: bool) -> dict[str, str]:
    """The apiserver's static tokens (tokens.csv): the admin's, and with a real node its kubelet's and kube-proxy's."""
    tokens = {who: base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=") for who in ("admin", "node", "proxy")}
    users = [f"{tokens['admin']},admin,admin-uid,system:masters"]
    if real_node:
        users += [f"{tokens['node']},system:node:{realnode.NODE_NAME},node-uid,system:nodes",
                  f"{tokens['proxy']},system:kube-proxy,kube-proxy-uid"]
    (work / "tokens.csv").write_text("\n".join(users) + "\n")
    return tokens


def _etcd_args(etcd_dir: Path, etcd_port: int, peer_port: int) -> list[str]:
    return [
        "--name=testbed", f"--data-dir={etcd_dir}", "--unsafe-no-fsync",
        f"--listen-client-urls=http://127.0.0.1:{etcd_port}", f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
        f"--listen-peer-urls=http://127.0.0.1:{peer_port}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-cluster=testbed=http://127.0.0.1:{peer_port}", "--quota-backend-bytes=2147483648",
        "--log-level=warn",
    ]


def _apiserver_args(work: Path, etcd_port: int, api_port: int, real_node: bool) -> list[str]:
    pki = work / "pki"
    return [
        f"--etcd-servers=http://127.0.0.1:{etcd_port}", f"--secure-port={api_port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--token-auth-file={work / 'tokens.csv'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={realnode.SERVICE_CIDR}",
        "--allow-privileged=true", "--enable-priority-and-fairness=false", "--v=1",
        *(realnode.apiserver_flags(pki) if real_node else [
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            "--authorization-mode=RBAC"]),
    ]


def _controller_args(kubeconfig: str, pki: Path) -> dict[str, list[str]]:
    return {
        "kube-controller-manager": [
            f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--kube-api-qps=200", "--kube-api-burst=400", "--node-monitor-grace-period=60s", "--v=1",
        ],
        "kube-scheduler": [
            f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1",
        ],
    }


def _kwok_args(kubeconfig: str, work: Path, stages: Path, kwok_port: int, real_node: bool) -> list[str]:
    """kwok for the fake nodes, with its stages; with a real node, volumes are real (static local PVs), so kwok's
    fake volume stages stay out."""
    kwok_stages = [s for s in STAGES if not (real_node and s.startswith("volume/"))]
    (work / "kwok.yaml").write_text("\n---\n".join((stages / s).read_text() for s in kwok_stages))
    return [
        f"--kubeconfig={kubeconfig}", f"--config={work / 'kwok.yaml'}", "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
        f"--server-address=127.0.0.1:{kwok_port}", "--node-ip=10.244.0.1", "--cidr=10.244.0.0/16",
        "--node-lease-duration-seconds=40",
    ]


def _create_storage_and_nodes(tb: Testbed, work: Path, stages: Path, pools, real_node: bool) -> None:
    if real_node:
        for path, obj in realnode.storage_objects(work):
            tb.create(path, obj)
    else:
        sc = yaml.safe_load((stages / "volume" / "fast" / "storage-class.yaml").read_text())
        tb.create("/apis/storage.k8s.io/v1/storageclasses", sc)
    for node in node_objects(pools):
        tb.create("/api/v1/nodes", node)


def tail_logs(work: Path, lines: int = 15) -> str:
    parts = []
    for f in sorted((work / "logs").glob("*.log")):
        tail = f.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {f.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def _wait_ready(tb: Testbed, deadline: float, log: Callable[[str], None]) -> None:
    last = ""
    while time.monotonic() < deadline:
        dead = [n for n, ok in tb.alive().items() if not ok]
        if dead:
            raise TestbedUnavailable(f"{', '.join(dead)} exited during start-up; see {tb.workdir}/logs\n"
                                     + tail_logs(Path(tb.workdir)))
        try:
            if tb.request("GET", "/readyz", timeout=2).get("raw", "").strip() == "ok":
                return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TestbedUnavailable(f"kube-apiserver not ready at {tb.server}/readyz in time ({last})\n"
                             + tail_logs(Path(tb.workdir)))


def _wait_nodes_ready(tb: Testbed, expected: int, deadline: float, log: Callable[[str], None]) -> None:
    while time.monotonic() < deadline:
        items = tb.request("GET", "/api/v1/nodes").get("items", [])
        ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n.get("status", {}).get("conditions", []))]
        if len(ready) >= expected:
            return
        dead = [n for n, ok in tb.alive().items() if not ok]
        if dead:
            raise TestbedUnavailable(f"{', '.join(dead)} exited; see {tb.workdir}/logs\n" + tail_logs(Path(tb.workdir)))
        time.sleep(0.25)
    raise TestbedUnavailable(f"fake nodes not Ready in time (kwok); see {tb.workdir}/logs\n" + tail_logs(Path(tb.workdir)))
