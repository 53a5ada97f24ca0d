"""Fixtures for the operator tests: the real control plane (session), the CRDs, the operator running for real
under its least-privilege ServiceAccount, and a fresh namespace per test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from diloco_devcluster import testbed as testbed_mod
from diloco_devcluster.cli import install_crds

from polling import stop, wait_for
from cluster_kit import KUBECTL, PYTHONPATH, ROOT, Kubectl
from helm_kit import Helm, helm_binary


@pytest.fixture(scope="session")
def testbed():
    """The real control plane. Missing binaries FAIL the run (never skip): CI must exercise a real apiserver."""
    if KUBECTL is None:
        pytest.fail("kubectl is not on PATH; the operator tests drive the cluster with it")
    try:
        tb = testbed_mod.start(log=lambda m: print(f"[testbed] {m}", file=sys.stderr))
    except testbed_mod.TestbedUnavailable as exc:
        pytest.fail(f"cannot start the test control plane: {exc}")
    yield tb
    tb.stop()


@pytest.fixture(scope="session")
def kubectl(testbed) -> Kubectl:
    return Kubectl(testbed)


@pytest.fixture(scope="session")
def crds(testbed, kubectl):
    names = install_crds(testbed)
    for name in names:
        kubectl.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
    return names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`diloco operator` as a subprocess, authenticated as the ServiceAccount from manifests/operator.yaml."""

    def __init__(self, kubeconfig: str, logdir: Path, args: tuple[str, ...] = ()):
        self.kubeconfig = kubeconfig
        # More `diloco operator` flags; by default it follows diloco.dev/syncer-url (the syncers the tests start
        # run on this machine, outside the cluster's Service network).
        self.args = args
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.metrics_port = _free_port()
        self.liveness_port = _free_port()
        self.starts = 0

    def start(self, resync_seconds: float = 10) -> None:
        assert self.proc is None
        self.starts += 1
        log = open(self.logdir / f"operator-{self.starts}.log", "wb")
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONPATH": PYTHONPATH}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_trainer.cli", "operator", "--resync-seconds", str(resync_seconds),
             "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port), "--verbose",
             *(self.args or ("--trust-syncer-url-annotation",))],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        log.close()

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics as {'name{labels}': value}."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_looked_again(self, timeout: float = 60) -> None:
        """Wait until the operator has taken up every object it knows for a reconcile since this call, so that what
        a test then finds unchanged is what the operator decided, not what it has not got to yet. Proof from its
        /metrics: a resync (it queues every known object) after the call, a second one a resync period later, and
        its queue empty after that: each object queued by the first resync has been taken up (and had a period to
        finish its pass), or it was queued again and taken up since."""
        start = self.metrics().get("diloco_operator_resyncs_total", 0.0)

        def looked() -> bool:
            m = self.metrics()
            return m.get("diloco_operator_resyncs_total", 0.0) >= start + 2 and m["diloco_operator_queue_depth"] == 0
        wait_for(looked, timeout, "two operator resyncs after now and its queue drained", 0.2)

    def log_tail(self, lines: int = 40) -> str:
        text = (self.logdir / f"operator-{self.starts}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def _service_account_kubeconfig(testbed, kubectl: Kubectl, path: Path) -> str:
    """Install manifests/operator.yaml (namespace, SA, RBAC) and build a kubeconfig that uses the SA's token."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text()) if d]
    kubectl.apply("---\n".join(yaml.safe_dump(d) for d in docs if d["kind"] != "Deployment"))
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    token = kubectl.run("create", "token", sa["name"], "-n", sa["namespace"], "--duration=6h").stdout.strip()
    config = yaml.safe_load(Path(testbed.kubeconfig).read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "operator"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="session")
def operator(testbed, kubectl, crds, tmp_path_factory):
    """The operator running for real against the control plane, with exactly the RBAC users install."""
    logdir = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(_service_account_kubeconfig(testbed, kubectl, logdir / "kubeconfig"), logdir)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def ns(kubectl, testbed):
    """A fresh namespace (with its default ServiceAccount, which pod admission needs)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", name)
    wait_for(lambda: kubectl.get("serviceaccount", "default", ns=name), 30, what="default ServiceAccount")
    yield name
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    """A real helm (hack/build-helm.sh, cached by version) with private config and cache folders."""
    return Helm(helm_binary(), tmp_path_factory.mktemp("helm"))
