"""The namespaced install (manifests/operator-namespaced.yaml): the operator runs as a ServiceAccount holding only
the manifest's Role in one namespace, reconciles and heals a job there, has no right anywhere else, and leaves a
job in another namespace alone."""

from __future__ import annotations

import uuid

import pytest
import yaml

from test_operator_cluster import cpu_units, job, wait_job_ready  # helpers only

from polling import wait_for
from cluster_kit import ROOT, Kubectl
from operator_kit import OperatorProcess

pytestmark = pytest.mark.cluster


def install_namespaced(kubectl: Kubectl, home: str, watched: str) -> str:
    """The manifest's ServiceAccount in `home` and its Role + RoleBinding in `watched` (its Deployment aside:
    the operator runs here as a process); the ServiceAccount's user name."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator-namespaced.yaml").read_text()) if d]
    kubectl.run("create", "namespace", home)
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            doc["metadata"]["namespace"] = home
        elif doc["kind"] in ("Role", "RoleBinding"):
            doc["metadata"]["namespace"] = watched
            for subject in doc.get("subjects", []):
                subject["namespace"] = home
        else:
            continue  # the Namespaces and the Deployment
        kubectl.apply(doc)
    return f"system:serviceaccount:{home}:diloco-operator"


def namespaced_operator(kubectl: Kubectl, testbed, home: str, watched: str, tmp_path) -> OperatorProcess:
    """An operator process (not started) of the namespaced install: `--namespace watched --no-watch-nodes`, talking
    to the apiserver as the ServiceAccount install_namespaced made in `home` (a token of it, nothing else)."""
    token = kubectl.run("create", "token", "diloco-operator", "-n", home, "--duration=1h").stdout.strip()
    config = yaml.safe_load(open(testbed.kubeconfig).read())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "operator"
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    return OperatorProcess(str(tmp_path / "kubeconfig"), tmp_path, ("--namespace", watched, "--no-watch-nodes"))


def can(kubectl: Kubectl, user: str, *args: str) -> bool:
    out = kubectl.run("auth", "can-i", *args, f"--as={user}", check=False)
    return out.stdout.strip() == "yes"


def test_a_namespaced_operator_reconciles_its_namespace_with_only_a_role_and_has_no_right_elsewhere(
        kubectl, operator, ns, testbed, tmp_path):
    home, other = f"op-{uuid.uuid4().hex[:6]}", f"t-{uuid.uuid4().hex[:8]}"
    user = install_namespaced(kubectl, home, ns)
    kubectl.run("create", "namespace", other)
    # It has the Role's rights in its namespace and none anywhere else, nor any cluster-scoped one.
    assert can(kubectl, user, "create", "pods", "-n", ns) and can(kubectl, user, "get", "secrets", "-n", ns)
    for args in (["create", "pods", "-n", other], ["get", "secrets", "-n", other], ["list", "pods", "-A"],
                 ["list", "secrets", "-A"], ["list", "nodes"], ["list", "namespaces"],
                 ["list", "customresourcedefinitions"], ["create", "clusterrolebindings"]):
        assert not can(kubectl, user, *args), f"the namespaced operator may {' '.join(args)}"

    namespaced = namespaced_operator(kubectl, testbed, home, ns, tmp_path)
    operator.stop()  # the session's cluster-wide operator would reconcile these jobs too
    try:
        kubectl.apply(job("elsewhere", cpu_units(1)), "-n", other)  # first: it is there the whole time
        namespaced.start()
        kubectl.apply(job("here", cpu_units(2)), "-n", ns)
        wait_job_ready(kubectl, ns, "here", 2, timeout=120)
        # Healing works from its own watches: a deleted learner pod is replaced.
        (victim, *_) = kubectl.get("pod", ns=ns, selector="diloco.dev/job=here,diloco.dev/component=learner")
        kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        wait_job_ready(kubectl, ns, "here", 2, timeout=60, restarts=1)
        # The job in the other namespace was there all along and was never touched.
        elsewhere = kubectl.get("dj", "elsewhere", ns=other)
        assert "status" not in elsewhere and not elsewhere["metadata"].get("finalizers"), elsewhere
        assert kubectl.get("lu", ns=other) == [] and kubectl.get("pod", ns=other) == []
        log = (tmp_path / f"operator-{namespaced.starts}.log").read_text(errors="replace")
        assert "forbidden" not in log.lower() and "not enough permissions" not in log.lower(), namespaced.log_tail()
    finally:
        namespaced.stop()
        kubectl.run("delete", "namespace", other, home, "--wait=false", check=False)
        operator.start()
