"""Fixtures for the operator tests: the real control plane (session), the CRDs, the operator running for real
under its least-privilege ServiceAccount, and a fresh namespace per test."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import yaml

from diloco_devcluster import testbed as testbed_mod
from diloco_devcluster.cli import install_crds

from polling import wait_for
from cluster_kit import KUBECTL, ROOT, Kubectl
from helm_kit import Helm, helm_binary
from operator_kit import OperatorProcess


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
