"""The NetworkPolicies the operator ships (issue 20, Medium 6): a job's syncer answers only its learners and the
operator, a learner's pods only the metrics port (one policy per job), the pods of a unit of several pods each other. The testbed runs no CNI, so nothing here shows
enforcement: the objects' content, and that they are created, owned and garbage-collected on a real apiserver."""

from __future__ import annotations

import pytest

from diloco_operator.api import models as api
from diloco_operator.objects import builders as O

from polling import wait_for
from test_operator_cluster import cpu_units, job, wait_job_ready

JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}}


def spec(**extra) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({"image": "x", "units": [{"name": "cpu", "count": 2}], **extra})


def test_the_syncer_answers_only_the_jobs_learners_and_the_operators_pods():
    policy = O.syncer_network_policy(JOB, spec(), "diloco-system")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert policy["spec"]["podSelector"] == {"matchLabels": {"diloco.dev/job": "demo", "diloco.dev/component": "syncer"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": api.SYNCER_PORT}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"diloco.dev/job": "demo", "diloco.dev/component": "learner"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "diloco-operator"}}}]
    # An operator outside the cluster has no pod to name: learners only.
    (rule,) = O.syncer_network_policy(JOB, spec(), None)["spec"]["ingress"]
    assert len(rule["from"]) == 1
    # Learners in other clusters arrive through a load balancer no selector names: the port is open, tokens guard it.
    remote = spec(clusters=[{"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "https://s.w:8470"}])
    assert O.syncer_network_policy(JOB, remote, "diloco-system")["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": api.SYNCER_PORT}]}]


def test_every_learner_pod_of_a_job_answers_only_on_the_metrics_port_through_one_policy_of_the_job():
    policy = O.learner_network_policy(JOB)
    assert policy["metadata"]["name"] == "demo-learners-ingress"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert policy["spec"]["podSelector"] == {"matchLabels": {"diloco.dev/job": "demo", "diloco.dev/component": "learner"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": api.METRICS_PORT}]}]


def test_a_units_pods_answer_each_other_on_any_port_and_others_only_on_the_metrics_port():
    uspec = O.unit_spec("demo", spec(), spec().units[0], 0, 0).model_copy(update={"podsPerUnit": 2})
    unit = {**O.learner_unit(JOB, uspec), "metadata": {**O.learner_unit(JOB, uspec)["metadata"], "uid": "u2"}}
    policy = O.unit_network_policy(unit)
    assert policy["metadata"]["name"] == "demo-cpu-0-ingress"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u2"
    mine = {"matchLabels": {"diloco.dev/job": "demo", "diloco.dev/unit": "demo-cpu-0"}}
    assert policy["spec"]["podSelector"] == mine
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": mine}]},
                                         {"ports": [{"protocol": "TCP", "port": api.METRICS_PORT}]}]
    # The torch.distributed port is in no rule open to other pods.
    assert all("from" in r for r in policy["spec"]["ingress"] if "ports" not in r)


def _policy(kubectl, ns: str, name: str) -> dict | None:
    return kubectl.get("networkpolicies", name, ns=ns)


@pytest.mark.cluster
def test_each_job_and_each_unit_of_several_pods_gets_its_own_network_policy_which_goes_with_its_owner(kubectl, operator, ns):
    kubectl.apply(job("net", cpu_units(2, podsPerUnit=2)), "-n", ns)
    wait_job_ready(kubectl, ns, "net", 2)
    dj = kubectl.get("dj", "net", ns=ns)
    syncer = wait_for(lambda: _policy(kubectl, ns, "net-syncer-ingress"), 30, "the syncer's NetworkPolicy", 0.2)
    (owner,) = syncer["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("DilocoJob", dj["metadata"]["uid"], True)
    assert syncer["spec"]["podSelector"]["matchLabels"] == {"diloco.dev/job": "net", "diloco.dev/component": "syncer"}
    # The test operator runs outside the cluster (no POD_NAMESPACE): only the job's learners may connect.
    assert syncer["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "diloco.dev/job": "net", "diloco.dev/component": "learner"}}}], "ports": [{"protocol": "TCP", "port": 8470}]}]
    # What the selectors pick on the real pods: the syncer pods, and each unit's own two pods.
    syncer_pods = kubectl.get("pods", ns=ns, selector="diloco.dev/job=net,diloco.dev/component=syncer")
    assert syncer_pods and all(p["metadata"]["labels"]["diloco.dev/component"] == "syncer" for p in syncer_pods)
    for unit in ("net-cpu-0", "net-cpu-1"):
        lu = kubectl.get("lu", unit, ns=ns)
        policy = _policy(kubectl, ns, f"{unit}-ingress")
        assert policy["metadata"]["ownerReferences"][0]["uid"] == lu["metadata"]["uid"]
        selector = policy["spec"]["podSelector"]["matchLabels"]
        picked = kubectl.get("pods", ns=ns, selector=",".join(f"{k}={v}" for k, v in selector.items()))
        assert sorted(p["metadata"]["name"] for p in picked) == [f"{unit}-0-0", f"{unit}-0-1"]
        assert policy["spec"]["ingress"][0] == {"from": [{"podSelector": {"matchLabels": selector}}]}

    # The job's policy for its learners picks every learner pod of it.
    learners = wait_for(lambda: _policy(kubectl, ns, "net-learners-ingress"), 30, "the learners' NetworkPolicy", 0.2)
    assert learners["metadata"]["ownerReferences"][0]["uid"] == dj["metadata"]["uid"]
    selector = learners["spec"]["podSelector"]["matchLabels"]
    picked = kubectl.get("pods", ns=ns, selector=",".join(f"{k}={v}" for k, v in selector.items()))
    assert sorted(p["metadata"]["name"] for p in picked) == [f"net-cpu-{u}-0-{r}" for u in (0, 1) for r in (0, 1)]

    # A single-pod unit gets no policy of its own (its pod's traffic to itself is not subject to one): its pod is
    # created after the policies it needs, so none appears later.
    kubectl.apply(job("solo", cpu_units(1)), "-n", ns)
    wait_job_ready(kubectl, ns, "solo", 1)
    assert _policy(kubectl, ns, "solo-learners-ingress") is not None
    assert _policy(kubectl, ns, "solo-cpu-0-ingress") is None
    kubectl.run("delete", "dj", "solo", "-n", ns, "--wait=false")

    # A scaled-down unit's policy goes with it (garbage collector); the job's goes with the job.
    kubectl.run("scale", "dj", "net", "-n", ns, "--replicas=1")
    wait_for(lambda: _policy(kubectl, ns, "net-cpu-1-ingress") is None, 60, "the removed unit's policy collected", 0.2)
    assert _policy(kubectl, ns, "net-cpu-0-ingress") is not None
    kubectl.run("delete", "dj", "net", "-n", ns, "--wait=false")
    wait_for(lambda: kubectl.get("networkpolicies", ns=ns) == [], 60, "every policy of the job collected", 0.2)
