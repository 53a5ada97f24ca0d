"""Reads of real pods shared by the e2e tests: a syncer's status over TLS pinned to the job's CA, a learner's step
from its /metrics, which container of a syncer pod served (from the incarnations on its volume), and containerd's
id of a container."""

from __future__ import annotations

import http.client
import json
import ssl
import time
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


@contextmanager
def job_namespace(kubectl, prefix: str, manifest: dict) -> Iterator[str]:
    """A fresh namespace holding the DilocoJob `manifest`; deleted (with everything in it) afterwards."""
    ns = f"{prefix}-{int(time.time())}"
    kubectl.run("create", "namespace", ns)
    try:
        wait_for(lambda: kubectl.get("serviceaccount", "default", ns=ns), 30, what="default ServiceAccount")
        kubectl.apply(manifest, "-n", ns)
        yield ns
    finally:
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
