"""A lost node on the local control plane: a kwok node the test owns stops being managed (nothing renews its lease
or runs its pods any more, as when a machine dies) and reports Ready=Unknown; its unit must run on another node
within spec.failurePolicy.nodeLostSeconds and a few seconds, saying so, while the unit on a healthy node stays; and
under the namespaced install, which cannot see Nodes, it must not be left waiting for ever either."""

from __future__ import annotations

import re
import time
import urllib.error
import uuid

import pytest

from diloco_devcluster.pools import NodePool, node_objects
from diloco_kube.labels import KWOK_ANNOTATION
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api

from polling import wait_for
from test_operator_autoscale_cluster import POOL, Nodes
from test_operator_cluster import condition, events, job, running
from test_operator_namespaced_cluster import install_namespaced, namespaced_operator

pytestmark = pytest.mark.cluster
CPU_NODE = {"cpu": "4", "memory": "16Gi", "pods": "110"}
SLACK_S = 15  # the operator's pass, the scheduler, kwok starting the new pod, on a loaded 2-core machine


@pytest.fixture
def nodes(kubectl, ns):
    n = Nodes(kubectl, ns)
    yield n
    n.delete_all()


def _put_retrying(kubectl, path: str, change) -> None:
    """GET `path`, change() it, PUT it back; again on a conflict (kwok or the controller-manager wrote meanwhile)."""
    for _ in range(20):
        obj = kubectl.testbed.request("GET", path)
        change(obj)
        try:
            kubectl.testbed.request("PUT", path, obj)
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise
    raise AssertionError(f"could not update {path}")


def lose(kubectl, node: str) -> None:
    """The node dies: its lease goes to a holder that never renews it, so kwok (which runs a node's pods only while
    it holds the node's lease) no longer answers for the node or its pods, as when a machine dies, and its Ready
    condition turns Unknown, as the controller-manager writes it for a node that stopped reporting."""
    def take_lease(lease: dict) -> None:
        lease["spec"].update(holderIdentity="dead-kubelet", leaseDurationSeconds=3600,
                             renewTime=time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()))
    _put_retrying(kubectl, f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}", take_lease)
    kubectl.run("annotate", "node", node, f"{KWOK_ANNOTATION}-")

    def unknown(obj: dict) -> None:
        obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] != C.READY] + [{
            "type": C.READY, "status": "Unknown", "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": C.now_iso(),
            "lastTransitionTime": C.now_iso()}]
    _put_retrying(kubectl, f"/api/v1/nodes/{node}/status", unknown)


def placed(kubectl, ns: str, unit: str) -> list[dict]:
    """The unit's pods, including those being deleted (a pod on a dead node may stay Terminating)."""
    return kubectl.get("pods", ns=ns, selector=f"diloco.dev/unit={unit}")


def test_the_unit_of_a_lost_node_runs_on_another_node_within_node_lost_seconds_and_the_other_stays(
        kubectl, operator, ns, nodes):
    pool, dead = f"{ns}-lost", f"{ns}-dead-0"
    hand_run_node(kubectl, dead, pool)
    nodes.names.append(dead)
    (healthy,) = nodes.add("lost", 1, CPU_NODE, {}, taints=())
    # One unit per node (3 of 4 CPUs each): one on the node the test runs, one on kwok's. A long backoff: a node's
    # loss is not the unit's failure and must not wait for it.
    units = [{"name": "cpu", "count": 2, "nodeSelector": {POOL: pool}, "resources": {"requests": {"cpu": "3"}}}]
    kubectl.apply(job("lost", units, restartPolicy={"backoffSeconds": 120, "maxRestarts": 20}), "-n", ns)
    first = wait_for(lambda: (p := {u: placed(kubectl, ns, u) for u in ("lost-cpu-0", "lost-cpu-1")})
                     and all(len(v) == 1 and v[0]["spec"].get("nodeName") for v in p.values()) and p, 60,
                     "both units placed", 0.3)
    victim_unit = next(u for u, (p,) in first.items() if p["spec"]["nodeName"] == dead)
    kept_unit = next(u for u in first if u != victim_unit)
    victim_pod, kept_pod = first[victim_unit][0], first[kept_unit][0]
    assert kept_pod["spec"]["nodeName"] == healthy
    run_pod_by_hand(kubectl, ns, victim_pod)
    wait_for(lambda: all(running(placed(kubectl, ns, u)[0]) for u in first), 30, "both units running", 0.2)
    (spare,) = nodes.add("lost", 1, CPU_NODE, {}, taints=(), first=1)  # the one place the lost unit can go
    lost_s = api.NODE_LOST_SECONDS  # the default: the figure a user gets
    assert victim_pod["spec"]["tolerations"][-1] == {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                                     "effect": "NoExecute", "tolerationSeconds": lost_s}

    lose(kubectl, dead)
    started = time.monotonic()

    def elsewhere():
        now = placed(kubectl, ns, victim_unit)
        new = [p for p in now if p["metadata"]["uid"] != victim_pod["metadata"]["uid"]]
        return new if len(now) == 1 and new and running(new[0]) else None
    (moved,) = wait_for(elsewhere, lost_s + SLACK_S, f"{victim_unit} running on another node within {lost_s}+{SLACK_S}s"
                        " of its node going NotReady (the old pod force-deleted, not left Terminating)", 0.1)
    took = time.monotonic() - started
    print(f"\nnode NotReady -> its unit Running on another node: {took:.1f}s (nodeLostSeconds {lost_s})")
    assert moved["spec"]["nodeName"] == spare
    assert took >= lost_s - 1, "not before the node had been lost for nodeLostSeconds"

    (kept,) = placed(kubectl, ns, kept_unit)
    assert kept["metadata"]["uid"] == kept_pod["metadata"]["uid"], "the unit on a healthy node is untouched"
    lu = wait_for(lambda: (u := kubectl.get("lu", victim_unit, ns=ns))["status"].get("phase") == "Running"
                  and condition(u, C.NODE_LOST).get("status") == "False" and u, 10, "the unit Running again", 0.2)
    cond = condition(lu, C.NODE_LOST)
    assert cond["reason"] == C.Reason.RUNNING_ELSEWHERE and dead in cond["message"] and spare in cond["message"]
    assert lu["status"]["restarts"] == 1 and lu["status"]["nodes"] == [spare]
    assert kubectl.get("lu", kept_unit, ns=ns)["status"]["restarts"] == 0

    def node_lost_events():
        evs = events(kubectl, ns, C.Reason.NODE_LOST)
        kinds = {e["involvedObject"]["kind"]: e for e in evs}
        return kinds if {"LearnerUnit", "DilocoJob"} <= set(kinds) else None
    evs = wait_for(node_lost_events, 10, "NodeLost Events on the unit and the job", 0.2)
    assert evs["LearnerUnit"]["type"] == "Warning" and dead in evs["LearnerUnit"]["message"]
    assert evs["LearnerUnit"]["involvedObject"]["name"] == victim_unit
    assert evs["DilocoJob"]["message"].startswith(f"unit {victim_unit}: node {dead} not Ready (Ready=Unknown)")
    assert operator.metrics()[f'diloco_operator_lost_node_pods_deleted_total{{job="lost",namespace="{ns}"}}'] == 1


def hand_run_node(kubectl, name: str, pool: str) -> None:
    """A Node no kwok runs: the test plays its kubelet (Ready, a lease, its pods' status), so a deletion on it after
    its death is confirmed by nobody, whatever kwok does."""
    node = node_objects((NodePool(pool, 1, CPU_NODE),))[0]
    node["metadata"].update(name=name, annotations={})
    node["metadata"]["labels"].update({"kubernetes.io/hostname": name, POOL: pool})
    kubectl.testbed.create("/api/v1/nodes", node)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    kubectl.testbed.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
        "spec": {"holderIdentity": "test-kubelet", "leaseDurationSeconds": 3600, "renewTime": now}})

    def ready(obj: dict) -> None:
        obj["status"].update(capacity=CPU_NODE, allocatable=CPU_NODE, conditions=[{
            "type": C.READY, "status": "True", "reason": "KubeletReady", "message": "the test runs it",
            "lastHeartbeatTime": C.now_iso(), "lastTransitionTime": C.now_iso()}])
    _put_retrying(kubectl, f"/api/v1/nodes/{name}/status", ready)


def run_pod_by_hand(kubectl, ns: str, pod: dict) -> None:
    """What a kubelet would write for a started pod: Running and Ready."""
    def started(obj: dict) -> None:
        now = C.now_iso()
        obj["status"].update(phase="Running", startTime=now, conditions=[
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")], containerStatuses=[
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0,
             "started": True, "state": {"running": {"startedAt": now}}} for c in obj["spec"]["containers"]])
    _put_retrying(kubectl, f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/status", started)


def test_without_any_right_on_nodes_a_unit_left_terminating_on_a_dead_node_runs_elsewhere(
        kubectl, operator, ns, nodes, testbed, tmp_path):
    """The namespaced install (--no-watch-nodes, a Role only): the controller-manager's taint eviction deletes the
    pod gracefully after its toleration, the dead node never confirms, and the operator force-deletes it
    nodeLostSeconds past its grace period, so the unit is not left waiting for ever."""
    pool, dead = f"{ns}-gone", f"{ns}-dead-0"
    hand_run_node(kubectl, dead, pool)
    nodes.names.append(dead)
    home = f"op-{uuid.uuid4().hex[:6]}"
    install_namespaced(kubectl, home, ns)
    namespaced = namespaced_operator(kubectl, testbed, home, ns, tmp_path)
    operator.stop()  # the session's cluster-wide operator (which watches Nodes) would act first
    lost_s = 5
    try:
        namespaced.start()
        units = [{"name": "cpu", "count": 1, "nodeSelector": {POOL: pool}, "resources": {"requests": {"cpu": "3"}}}]
        kubectl.apply(job("gone", units, failurePolicy={"nodeLostSeconds": lost_s},
                          restartPolicy={"backoffSeconds": 0, "maxRestarts": 20}), "-n", ns)
        (victim,) = wait_for(lambda: (p := placed(kubectl, ns, "gone-cpu-0")) and p[0]["spec"].get("nodeName") == dead
                             and p, 90, f"the unit's pod placed on {dead}", 0.3)
        run_pod_by_hand(kubectl, ns, victim)
        wait_for(lambda: (kubectl.get("lu", "gone-cpu-0", ns=ns).get("status") or {}).get("phase") == "Running", 30,
                 "the unit Running", 0.2)
        nodes.add("gone", 1, CPU_NODE, {}, taints=())  # a kwok node with room, named <ns>-gone-0
        grace = victim["spec"].get("terminationGracePeriodSeconds", 30)
        lose(kubectl, dead)
        started = time.monotonic()

        def elsewhere():
            now = placed(kubectl, ns, "gone-cpu-0")
            return now if len(now) == 1 and now[0]["metadata"]["uid"] != victim["metadata"]["uid"] \
                and running(now[0]) else None
        # The taint (the controller-manager looks every 5 s), the toleration, the pod's grace period, nodeLostSeconds.
        budget = 5 + lost_s + grace + lost_s + SLACK_S
        (moved,) = wait_for(elsewhere, budget, f"the unit running on the other node within {budget}s", 0.2)
        took = time.monotonic() - started
        print(f"\nno Node watch: node NotReady -> its unit Running on another node: {took:.1f}s "
              f"(nodeLostSeconds {lost_s}, grace period {grace}s)")
        assert moved["spec"]["nodeName"] == f"{pool}-0"
        assert took >= lost_s + grace, "the pod went only once its deletion was overdue"
        lost_events = wait_for(lambda: [e for e in events(kubectl, ns, C.Reason.NODE_LOST)
                                        if e["involvedObject"]["kind"] == "LearnerUnit"], 10, "a NodeLost Event", 0.2)
        name = victim["metadata"]["name"]
        assert re.fullmatch(rf"node {dead} has not confirmed the deletion of pod {name} \d+s past its grace period: "
                            rf"pod {name} force-deleted", lost_events[0]["message"]), lost_events[0]["message"]
        lu = wait_for(lambda: (u := kubectl.get("lu", "gone-cpu-0", ns=ns)) and condition(u, C.NODE_LOST).get("reason")
                      == C.Reason.RUNNING_ELSEWHERE and u, 10, "NodeLost=False, RunningElsewhere", 0.2)
        assert moved["spec"]["nodeName"] in condition(lu, C.NODE_LOST)["message"]
    finally:
        namespaced.stop()
        kubectl.run("delete", "namespace", home, "--wait=false", check=False)
        operator.start()
