"""Kueue admission per learner unit against a real Kueue (hack/build-kueue.sh) on the local control plane: a job grows
into the quota its ClusterQueue gives, grows further when the quota is raised or when its finished units free theirs,
and loses one unit, not the job, when a higher-priority Workload preempts it; an autoscaled job keeps the units its
quota lacks as queued Workloads (not parked) until Kueue admits them; units in a remote cluster are admitted by that
cluster's own Kueue (a second control plane with a second Kueue stands for it), an autoscaled job's among them."""

from __future__ import annotations

import sys
import time

import pytest

from diloco_operator.api import conditions as C
from diloco_operator.plan import kueue

from diloco_kube.labels import POOL_LABEL

from cluster_kit import Kubectl
from kueue_kit import KUEUE_API, Kueue, cluster_queue, local_queue, priority_class, resource_flavor
from polling import wait_for
from test_operator_autoscale_cluster import GPU_TAINT, H100, POOL, Nodes, autoscaled_job, autoscaling, template
from test_operator_cluster import condition, events, job, running, unit_pods, wait_events
from test_operator_remote_cluster import kubeconfig_secret, remote, remote_pods  # noqa: F401 - remote: a fixture

pytestmark = pytest.mark.cluster
GPUS = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def kueue_manager(kubectl, crds, tmp_path_factory):
    manager = Kueue(kubectl, tmp_path_factory.mktemp("kueue"))
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture(scope="module")
def kueue_operator(operator, kueue_manager):
    """The session's operator, restarted with --kueue (Kueue's CRDs are installed now) for this module."""
    before = operator.args
    operator.stop()
    operator.args = (*(before or ("--trust-syncer-url-annotation",)), "--kueue")
    operator.start()
    yield operator
    operator.stop()
    operator.args = before
    operator.start()


@pytest.fixture(scope="module")
def west_kueue(remote, tmp_path_factory):
    """A Kueue manager of its own on the remote ("west") control plane."""
    manager = Kueue(Kubectl(remote), tmp_path_factory.mktemp("kueue-west"))
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture
def queue(kubectl, ns, kueue_manager):
    """4 fake H100 nodes of this test's own pool, a flavor of them, a ClusterQueue for `ns` with room for 2 units
    of 8 GPUs, and the LocalQueue `team` in `ns`. Returns the ClusterQueue's name."""
    nodes = Nodes(kubectl, ns)
    nodes.add("gpu", 4, {GPUS: "8", "cpu": "64", "memory": "512Gi", "pods": "110"}, H100, GPU_TAINT)
    names = [f"{ns}-h100", f"{ns}-cq"]
    kubectl.apply(resource_flavor(names[0], {POOL: f"{ns}-gpu"}))
    kubectl.apply(cluster_queue(names[1], names[0], {GPUS: 16}, ns))
    kubectl.apply(local_queue("team", ns, names[1]))
    yield names[1]
    kubectl.run("delete", "clusterqueue", names[1], "--wait=false", check=False)
    kubectl.run("delete", "resourceflavor", names[0], "--wait=false", check=False)
    nodes.delete_all()


def queued_job(name: str, count: int) -> dict:
    body = job(name, [{"name": "gpu", "count": count, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}])
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    return body


def workload(kubectl, ns: str, name: str) -> dict | None:
    try:
        return kubectl.testbed.request("GET", f"{KUEUE_API}/namespaces/{ns}/workloads/{name}")
    except Exception:  # noqa: BLE001 - not there yet
        return None


def admitted(wl: dict | None) -> bool:
    return bool(wl) and any(c["type"] == "Admitted" and c["status"] == "True"
                            for c in (wl.get("status") or {}).get("conditions", []))


def running_units(kubectl, ns: str, units: list[str]) -> list[str]:
    """The units whose pod runs (kwok makes an admitted, created pod Running)."""
    return [u for u in units if (pods := unit_pods(kubectl, ns, u)) and all(running(p) for p in pods)]


def test_a_queued_job_runs_the_units_its_quota_admits_and_grows_when_the_quota_is_raised(
        kubectl, kueue_operator, ns, queue):
    kubectl.apply(queued_job("elastic", 4), "-n", ns)
    units = [f"elastic-gpu-{i}" for i in range(4)]
    # Kueue admits two Workloads (16 GPUs), their units' pods run on the flavor's nodes; the other two wait.
    wait_for(lambda: len(running_units(kubectl, ns, units)) == 2, 60, "2 of 4 units running", 0.5)
    admitted_units = [u for u in units if admitted(workload(kubectl, ns, u))]
    assert sorted(admitted_units) == sorted(running_units(kubectl, ns, units))
    for unit in admitted_units:
        (pod,) = unit_pods(kubectl, ns, unit)
        assert pod["spec"]["nodeSelector"][POOL] == f"{ns}-gpu", "placed by the flavor's node labels"
        assert pod["spec"]["nodeName"].startswith(f"{ns}-gpu")
        wl = workload(kubectl, ns, unit)
        assert wl["metadata"]["ownerReferences"][0]["name"] == unit and wl["spec"]["queueName"] == "team"
    for unit in set(units) - set(admitted_units):
        assert unit_pods(kubectl, ns, unit) == [], f"{unit} has pods without admission"
        lu = kubectl.get("lu", unit, ns=ns)
        cond = condition(lu, C.ADMITTED)
        assert cond.get("status") == "False" and cond.get("reason") == C.Reason.QUEUED_IN_KUEUE, lu["status"]
        assert "insufficient quota" in cond["message"] or "couldn't assign flavors" in cond["message"], cond

    # More quota: the waiting units are admitted and run.
    patched = time.monotonic()
    kubectl.apply(cluster_queue(queue, f"{ns}-h100", {GPUS: 32}, ns))
    wait_for(lambda: len(running_units(kubectl, ns, units)) == 4, 60, "all 4 units running", 0.2)
    print(f"[kueue] quota raised -> 2 more units' pods Running in {time.monotonic() - patched:.1f} s",
          file=sys.stderr)
    # The units' status follows their pods within a pass (a launch's status write may wait for its pods to be
    # ready, unitplan.status_may_wait): awaited, not read once.
    wait_for(lambda: all(condition(kubectl.get("lu", u, ns=ns), C.ADMITTED).get("reason") == C.Reason.ADMITTED_BY_KUEUE
                         for u in units), 30, "every unit's Admitted condition AdmittedByKueue", 0.2)

    # Deleting the job removes its Workloads with its units (owner references): the quota is free again.
    kubectl.run("delete", "dj", "elastic", "-n", ns, "--wait=false")
    wait_for(lambda: all(workload(kubectl, ns, u) is None for u in units), 60, "the Workloads gone", 0.5)


def test_a_higher_priority_workload_preempts_one_unit_and_the_others_keep_running(kubectl, kueue_operator, ns, queue):
    kubectl.apply(queued_job("shrink", 2), "-n", ns)
    units = ["shrink-gpu-0", "shrink-gpu-1"]
    wait_for(lambda: len(running_units(kubectl, ns, units)) == 2, 60, "both units running", 0.5)
    before = {u: unit_pods(kubectl, ns, u)[0]["metadata"]["uid"] for u in units}

    high = f"{ns}-high"
    kubectl.apply(priority_class(high, 1000))
    try:
        intruder = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                    "metadata": {"name": "urgent", "namespace": ns},
                    "spec": {"queueName": "team", "priority": 1000,
                             "priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                                  "name": high},
                             "podSets": [{"name": "main", "count": 1, "template": {"spec": {
                                 "restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "resources": {
                                     "requests": {GPUS: "8"}, "limits": {GPUS: "8"}}}]}}}]}}
        kubectl.apply(intruder)
        # One unit is evicted: its pods go, its status and an Event say why, and Kueue then admits the intruder
        # (the operator handed the unit's quota back).
        wait_for(lambda: admitted(workload(kubectl, ns, "urgent")), 60, "the high-priority Workload admitted", 0.5)
        (victim,) = [u for u in units if not admitted(workload(kubectl, ns, u))]
        (survivor,) = set(units) - {victim}
        wait_for(lambda: unit_pods(kubectl, ns, victim) == [], 30, f"{victim}'s pods gone", 0.2)
        cond = condition(kubectl.get("lu", victim, ns=ns), C.ADMITTED)
        assert cond["status"] == "False" and cond["reason"] in (C.Reason.EVICTED_BY_KUEUE, C.Reason.QUEUED_IN_KUEUE)
        wait_events(kubectl, ns, C.Reason.EVICTED_BY_KUEUE, lambda e: e["involvedObject"]["name"] == victim)
        wl = workload(kubectl, ns, victim)
        assert condition(wl, "Requeued").get("status") == "True" and not wl["status"].get("admission"), wl["status"]
        # The other unit was never touched: the same pod, still running.
        (pod,) = unit_pods(kubectl, ns, survivor)
        assert pod["metadata"]["uid"] == before[survivor] and running(pod)
        assert kubectl.get("lu", victim, ns=ns)["status"].get("restarts", 0) == 0, "preemption is not a failure"

        # The intruder leaves: the preempted unit is admitted again and runs a new incarnation.
        kubectl.run("delete", "workload", "urgent", "-n", ns)
        wait_for(lambda: len(running_units(kubectl, ns, units)) == 2, 60, "the preempted unit running again", 0.5)
        (pod,) = unit_pods(kubectl, ns, victim)
        assert pod["metadata"]["uid"] != before[victim] and pod["metadata"]["labels"]["diloco.dev/incarnation"] == "1"
    finally:
        kubectl.run("delete", "workloadpriorityclass", high, "--wait=false", check=False)


def test_units_that_complete_free_their_quota_for_the_waiting_ones(kubectl, kueue_operator, ns, queue):
    body = queued_job("batch", 4)
    body["spec"]["units"][0]["steps"] = 100
    kubectl.apply(body, "-n", ns)
    units = [f"batch-gpu-{i}" for i in range(4)]
    wait_for(lambda: len(running_units(kubectl, ns, units)) == 2, 60, "2 of 4 units running", 0.5)
    first = running_units(kubectl, ns, units)
    for unit in first:  # what a kubelet reports when `diloco learner --steps N` exits 0 (kwok runs no process)
        (pod,) = unit_pods(kubectl, ns, unit)
        kubectl.run("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                    "-p", '{"status": {"phase": "Succeeded"}}')
    # Their Workloads are marked Finished, Kueue frees the quota, and the two waiting units are admitted and run.
    wait_for(lambda: all(condition(workload(kubectl, ns, u) or {}, "Finished").get("status") == "True"
                         for u in first), 30, "the completed units' Workloads Finished", 0.2)
    rest = sorted(set(units) - set(first))
    wait_for(lambda: running_units(kubectl, ns, rest) == rest, 60, "the waiting units running", 0.5)
    assert all(kubectl.get("lu", u, ns=ns)["status"]["phase"] == "Succeeded" for u in first)


def test_an_autoscaled_job_keeps_the_units_its_quota_lacks_as_queued_workloads_and_they_run_when_it_is_raised(
        kubectl, kueue_operator, ns, queue):
    body = autoscaled_job("auto", [template(ns, "h100", "gpu", {"type": "nvidia-h100-80gb", "count": 8}, 4)],
                          minUnits=1, maxUnits=4, provisioningTimeoutSeconds=1)
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    kubectl.apply(body, "-n", ns)
    applied = time.monotonic()
    units = [f"auto-h100-{i}" for i in range(4)]
    # Quota for 2 of the 4 units it wants: 2 run, 2 stay as queued Workloads, and the job says it waits for quota.
    wait_for(lambda: (a := autoscaling(kubectl, ns, "auto")).get("runningUnits") == 2 and a.get("queuedUnits") == 2,
             60, "2 units running and 2 queued in the autoscaling status", 0.5)
    dj = kubectl.get("dj", "auto", ns=ns)
    assert condition(dj, C.SCALING_LIMITED)["reason"] == C.Reason.WAITING_FOR_QUOTA, dj["status"]
    running_now = running_units(kubectl, ns, units)
    waiting = sorted(set(units) - set(running_now))
    assert len(running_now) == 2 and all(workload(kubectl, ns, u) and not admitted(workload(kubectl, ns, u))
                                         for u in waiting)
    uids = {u: unit_pods(kubectl, ns, u)[0]["metadata"]["uid"] for u in running_now}

    # Long past the provisioning timeout (1 s) the autoscaler decides again (kubectl scale to 3, as an HPA would):
    # nothing is parked; the job sheds one queued Workload, never a running unit.
    wait_for(lambda: time.monotonic() - applied > 5, 10, "five provisioning timeouts", 0.5)
    kubectl.run("scale", "dj", "auto", "-n", ns, "--replicas=3")
    wait_for(lambda: (a := autoscaling(kubectl, ns, "auto")).get("targetUnits") == 3 and a.get("queuedUnits") == 1,
             60, "target 3: one queued unit left", 0.5)
    a = autoscaling(kubectl, ns, "auto")
    assert a.get("parkedUnits", []) == [] and not events(kubectl, ns, C.Reason.UNITS_PARKED), a
    def kept() -> list[str]:
        return [u for u in waiting
                if (lu := kubectl.get("lu", u, ns=ns)) and not lu["metadata"].get("deletionTimestamp")]
    (left,) = wait_for(lambda: len(k := kept()) == 1 and k, 30, "one of the two queued units kept", 0.3)
    assert workload(kubectl, ns, left) and not admitted(workload(kubectl, ns, left)), "still a pending Workload"
    assert {u: unit_pods(kubectl, ns, u)[0]["metadata"]["uid"] for u in running_now} == uids, "running units untouched"

    # More quota: Kueue admits the queued Workload and its unit trains; the target is met.
    raised = time.monotonic()
    kubectl.apply(cluster_queue(queue, f"{ns}-h100", {GPUS: 32}, ns))
    wait_for(lambda: left in running_units(kubectl, ns, [left]), 60, "the queued unit running", 0.2)
    print(f"[kueue] autoscaled: quota raised -> the queued unit's pod Running in {time.monotonic() - raised:.1f} s",
          file=sys.stderr)
    wait_for(lambda: (a := autoscaling(kubectl, ns, "auto")).get("runningUnits") == 3 and a.get("queuedUnits") == 0
             and condition(kubectl.get("dj", "auto", ns=ns), C.SCALING_LIMITED).get("reason") == C.Reason.TARGET_MET,
             30, "3 running, none queued, ScalingLimited=False", 0.3)
    assert not events(kubectl, ns, C.Reason.UNITS_PARKED)


def test_units_in_a_remote_cluster_are_admitted_by_that_clusters_kueue_and_grow_with_its_quota(
        kubectl, kueue_operator, ns, remote, west_kueue):
    far = Kubectl(remote)
    far.run("create", "namespace", ns)  # the LocalQueue goes there before the job (the operator then finds it)
    flavor, cq = f"{ns}-west-cpu", f"{ns}-west-cq"
    far.apply(resource_flavor(flavor, {POOL_LABEL: "cpu"}))
    far.apply(cluster_queue(cq, flavor, {"cpu": 2}, ns))
    far.apply(local_queue("team", ns, cq))
    try:
        body = job("away", [{"name": "far", "count": 2, "cluster": "west", "nodeSelector": {POOL_LABEL: "cpu"},
                             "resources": {"requests": {"cpu": "2"}}}], clusters=[kubeconfig_secret(kubectl, ns, remote)])
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
        kubectl.apply(body, "-n", ns)
        units = ["away-far-0", "away-far-1"]

        def running_there() -> list[str]:
            return sorted(u for u in units if (ps := remote_pods(far, ns, u)) and all(running(p) for p in ps))
        # West's quota (2 CPUs) admits one unit of two; the other waits in west's queue, with no pod anywhere.
        (first,) = wait_for(lambda: len(r := running_there()) == 1 and r, 90, "1 of 2 remote units running", 0.5)
        (waiting,) = set(units) - {first}
        assert admitted(workload(far, ns, first)) and not admitted(workload(far, ns, waiting))
        assert all(workload(kubectl, ns, u) is None for u in units), "a Workload at home: home quota is not west's"
        wl = workload(far, ns, first)
        assert wl["spec"]["queueName"] == "team" and "ownerReferences" not in wl["metadata"], wl["metadata"]
        assert wl["metadata"]["labels"]["diloco.dev/job"] == "away"
        # Admitted=False first says "waiting for quota"; Kueue's own reason follows once west's Kueue has tried the
        # Workload and the operator has polled it there (every 5 s): wait for that, not for the first False.
        def kueues_reason() -> dict | None:
            c = condition(kubectl.get("lu", waiting, ns=ns), C.ADMITTED)
            return c if c.get("status") == "False" and (
                "insufficient quota" in c.get("message", "") or "couldn't assign flavors" in c.get("message", "")) else None
        cond = wait_for(kueues_reason, 60, f"{waiting}'s Admitted=False with west's Kueue's reason", 0.3)
        assert cond["reason"] == C.Reason.QUEUED_IN_KUEUE, cond
        assert remote_pods(far, ns, waiting) == [] and unit_pods(kubectl, ns, waiting) == []
        (pod,) = remote_pods(far, ns, first)
        assert pod["spec"]["nodeSelector"][POOL_LABEL] == "cpu", "placed by west's flavor"

        # West's quota raised: its Kueue admits the waiting unit and it runs there.
        raised = time.monotonic()
        far.apply(cluster_queue(cq, flavor, {"cpu": 4}, ns))
        wait_for(lambda: running_there() == units, 60, "both remote units running", 0.2)
        print(f"[kueue] remote cluster: quota raised -> the waiting unit's pod Running there in "
              f"{time.monotonic() - raised:.1f} s (units there are polled every 5 s)", file=sys.stderr)
        wait_for(lambda: condition(kubectl.get("lu", waiting, ns=ns), C.ADMITTED).get("reason")
                 == C.Reason.ADMITTED_BY_KUEUE, 30, f"{waiting} AdmittedByKueue", 0.3)

        # The job's finalizer removes its Workloads there with its other objects: west's quota is free again.
        kubectl.run("delete", "dj", "away", "-n", ns, "--wait=false")
        wait_for(lambda: all(workload(far, ns, u) is None for u in units), 60, "the Workloads gone from west", 0.5)
        wait_for(lambda: kubectl.get("dj", "away", ns=ns) is None, 60, "the job gone", 0.5)
    finally:
        far.run("delete", "clusterqueue", cq, "--wait=false", check=False)
        far.run("delete", "resourceflavor", flavor, "--wait=false", check=False)


def test_an_autoscaled_job_with_its_template_in_a_remote_cluster_keeps_what_that_quota_lacks_queued_there(
        kubectl, kueue_operator, ns, remote, west_kueue):
    """Autoscaling, a remote cluster and Kueue together: the autoscaler wants 3 units of a template in "west", whose
    Kueue has quota for 1; the 2 others stay pending Workloads there (queued, never parked, however long past the
    provisioning timeout), and run there once west's quota is raised."""
    far = Kubectl(remote)
    far.run("create", "namespace", ns)
    flavor, cq = f"{ns}-west-cpu", f"{ns}-west-cq"
    far.apply(resource_flavor(flavor, {POOL_LABEL: "cpu"}))
    far.apply(cluster_queue(cq, flavor, {"cpu": 2}, ns))
    far.apply(local_queue("team", ns, cq))
    try:
        far_template = {"name": "far", "count": 0, "maxCount": 3, "cluster": "west",
                        "nodeSelector": {POOL_LABEL: "cpu"}, "resources": {"requests": {"cpu": "2"}}}
        body = autoscaled_job("grow", [far_template], minUnits=1, maxUnits=3, provisioningTimeoutSeconds=1)
        body["spec"]["clusters"] = [kubeconfig_secret(kubectl, ns, remote)]
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
        kubectl.apply(body, "-n", ns)
        applied = time.monotonic()
        units = [f"grow-far-{i}" for i in range(3)]

        def running_there() -> list[str]:
            return sorted(u for u in units if (ps := remote_pods(far, ns, u)) and all(running(p) for p in ps))
        wait_for(lambda: (a := autoscaling(kubectl, ns, "grow")).get("runningUnits") == 1 and a.get("queuedUnits") == 2,
                 90, "1 remote unit running and 2 queued in the autoscaling status", 0.5)
        (first,) = running_there()
        waiting = sorted(set(units) - {first})
        assert all(workload(far, ns, u) and not admitted(workload(far, ns, u)) for u in waiting), "pending there"
        assert all(remote_pods(far, ns, u) == [] for u in waiting)
        dj = kubectl.get("dj", "grow", ns=ns)
        assert condition(dj, C.SCALING_LIMITED)["reason"] == C.Reason.WAITING_FOR_QUOTA, dj["status"]
        # Five provisioning timeouts later nothing is parked: a unit Kueue holds is not one that cannot be placed.
        wait_for(lambda: time.monotonic() - applied > 5, 10, "five provisioning timeouts", 0.5)
        a = autoscaling(kubectl, ns, "grow")
        assert a.get("parkedUnits", []) == [] and a.get("queuedUnits") == 2, a
        assert not events(kubectl, ns, C.Reason.UNITS_PARKED)

        raised = time.monotonic()
        far.apply(cluster_queue(cq, flavor, {"cpu": 6}, ns))
        wait_for(lambda: running_there() == units, 60, "all 3 remote units running", 0.2)
        print(f"[kueue] autoscaled, remote: quota raised -> the 2 queued units' pods Running there in "
              f"{time.monotonic() - raised:.1f} s (units there are polled every 5 s)", file=sys.stderr)
        wait_for(lambda: (a := autoscaling(kubectl, ns, "grow")).get("runningUnits") == 3 and a.get("queuedUnits") == 0
                 and condition(kubectl.get("dj", "grow", ns=ns), C.SCALING_LIMITED).get("reason")
                 == C.Reason.TARGET_MET, 30, "3 running, none queued, ScalingLimited=False", 0.3)
        kubectl.run("delete", "dj", "grow", "-n", ns, "--wait=false")
        wait_for(lambda: all(workload(far, ns, u) is None for u in units), 60, "the Workloads gone from west", 0.5)
    finally:
        far.run("delete", "clusterqueue", cq, "--wait=false", check=False)
        far.run("delete", "resourceflavor", flavor, "--wait=false", check=False)
