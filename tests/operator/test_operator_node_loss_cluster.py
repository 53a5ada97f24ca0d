"""A lost node on the local control plane: a kwok node the test owns stops being managed (nothing renews its lease
or runs its pods any more, as when a machine dies) and reports Ready=Unknown; its unit must run on another node
within spec.failurePolicy.nodeLostSeconds and a few seconds, saying so, while the unit on a healthy node stays."""

from __future__ import annotations

import time
import urllib.error

import pytest

from diloco_operator import api
from diloco_operator import conditions as C
from diloco_kube.labels import KWOK_ANNOTATION

from polling import wait_for
from test_operator_autoscale_cluster import POOL, Nodes
from test_operator_cluster import condition, events, job, running

pytestmark = pytest.mark.cluster
CPU_NODE = {"cpu": "4", "memory": "16Gi", "pods": "110"}
SLACK_S = 15  # the operator's pass, the scheduler, kwok starting the new pod, on a loaded 2-core machine


@pytest.fixture
def nodes(kubectl, ns):
    n = Nodes(kubectl, ns)
    yield n
    n.delete_all()


def lose(kubectl, node: str) -> None:
    """The node dies: kwok stops answering for it (no lease renewal, its pods are nobody's to run or delete) and
    its Ready condition turns Unknown, as the controller-manager writes it for a node that stopped reporting."""
    kubectl.run("annotate", "node", node, f"{KWOK_ANNOTATION}-")
    for _ in range(10):
        obj = kubectl.get("node", node)
        obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] != C.READY] + [{
            "type": C.READY, "status": "Unknown", "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": C.now_iso(),
            "lastTransitionTime": C.now_iso()}]
        try:
            kubectl.testbed.request("PUT", f"/api/v1/nodes/{node}/status", obj)
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # a concurrent status write (kwok's last, the controller-manager's): again
                raise
    raise AssertionError(f"could not mark node {node} Unknown")


def placed(kubectl, ns: str, unit: str) -> list[dict]:
    """The unit's pods, including those being deleted (a pod on a dead node may stay Terminating)."""
    return kubectl.get("pods", ns=ns, selector=f"diloco.dev/unit={unit}")


def test_the_unit_of_a_lost_node_runs_on_another_node_within_node_lost_seconds_and_the_other_stays(
        kubectl, operator, ns, nodes):
    names = nodes.add("lost", 3, CPU_NODE, {}, taints=())
    # One unit per node (3 of 4 CPUs each), so the lost unit has exactly one place to go: the third node. A long
    # backoff: a node's loss is not the unit's failure and must not wait for it.
    units = [{"name": "cpu", "count": 2, "nodeSelector": {POOL: f"{ns}-lost"},
              "resources": {"requests": {"cpu": "3"}}}]
    kubectl.apply(job("lost", units, restartPolicy={"backoffSeconds": 120, "maxRestarts": 20}), "-n", ns)
    first = wait_for(lambda: (p := {u: placed(kubectl, ns, u) for u in ("lost-cpu-0", "lost-cpu-1")})
                     and all(len(v) == 1 and running(v[0]) for v in p.values()) and p, 60, "both units running", 0.3)
    victim_pod, kept_pod = first["lost-cpu-0"][0], first["lost-cpu-1"][0]
    victim_node = victim_pod["spec"]["nodeName"]
    assert victim_node in names and kept_pod["spec"]["nodeName"] in names
    lost_s = api.NODE_LOST_SECONDS  # the default: the figure a user gets
    assert victim_pod["spec"]["tolerations"][-1] == {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                                     "effect": "NoExecute", "tolerationSeconds": lost_s}

    lose(kubectl, victim_node)
    started = time.monotonic()

    def elsewhere():
        now = placed(kubectl, ns, "lost-cpu-0")
        new = [p for p in now if p["metadata"]["uid"] != victim_pod["metadata"]["uid"]]
        return new if len(now) == 1 and new and running(new[0]) else None
    (moved,) = wait_for(elsewhere, lost_s + SLACK_S, f"lost-cpu-0 running on another node within {lost_s}+{SLACK_S}s"
                        " of its node going NotReady (the old pod force-deleted, not left Terminating)", 0.1)
    took = time.monotonic() - started
    print(f"\nnode NotReady -> its unit Running on another node: {took:.1f}s (nodeLostSeconds {lost_s})")
    assert moved["spec"]["nodeName"] not in (victim_node, kept_pod["spec"]["nodeName"])
    assert took >= lost_s - 1, "not before the node had been lost for nodeLostSeconds"

    (kept,) = placed(kubectl, ns, "lost-cpu-1")
    assert kept["metadata"]["uid"] == kept_pod["metadata"]["uid"], "the unit on a healthy node is untouched"
    lu = wait_for(lambda: (u := kubectl.get("lu", "lost-cpu-0", ns=ns))["status"].get("phase") == "Running"
                  and condition(u, C.NODE_LOST).get("status") == "False" and u, 10, "the unit Running again", 0.2)
    cond = condition(lu, C.NODE_LOST)
    assert cond["reason"] == C.Reason.RUNNING_ELSEWHERE and victim_node in cond["message"]
    assert moved["spec"]["nodeName"] in cond["message"]
    assert lu["status"]["restarts"] == 1 and lu["status"]["nodes"] == [moved["spec"]["nodeName"]]
    assert kubectl.get("lu", "lost-cpu-1", ns=ns)["status"]["restarts"] == 0

    def node_lost_events():
        evs = events(kubectl, ns, C.Reason.NODE_LOST)
        kinds = {e["involvedObject"]["kind"]: e for e in evs}
        return kinds if {"LearnerUnit", "DilocoJob"} <= set(kinds) else None
    evs = wait_for(node_lost_events, 10, "NodeLost Events on the unit and the job", 0.2)
    assert evs["LearnerUnit"]["type"] == "Warning" and victim_node in evs["LearnerUnit"]["message"]
    assert evs["LearnerUnit"]["involvedObject"]["name"] == "lost-cpu-0"
    assert evs["DilocoJob"]["message"].startswith(f"unit lost-cpu-0: node {victim_node} not Ready (Ready=Unknown)")
    assert operator.metrics()[f'diloco_operator_lost_node_pods_deleted_total{{job="lost",namespace="{ns}"}}'] == 1
