"""Fixtures for the end-to-end tier: the project's images (hack/build-images.sh), a control plane with a real
node (kubelet on containerd, kube-proxy, CoreDNS; realnode.py), the CRDs, and the operator running from its own
image in a real pod as the namespaced install of manifests/operator-namespaced.yaml: its ServiceAccount holds only
the manifest's Role in each job namespace (JOB_NAMESPACES), and every namespace, the operator's own included, is
labelled as the manifest labels it (Pod Security `restricted`, enforced). Nothing here is skipped: a machine that
cannot run real pods fails the tier with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # the operator tests' cluster kit

from polling import wait_for  # noqa: E402
from cluster_kit import ROOT, Kubectl  # noqa: E402
from kueue_kit import Kueue  # noqa: E402
from diloco_devcluster import realnode, testbed as testbed_mod  # noqa: E402
from diloco_devcluster.cli import install_crds  # noqa: E402

OPERATOR_NS = "diloco-system"
# pytest-timeout counts fixture set-up, and the first e2e test of a session also pays for the images
# (hack/build-images.sh: ~8 min with nothing cached, minutes more on a loaded machine) and the real node: every e2e
# test gets this much on top of its own timeout (the ini's 600 s or its mark). Its own waits stay bounded.
SETUP_ALLOWANCE_S = 1800


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            mark = item.get_closest_marker("timeout")
            own = float(mark.args[0]) if mark and mark.args else float(config.getini("timeout") or 600)
            item.add_marker(pytest.mark.timeout(own + SETUP_ALLOWANCE_S), append=False)


# The namespaces the e2e jobs run in (one per test module), watched by the operator from its start: they live for the
# whole session (a namespaced operator whose namespace, and so its Role, is deleted loses its watch there).
JOB_NAMESPACES = ("e2e", "e2e-shards", "e2e-spares", "e2e-kueue")
WATCHED_IN_MANIFEST = "diloco-jobs"  # the one namespace manifests/operator-namespaced.yaml watches


@dataclass(frozen=True)
class Images:
    trainer: str
    operator: str


@pytest.fixture(scope="session")
def images():
    """The trainer and operator images, in containerd's k8s.io namespace: the names given in
    DILOCO_TRAINER_IMAGE / DILOCO_OPERATOR_IMAGE, else built by hack/build-images.sh (cached by content: seconds
    when nothing changed). A container engine this fixture started is stopped at the end of the session."""
    engine_was_up = realnode.engine("status")
    env = {k: os.environ.get(k) for k in ("DILOCO_TRAINER_IMAGE", "DILOCO_OPERATOR_IMAGE")}
    if not all(env.values()):
        out = subprocess.run(["bash", str(ROOT / "hack" / "build-images.sh")], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
        if out.returncode:
            pytest.fail(f"hack/build-images.sh failed (exit {out.returncode}); its log is above")
        for line in out.stdout.splitlines():
            key, _, value = line.partition("=")
            if key in env:
                env[key] = value.strip()
    yield Images(env["DILOCO_TRAINER_IMAGE"], env["DILOCO_OPERATOR_IMAGE"])
    if not engine_was_up:
        realnode.engine("down")
        assert not realnode.engine("status"), "the container engine this session started still answers"


@pytest.fixture(scope="session")
def cluster(images):
    """The control plane with the real node `real-cpu-0` (the fake GPU/TPU pools stay beside it)."""
    try:
        tb = testbed_mod.start(real_node=True, timeout_s=240,
                               log=lambda m: print(f"[e2e testbed] {m}", file=sys.stderr))
    except testbed_mod.TestbedUnavailable as exc:
        pytest.fail(f"cannot start a control plane with a real node: {exc}")
    yield tb
    tb.stop()
    left = [name for name in realnode.BINARIES if subprocess.run(["pgrep", "-x", name]).returncode == 0]
    assert not left, f"the real node's processes outlived its stop: {left}"
    assert not realnode.running_tasks(), "containers still run after the real node stopped"


@pytest.fixture(scope="session")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster)


def operator_manifests(image: str, namespaces: tuple[str, ...] = JOB_NAMESPACES) -> str:
    """manifests/operator-namespaced.yaml as users apply it, with the image this run built and its one watched
    namespace (its Namespace with the manifest's labels, its Role and RoleBinding, its --namespace flag) repeated for
    each of `namespaces`; with --kueue, and the ClusterRole a namespaced install that uses Kueue binds (the
    manifest's header: get on ResourceFlavors and WorkloadPriorityClasses)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator-namespaced.yaml").read_text()) if d]
    out = []
    for doc in docs:
        watched = doc["metadata"].get("namespace") == WATCHED_IN_MANIFEST or (
            doc["kind"] == "Namespace" and doc["metadata"]["name"] == WATCHED_IN_MANIFEST)
        if not watched:
            out.append(doc)
        for ns in namespaces if watched else ():
            copy = yaml.safe_load(yaml.safe_dump(doc))
            copy["metadata"]["name" if doc["kind"] == "Namespace" else "namespace"] = ns
            out.append(copy)
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["image"] = image
            flag = f"--namespace={WATCHED_IN_MANIFEST}"
            assert flag in container["command"], container["command"]
            at = container["command"].index(flag)
            container["command"][at:at + 1] = [f"--namespace={ns}" for ns in namespaces] + ["--kueue"]
    return "---\n".join(yaml.safe_dump(d) for d in out + KUEUE_READ)


# What docs/operator.md ("Kueue", RBAC) tells a namespaced install that uses Kueue to bind: the two cluster-scoped
# reads (the flavor Kueue admitted a unit on, a job's priority class).
KUEUE_READ = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "diloco-operator-kueue"},
     "rules": [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors", "workloadpriorityclasses"],
                "verbs": ["get"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "diloco-operator-kueue"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "diloco-operator-kueue"},
     "subjects": [{"kind": "ServiceAccount", "name": "diloco-operator", "namespace": OPERATOR_NS}]},
]


@dataclass
class OperatorPod:
    kubectl: Kubectl

    def pod(self) -> dict:
        pods = self.kubectl.get("pod", ns=OPERATOR_NS, selector="app.kubernetes.io/name=diloco-operator")
        running = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert len(running) == 1, f"expected one operator pod, found {[p['metadata']['name'] for p in running]}"
        return running[0]

    def logs(self, tail: int = 60) -> str:
        return self.kubectl.run("logs", "-n", OPERATOR_NS, "deploy/diloco-operator", f"--tail={tail}",
                                check=False).stdout

    def metrics(self) -> str:
        ip = self.pod()["status"]["podIP"]
        return urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=5).read().decode()


@pytest.fixture(scope="session")
def kueue(cluster, kubectl, tmp_path_factory) -> Kueue:
    """A real Kueue manager (hack/build-kueue.sh) against the real node's control plane, started before the operator,
    which watches Workloads from its start (--kueue)."""
    manager = Kueue(kubectl, tmp_path_factory.mktemp("kueue"))
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture(scope="session")
def operator_pod(cluster, kubectl, images, kueue) -> OperatorPod:
    """The operator from its image, in a real pod, installed as manifests/operator-namespaced.yaml (watching
    JOB_NAMESPACES, each with the manifest's Role and Pod Security labels) with --kueue and the Kueue reads bound."""
    for name in install_crds(cluster):
        kubectl.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
    kubectl.apply(operator_manifests(images.operator))
    op = OperatorPod(kubectl)

    def ready():
        pods = kubectl.get("pod", ns=OPERATOR_NS, selector="app.kubernetes.io/name=diloco-operator")
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for p in pods for c in p.get("status", {}).get("conditions", []))
    wait_for(ready, 120, "the operator pod Ready", 1.0)
    yield op
    print(f"--- operator log tail\n{op.logs()}", file=sys.stderr)
