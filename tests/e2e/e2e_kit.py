"""Reads of real pods shared by the e2e tests: a syncer's status over TLS pinned to the job's CA, a learner's step
from its /metrics, which container of a syncer pod served (from the incarnations on its volume), containerd's id of a
container and what the kernel says of its process; the (watched, restricted) namespace a job runs in."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polling import wait_for

SYNCER_PORT, METRICS_PORT = 8470, 8471


class PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address (a pod IP) verifying the certificate as `server_name` against `ca` only."""

    def __init__(self, host: str, port: int, server_name: str, ca: str, timeout: float = 3.0):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context(cadata=ca))
        self.server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.server_name)


def syncer_status(pod: dict | None, server_name: str, ca: str, token: str, timeout: float = 3.0) -> dict | None:
    """A syncer pod's /v1/status over TLS verified against `ca` under `server_name` (its Service's name); None while
    nobody in the pod answers."""
    ip = (pod or {}).get("status", {}).get("podIP")
    if not ip:
        return None
    conn = PinnedHTTPS(ip, SYNCER_PORT, server_name, ca, timeout)
    try:
        conn.request("GET", "/v1/status", headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def learner_step(pod: dict) -> int | None:
    """The inner step a learner pod reports on its own /metrics (None while it does not answer)."""
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return None
    try:
        text = urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=2).read().decode()
    except (urllib.error.URLError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith("diloco_learner_step{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def container_id(pod: dict, name: str) -> str:
    status = next(c for c in pod["status"]["containerStatuses"] if c["name"] == name)
    return status["containerID"].split("://", 1)[1]


def pv_dir(kubectl, ns: str, claim: str) -> Path:
    """The host directory of a claim's local PersistentVolume (the real node is this machine)."""
    pvc = kubectl.get("pvc", claim, ns=ns)
    pv = kubectl.get("persistentvolumes", pvc["spec"]["volumeName"])
    return Path(pv["spec"]["local"]["path"])


def container_of(incarnation: dict) -> str:
    """Which container of a syncer pod an incarnation (a line of STATE_DIR/incarnations.jsonl) ran in: the standby container's process was started with
    --standby, the syncer container's without (PIDs say nothing: each is PID 1 of its own container)."""
    return "standby" if incarnation["standby"] else "syncer"


RESTRICTED = "pod-security.kubernetes.io/enforce"


@contextmanager
def job_namespace(kubectl, ns: str, *manifests: dict) -> Iterator[str]:
    """Namespace `ns` (one the operator watches, conftest.JOB_NAMESPACES) holding `manifests` (the DilocoJob last);
    afterwards the jobs and claims in it are deleted. The namespace stays, as a user's does: the namespaced operator
    holds its Role there."""
    labels = kubectl.get("namespaces", ns)["metadata"].get("labels", {})
    assert labels.get(RESTRICTED) == "restricted", f"namespace {ns} is not under Pod Security restricted: {labels}"
    try:
        wait_for(lambda: kubectl.get("serviceaccount", "default", ns=ns), 30, what="default ServiceAccount")
        for manifest in manifests:
            kubectl.apply(manifest, "-n", ns)
        yield ns
    finally:
        kubectl.run("delete", "dilocojobs,persistentvolumeclaims", "--all", "-n", ns, "--wait=false", check=False)


def pid_of(container: str) -> str:
    """The host PID of a real container's main process."""
    tasks = subprocess.run(["ctr", "-n", "k8s.io", "tasks", "ls"], capture_output=True, text=True, check=True)
    return next(line.split()[1] for line in tasks.stdout.splitlines()[1:] if line.split()[0] == container)


def process_of(container: str) -> dict[str, str]:
    """What the kernel says of a real container's main process: its /proc status fields (Uid, NoNewPrivs, Seccomp,
    CapEff, ...) and, as `mount <path>`, the options of each mount point it sees."""
    proc = Path("/proc") / pid_of(container)
    fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
    out = {k: v.strip() for k, v in fields.items()}
    for line in (proc / "mountinfo").read_text().splitlines():  # later mounts over a path win
        parts = line.split()
        out[f"mount {parts[4]}"] = parts[5]
    return out


def metric_of(pod: dict, name: str) -> float | None:
    """One series' value on a learner pod's /metrics (the first line starting `name{`), None while it does not answer."""
    ip = pod.get("status", {}).get("podIP")
    try:
        text = urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=2).read().decode()
    except (urllib.error.URLError, OSError):
        return None
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")), None)


def supervised_learner(pod: dict) -> tuple[int, bool] | None:
    """The host PID of the learner process `diloco pod-learner` (the learner container's PID 1) supervises, and
    whether a warm spare waits beside it; None while its processes.json names no live learner."""
    sup = Path("/proc") / pid_of(container_id(pod, "learner"))
    works = list((sup / "root" / "tmp").glob("diloco-pod-learner-*"))
    try:
        entry = json.loads((works[0] / "processes.json").read_text())["processes"][0]
    except (IndexError, OSError, ValueError, KeyError):
        return None
    if not entry["alive"]:
        return None
    spare = any((d / "ready").exists() for d in (works[0] / "spares").glob("spare-*") if not (d / "assignment.json").exists())
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        nspid = status.get("NSpid", "").split()
        if status.get("PPid", "").strip() == sup.name and len(nspid) >= 2 and int(nspid[-1]) == entry["pid"]:
            return int(nspid[0]), spare
    return None
