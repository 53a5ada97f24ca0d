"""A real Kueue manager (hack/build-kueue.sh, sigs.k8s.io/kueue) as a process against the test control plane: its CRDs,
its webhooks served over TLS on loopback (a CA of the kit's own: the apiserver calls them at a `url`, since no Service
routes to a process here), and a config with no job integration (the operator creates its Workloads itself)."""

from __future__ import annotations

import base64
import datetime
import os
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from diloco_operator.objects import certs

from cluster_kit import ROOT, Kubectl
from polling import stop, wait_for

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_API = f"/apis/{KUEUE_GROUP}/v1beta2"
# With internal certificate management off, Kueue reads its metrics certificate from this fixed path (cmd/kueue).
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
WEBHOOK_PREFIX = "diloco-test-kueue"


def kueue_dir() -> Path:
    """DILOCO_KUEUE, else the cached build (hack/build-kueue.sh builds it on the first call: several minutes)."""
    if os.environ.get("DILOCO_KUEUE"):
        return Path(os.environ["DILOCO_KUEUE"])
    out = subprocess.run(["bash", str(ROOT / "hack" / "build-kueue.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise AssertionError(f"hack/build-kueue.sh failed (exit {out.returncode}); its log is above")
    return Path(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_pair(folder: Path, pair: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for key in (certs.TLS_CRT, certs.TLS_KEY):
        tmp = folder / f".{key}.tmp"
        tmp.write_text(pair[key])
        tmp.replace(folder / key)  # atomic: a Kueue starting meanwhile reads the old pair or the new one


def webhook_configurations(upstream: list[dict], port: int, ca_pem: str) -> list[dict]:
    """Upstream's webhook configurations for Kueue's own kinds only (no job framework is enabled), renamed, and
    pointing at https://127.0.0.1:`port` with the kit's CA."""
    bundle = base64.b64encode(ca_pem.encode()).decode()
    out = []
    for doc in upstream:
        hooks = [h for h in doc.get("webhooks") or []
                 if all(KUEUE_GROUP in r.get("apiGroups", []) for r in h.get("rules") or [])]
        for h in hooks:
            path = h["clientConfig"]["service"]["path"]
            h["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
        kind = "mutating" if doc["kind"].startswith("Mutating") else "validating"
        out.append({**doc, "metadata": {"name": f"{WEBHOOK_PREFIX}-{kind}"}, "webhooks": hooks})
    return out


class Kueue:
    """The kueue manager process: `start` installs the CRDs and webhooks and waits until it admits."""

    def __init__(self, kubectl: Kubectl, workdir: Path, home: Path | None = None):
        self.kubectl = kubectl
        self.home = home or kueue_dir()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.webhook_port, self.health_port, self.visibility_port = _free_port(), _free_port(), _free_port()

    def install_crds(self) -> None:
        # Server-side: the Workload CRD is too large for client-side apply's last-applied annotation.
        for crd in sorted((self.home / "crds").glob("*.yaml")):
            self.kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        for crd in sorted((self.home / "crds").glob("*.yaml")):
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            self.kubectl.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")

    def _certificates(self) -> str:
        now = datetime.datetime.now(datetime.timezone.utc)
        ca = certs.new_ca("diloco test kueue webhook CA", now)
        _write_pair(self.workdir / "webhook-certs", certs.serving_cert(ca, ["127.0.0.1", "localhost"], now))
        if not (METRICS_CERT_DIR / certs.TLS_CRT).is_file():
            try:
                _write_pair(METRICS_CERT_DIR, certs.serving_cert(ca, ["localhost"], now))
            except PermissionError as exc:
                raise AssertionError(f"Kueue (internal cert management off) reads a metrics certificate from "
                                     f"{METRICS_CERT_DIR}: cannot write one there ({exc}); create it once as root") from None
        return ca[certs.CA_CRT]

    def _config(self) -> Path:
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(self.workdir / "webhook-certs")},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": []},  # the operator makes its Workloads; no job kind is managed
            "featureGates": {"VisibilityOnDemand": False},  # an aggregated API server the tests do not need
        }
        path = self.workdir / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> None:
        assert self.proc is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.install_crds()
        ca_pem = self._certificates()
        self.kubectl.run("create", "namespace", "kueue-system", check=False)
        upstream = [d for d in yaml.safe_load_all((self.home / "webhooks.yaml").read_text()) if d]
        for doc in webhook_configurations(upstream, self.webhook_port, ca_pem):
            self.kubectl.apply(doc)
        log = open(self.workdir / "kueue.log", "wb")
        env = {**os.environ, "KUBECONFIG": self.kubectl.testbed.kubeconfig}
        self.proc = subprocess.Popen(
            [str(self.home / "bin" / "kueue"), f"--config={self._config()}",
             f"--visibility-server-port={self.visibility_port}", "--zap-log-level=2"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=self.workdir)
        log.close()
        wait_for(self._ready, 90, "the kueue manager ready and its webhooks answering", 0.5)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"kueue exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2).read()
        except (urllib.error.URLError, OSError):
            return False
        # The webhooks answer: a dry-run create goes through the apiserver to them.
        probe = {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
        return self.kubectl.apply(probe, "--dry-run=server", check=False).returncode == 0

    def stop(self) -> None:
        for kind in ("mutating", "validating"):
            self.kubectl.run("delete", f"{kind}webhookconfiguration", f"{WEBHOOK_PREFIX}-{kind}", "--wait=false",
                             check=False)
        stop(self.proc)
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        text = (self.workdir / "kueue.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


# --- Kueue objects the tests create (small builders) ---------------------------------------------------------------
def resource_flavor(name: str, node_labels: dict[str, str], tolerations: list[dict] | None = None) -> dict:
    spec: dict = {"nodeLabels": dict(node_labels)}
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": spec}


def cluster_queue(name: str, flavor: str, quota: dict[str, str | int], namespace: str) -> dict:
    """A ClusterQueue with `quota` of `flavor`, open to `namespace` only, whose higher-priority Workloads preempt
    lower ones."""
    return {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [
                         {"name": flavor, "resources": [{"name": r, "nominalQuota": str(q)}
                                                        for r, q in sorted(quota.items())]}]}]}}


def local_queue(name: str, namespace: str, cluster_queue_name: str) -> dict:
    return {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": cluster_queue_name}}


def priority_class(name: str, value: int) -> dict:
    return {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "WorkloadPriorityClass", "metadata": {"name": name},
            "value": value}
