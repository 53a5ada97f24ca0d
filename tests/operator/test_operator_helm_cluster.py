"""`helm install` / `upgrade` / `uninstall` of charts/decoupled-diloco against a control plane of its own (no CRDs,
no operator RBAC installed beforehand, so everything found is what Helm made). kwok runs no containers: the tests
check the API objects Helm creates, changes and removes, that Pod Security admits the operator's pod, that the
ServiceAccount holds exactly the chart's rights, and that the CRDs Helm installed serve DilocoJobs."""

from __future__ import annotations

import sys

import pytest
import yaml

from diloco_devcluster import testbed as testbed_mod

from cluster_kit import ROOT, Kubectl
from helm_kit import CHART, RELEASE, Helm
from polling import wait_for

pytestmark = pytest.mark.cluster

HOME = "diloco-system"
OPERATOR = f"system:serviceaccount:{HOME}:diloco-operator"
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A control plane of this module's own: kubectl and a helm bound to it."""
    try:
        tb = testbed_mod.start(workdir=tmp_path_factory.mktemp("helm-testbed"),
                               log=lambda m: print(f"[helm testbed] {m}", file=sys.stderr))
    except testbed_mod.TestbedUnavailable as exc:
        pytest.fail(f"cannot start the test control plane: {exc}")
    yield tb
    tb.stop()


@pytest.fixture(scope="module")
def kube(bare) -> Kubectl:
    return Kubectl(bare)


@pytest.fixture(scope="module")
def helm_here(helm, bare, tmp_path_factory) -> Helm:
    return Helm(helm.binary, tmp_path_factory.mktemp("helm-home"), bare.kubeconfig)


def can(kube: Kubectl, *args: str) -> bool:
    return kube.run("auth", "can-i", *args, f"--as={OPERATOR}", check=False).stdout.strip() == "yes"


def deployment(kube: Kubectl) -> dict | None:
    return kube.get("deployment", "diloco-operator", ns=HOME)


def container(kube: Kubectl) -> dict:
    return deployment(kube)["spec"]["template"]["spec"]["containers"][0]


def test_helm_installs_upgrades_and_uninstalls_the_operator(kube, helm_here):
    kube.run("create", "namespace", HOME)
    kube.run("label", "namespace", HOME, *RESTRICTED)
    kube.run("create", "namespace", "team-a")
    assert kube.run("get", "crd", "-o", "name").stdout.strip() == "", "this control plane must start without CRDs"

    # install with the defaults: the CRDs (from the chart's crds/), the ServiceAccount, the Deployment, and rights in
    # the release's own namespace only (issue 38, Medium 6): no ClusterRole, no right in team-a, none on Nodes.
    helm_here.run("install", RELEASE, str(CHART), "--namespace", HOME)
    for crd in ("dilocojobs.diloco.dev", "learnerunits.diloco.dev"):
        kube.run("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    assert kube.get("serviceaccount", "diloco-operator", ns=HOME) is not None
    assert kube.run("get", "clusterrole", "diloco-operator", check=False).returncode != 0
    assert can(kube, "create", "pods", "-n", HOME) and not can(kube, "create", "pods", "-n", "team-a")
    assert not can(kube, "list", "nodes")
    assert container(kube)["command"] == ["diloco", "operator", f"--namespace={HOME}", "--no-watch-nodes",
                                          "--metrics-port=8080", "--liveness-port=8081"]

    # upgrade to the cluster-wide install, an explicit choice: the ClusterRole is manifests/operator.yaml's.
    helm_here.run("upgrade", RELEASE, str(CHART), "--namespace", HOME, "--set", "clusterWide=true")
    wait_for(lambda: kube.run("get", "role", "diloco-operator", "-n", HOME, check=False).returncode != 0, 30,
             "the Role in the release's namespace removed")
    (manifest_role,) = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
                        if d and d["kind"] == "ClusterRole"]
    role = yaml.safe_load(kube.run("get", "clusterrole", "diloco-operator", "-o", "yaml").stdout)
    assert role["rules"] == manifest_role["rules"]
    assert role["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert can(kube, "create", "pods", "-n", "team-a") and can(kube, "list", "nodes")
    assert not can(kube, "list", "secrets", "-n", "team-a") and not can(kube, "create", "namespaces")
    assert container(kube)["command"] == ["diloco", "operator", "--metrics-port=8080", "--liveness-port=8081"]
    # The hardened pod is admitted by Pod Security `restricted` (the ReplicaSet controller creates it).
    wait_for(lambda: kube.get("pod", ns=HOME, selector="app.kubernetes.io/name=diloco-operator"), 60,
             "the operator's pod admitted in the restricted namespace")
    # The CRDs Helm installed serve DilocoJobs: the sample job is accepted, a malformed one refused by field.
    job = yaml.safe_load((ROOT / "manifests" / "cpu-job.yaml").read_text())
    kube.apply(job, "-n", "team-a")
    assert kube.get("dj", "cpu-demo", ns="team-a")["spec"]["units"][0]["count"] == 2
    job["metadata"]["name"], job["spec"]["units"][0]["count"] = "bad", -1
    refused = kube.apply(job, "-n", "team-a", check=False)
    assert refused.returncode and "count" in refused.stderr, refused.stderr

    # upgrade, a value changed: the Deployment follows.
    generation = deployment(kube)["metadata"]["generation"]
    helm_here.run("upgrade", RELEASE, str(CHART), "--namespace", HOME, "--set", "clusterWide=true",
                  "--set", "resources.limits.memory=1Gi",
                  "--set", "extraArgs={--workers=8}")
    assert container(kube)["resources"]["limits"]["memory"] == "1Gi"
    assert container(kube)["command"][-1] == "--workers=8"
    assert deployment(kube)["metadata"]["generation"] > generation
    # Helm never upgrades CRDs; the documented way, kubectl apply of the chart's crds/, works over Helm's own.
    applied = kube.run("apply", "-f", str(CHART / "crds"))
    assert applied.stdout.count("customresourcedefinition.apiextensions.k8s.io/") == 2, applied.stdout

    # upgrade to the namespaced install: the ClusterRole goes, a Role in team-a comes, and the operator is told.
    helm_here.run("upgrade", RELEASE, str(CHART), "--namespace", HOME, "--set", "watchNamespaces={team-a}")
    wait_for(lambda: kube.run("get", "clusterrole", "diloco-operator", check=False).returncode != 0, 30,
             "the ClusterRole removed")
    assert kube.run("get", "role", "diloco-operator", "-n", "team-a", check=False).returncode == 0
    assert "--namespace=team-a" in container(kube)["command"]
    assert "--no-watch-nodes" in container(kube)["command"]
    assert can(kube, "create", "pods", "-n", "team-a")
    assert not can(kube, "create", "pods", "-n", "default") and not can(kube, "list", "nodes")

    # upgrade, namespaced with read on Nodes and the metrics Service: the one cluster-wide right is reading Nodes.
    helm_here.run("upgrade", RELEASE, str(CHART), "--namespace", HOME, "--reuse-values", "--set", "watchNodes=true",
                  "--set", "metrics.service.enabled=true")
    assert can(kube, "list", "nodes") and not can(kube, "delete", "nodes")
    assert not can(kube, "create", "pods", "-n", "default")
    assert "--no-watch-nodes" not in container(kube)["command"]
    service = kube.get("services", "diloco-operator-metrics", ns=HOME)
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "diloco-operator"}
    assert service["spec"]["ports"][0]["port"] == 8080
    history = helm_here.run("history", RELEASE, "--namespace", HOME, "-o", "json").stdout
    assert [r["revision"] for r in yaml.safe_load(history)] == [1, 2, 3, 4, 5]

    # uninstall: every object the chart made is gone; the CRDs and the jobs stay (Helm never deletes CRDs).
    helm_here.run("uninstall", RELEASE, "--namespace", HOME)
    wait_for(lambda: deployment(kube) is None and kube.get("serviceaccount", "diloco-operator", ns=HOME) is None,
             60, "the Deployment and ServiceAccount removed")
    assert kube.get("services", "diloco-operator-metrics", ns=HOME) is None
    assert kube.run("get", "role,rolebinding", "-n", "team-a", "-o", "name").stdout.strip() == ""
    for kind in ("clusterrole", "clusterrolebinding"):
        assert kube.run("get", kind, "diloco-operator-nodes", check=False).returncode != 0
    assert kube.get("dj", "cpu-demo", ns="team-a") is not None
    assert helm_here.run("list", "--namespace", HOME, "-q").stdout.strip() == ""
