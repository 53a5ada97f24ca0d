"""Pod Security admission, for real: in a namespace labelled `pod-security.kubernetes.io/enforce: restricted` the
testbed's kube-apiserver admits the syncer pods (ReplicaSet-created, with their standby) and the learner pods
(operator-created, CPU and GPU, one and two per unit, with a state PVC) of a DilocoJob and the operator's own pod
of both install manifests, and refuses the same learner pod without its hardening (so admission is really on)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from test_operator_cluster import cpu_units, events, job, wait_job_ready  # helpers only

from polling import wait_for
from cluster_kit import ROOT, Kubectl

pytestmark = pytest.mark.cluster
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


def restrict(kubectl: Kubectl, ns: str) -> None:
    kubectl.run("label", "namespace", ns, *(f"{k}={v}" for k, v in RESTRICTED.items()), "--overwrite")


def dry_run_pod(kubectl: Kubectl, ns: str, pod: dict):
    """Create `pod` in `ns` as a server-side dry run: admission runs (PodSecurity included), nothing is stored."""
    return kubectl.run("create", "--dry-run=server", "-n", ns, "-f", "-", "-o", "name", input=json.dumps(pod),
                       check=False)


def as_new_pod(pod: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {k: v for k, v in copy.deepcopy(pod["spec"]).items() if k != "nodeName"}}


def test_a_job_in_a_restricted_namespace_gets_every_pod_admitted_and_an_unhardened_one_is_refused(
        kubectl, operator, ns):
    restrict(kubectl, ns)
    units = [*cpu_units(1, stateVolume={"size": "1Gi"}),
             {"name": "gpu", "count": 1, "podsPerUnit": 2, "accelerator": {"type": "nvidia-l4", "count": 1}}]
    kubectl.apply(job("strict", units), "-n", ns)
    wait_job_ready(kubectl, ns, "strict", 2, timeout=120)
    learners = kubectl.get("pod", ns=ns, selector="diloco.dev/job=strict,diloco.dev/component=learner")
    syncers = kubectl.get("pod", ns=ns, selector="diloco.dev/job=strict,diloco.dev/component=syncer")
    assert len(learners) == 3 and len(syncers) == 1, ([p["metadata"]["name"] for p in learners], syncers)
    assert [c["name"] for c in syncers[0]["spec"]["containers"]] == ["syncer", "standby"]
    for pod in learners + syncers:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for c in pod["spec"]["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, pod["metadata"]["name"]
    # Nothing was refused on the way (the ReplicaSet reports a refused syncer pod as FailedCreate).
    assert not events(kubectl, ns, "FailedCreate"), events(kubectl, ns, "FailedCreate")

    # Admission is on: the same learner pod without its hardening is refused, naming the profile.
    bare = as_new_pod(learners[0], "unhardened")
    bare["spec"].pop("securityContext")
    for c in bare["spec"]["containers"]:
        c.pop("securityContext")
    refused = dry_run_pod(kubectl, ns, bare)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr, refused
    for field in ("allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile"):
        assert field in refused.stderr, (field, refused.stderr)
    # ... and the pod as the operator built it passes the same check (also as a fresh pod of another name).
    admitted = dry_run_pod(kubectl, ns, as_new_pod(learners[0], "hardened"))
    assert admitted.returncode == 0, admitted.stderr


@pytest.mark.parametrize("manifest", ["operator.yaml", "operator-namespaced.yaml"])
def test_the_operators_own_pod_is_admitted_under_the_restricted_profile(kubectl, ns, manifest):
    restrict(kubectl, ns)
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / manifest).read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = {"spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"}}
    out = dry_run_pod(kubectl, ns, as_new_pod(pod, "operator"))
    assert out.returncode == 0, out.stderr
    # The manifests put their own namespaces under the same profile.
    for doc in docs:
        if doc["kind"] == "Namespace":
            assert doc["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") == "restricted", doc


def test_the_restricted_label_is_enforced_on_pods_created_after_it(kubectl, ns):
    # The testbed apiserver runs PodSecurity admission (on by default since 1.25): proven without the operator.
    restrict(kubectl, ns)
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"},
            "spec": {"containers": [{"name": "c", "image": "diloco-trainer:test"}]}}
    out = dry_run_pod(kubectl, ns, bare)
    assert out.returncode != 0 and "violates PodSecurity" in out.stderr, out
    kubectl.run("label", "namespace", ns, "pod-security.kubernetes.io/enforce-")
    wait_for(lambda: dry_run_pod(kubectl, ns, bare).returncode == 0, 10, "the unlabelled namespace admitting it")
