"""spec.autoscaling on the local control plane: kwok node pools that the test adds, taints and leaves empty to
mimic capacity arriving, a spot pool preempted, and a pool that never has room."""

from __future__ import annotations

import urllib.error

import pytest

from diloco_devcluster.pools import NodePool, node_objects
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api

from polling import wait_for
from test_operator_cluster import FAST, condition, events, running, unit_pods

pytestmark = pytest.mark.cluster
POOL = "diloco.test/pool"
GPU_TAINT = ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},)
H100 = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "nvidia.com/gpu.present": "true"}
L4 = {"cloud.google.com/gke-accelerator": "nvidia-l4", "nvidia.com/gpu.present": "true"}
TPU = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x2"}


class Nodes:
    """Fake nodes this test owns (kwok keeps them Ready); all deleted at the end."""

    def __init__(self, kubectl, ns: str):
        self.kubectl, self.ns, self.names = kubectl, ns, []

    def add(self, pool: str, count: int, capacity: dict, labels: dict, taints=GPU_TAINT, first: int = 0) -> list[str]:
        added = []
        for node in node_objects((NodePool(f"{self.ns}-{pool}", first + count, capacity, labels, taints),))[first:]:
            node["metadata"]["labels"][POOL] = f"{self.ns}-{pool}"
            self.kubectl.testbed.create("/api/v1/nodes", node)
            added.append(node["metadata"]["name"])
        self.names += added
        wait_for(lambda: all(_ready(self.kubectl.get("node", n)) for n in added), 30, f"nodes {added} Ready", 0.2)
        return added

    def delete_all(self) -> None:
        for name in self.names:
            self.kubectl.run("delete", "node", name, "--wait=false", check=False)


def _ready(node: dict | None) -> bool:
    return bool(node) and any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


@pytest.fixture
def nodes(kubectl, ns):
    n = Nodes(kubectl, ns)
    yield n
    n.delete_all()


def template(ns: str, name: str, pool: str, accelerator: dict, max_count: int, pods: int = 1) -> dict:
    return {"name": name, "count": 0, "maxCount": max_count, "podsPerUnit": pods, "accelerator": accelerator,
            "nodeSelector": {POOL: f"{ns}-{pool}"}}


def autoscaled_job(name: str, units: list[dict], **autoscaling) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": name},
            "spec": {"image": "diloco-trainer:test", "units": units, "restartPolicy": FAST,
                     "syncer": {"nodeSelector": {"cloud.google.com/gke-nodepool": "cpu"}},
                     "autoscaling": {"provisioningTimeoutSeconds": 3, "retryBackoffSeconds": 600,
                                     "scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 0, **autoscaling}}}


def running_units(kubectl, ns: str, job: str) -> dict[str, str]:
    """Unit name -> template of the job's units whose pods all run."""
    out = {}
    try:
        lus = kubectl.get("lu", ns=ns, selector=f"diloco.dev/job={job}")
    except urllib.error.HTTPError as exc:  # 429 while a new CRD's watch cache initializes: ask again
        if exc.code != 429:
            raise
        return {}
    for lu in lus:
        if lu["metadata"].get("deletionTimestamp") or (lu.get("status") or {}).get("phase") != "Running":
            continue
        out[lu["metadata"]["name"]] = lu["spec"]["template"]
    return out


def autoscaling(kubectl, ns: str, job: str) -> dict:
    return (kubectl.get("dj", job, ns=ns).get("status") or {}).get("autoscaling") or {}


def test_an_autoscaled_job_fills_h100_first_falls_back_to_tpu_grows_when_nodes_arrive_and_shrinks(
        kubectl, operator, ns, nodes):
    nodes.add("h100", 1, {"cpu": "208", "memory": "1872Gi", "nvidia.com/gpu": "8", "pods": "110"}, H100)
    nodes.add("tpu", 2, {"cpu": "208", "memory": "448Gi", "google.com/tpu": "4", "pods": "110"}, TPU,
              taints=({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"},))
    # The L4 pool has no node at all: a pool that never has room.
    units = [template(ns, "h100", "h100", {"type": "nvidia-h100-80gb", "count": 8}, 3),
             template(ns, "l4", "l4", {"type": "nvidia-l4", "count": 8}, 1),
             template(ns, "tpu", "tpu", {"type": "tpu-v5p-slice", "count": 4, "topology": "2x2x2"}, 1, pods=2)]
    kubectl.apply(autoscaled_job("auto", units, minUnits=1, maxUnits=4, preference=["h100", "l4", "tpu"]), "-n", ns)

    def fell_back():
        run = running_units(kubectl, ns, "auto")
        return run if sorted(run.values()) == ["h100", "tpu"] else None
    wait_for(fell_back, 60, "one H100 unit and the TPU fallback running", 0.3)
    st = wait_for(lambda: (a := autoscaling(kubectl, ns, "auto")).get("runningUnits") == 2
                  and len(a.get("parkedUnits") or []) == 3 and a.get("desiredUnits") == 2 and a, 30, "the units without room parked (each after its own provisioning timeout)", 0.3)
    assert sorted(running_units(kubectl, ns, "auto").values()) == ["h100", "tpu"]
    parked = {p["name"] for p in st["parkedUnits"]}
    # Which two H100 units found no room is the scheduler's choice; the L4 one never had a node.
    assert len(parked) == 3 and "auto-l4-0" in parked and sum(p.startswith("auto-h100-") for p in parked) == 2, st
    by_t = {t["name"]: t for t in st["templates"]}
    assert by_t["h100"]["retryAt"] and by_t["l4"]["retryAt"] and "unschedulable" in by_t["l4"]["reason"]
    assert (st["targetUnits"], st["desiredUnits"], st["runningUnits"]) == (4, 2, 2)
    dj = kubectl.get("dj", "auto", ns=ns)
    assert condition(dj, C.SCALING_LIMITED)["status"] == "True"
    assert condition(dj, C.SCALING_LIMITED)["reason"] == C.Reason.CAPACITY_UNAVAILABLE
    wait_for(lambda: events(kubectl, ns, C.Reason.UNITS_PARKED), 10, "a UnitsParked Event", 0.3)
    kept_h100 = next(u for u, t in running_units(kubectl, ns, "auto").items() if t == "h100")
    first_h100 = unit_pods(kubectl, ns, kept_h100)[0]["metadata"]["uid"]

    # Capacity arrives: a second H100 node. The parked H100 template is retried at once, not after its backoff.
    nodes.add("h100", 1, {"cpu": "208", "memory": "1872Gi", "nvidia.com/gpu": "8", "pods": "110"}, H100, first=1)
    wait_for(lambda: sorted(running_units(kubectl, ns, "auto").values()) == ["h100", "h100", "tpu"], 60, "a second H100 unit once its node arrived", 0.3)
    wait_for(lambda: events(kubectl, ns, C.Reason.CAPACITY_APPEARED), 10, "a CapacityAppeared Event", 0.3)
    assert unit_pods(kubectl, ns, kept_h100)[0]["metadata"]["uid"] == first_h100, "healthy unit untouched"

    # The job shrinks (kubectl scale, as an HPA would): the least preferred template goes first.
    kubectl.run("scale", "dj", "auto", "-n", ns, "--replicas=2")
    wait_for(lambda: sorted(running_units(kubectl, ns, "auto").values()) == ["h100", "h100"]
             and kubectl.get("lu", "auto-tpu-0", ns=ns) is None, 60, "the TPU unit removed first", 0.3)
    wait_for(lambda: events(kubectl, ns, C.Reason.SCALED_DOWN), 10, "a ScaledDown Event", 0.3)
    assert unit_pods(kubectl, ns, kept_h100)[0]["metadata"]["uid"] == first_h100
    wait_for(lambda: condition(kubectl.get("dj", "auto", ns=ns), C.SCALING_LIMITED).get("reason")
             == C.Reason.TARGET_MET, 30, "ScalingLimited=False once the target is met", 0.3)


def test_units_of_a_preempted_spot_pool_move_to_the_fallback_pool_and_the_others_stay(kubectl, operator, ns, nodes):
    spot = nodes.add("spot", 2, {"cpu": "208", "memory": "1872Gi", "nvidia.com/gpu": "8", "pods": "110"}, H100)
    nodes.add("l4", 2, {"cpu": "96", "memory": "384Gi", "nvidia.com/gpu": "8", "pods": "110"}, L4)
    units = [template(ns, "h100", "spot", {"type": "nvidia-h100-80gb", "count": 8}, 2),
             template(ns, "l4", "l4", {"type": "nvidia-l4", "count": 8}, 2)]
    kubectl.apply(autoscaled_job("spot", units, minUnits=1, maxUnits=2), "-n", ns)
    wait_for(lambda: sorted(running_units(kubectl, ns, "spot").values()) == ["h100", "h100"], 60, "both units on the spot H100 pool", 0.3)
    pods = {u: unit_pods(kubectl, ns, u)[0] for u in ("spot-h100-0", "spot-h100-1")}
    victim = next(u for u, p in pods.items() if p["spec"]["nodeName"] == spot[1])
    survivor = next(u for u in pods if u != victim)
    # The spot node is preempted: tainted NoExecute (its pods are evicted, nothing new lands there).
    kubectl.run("taint", "node", spot[1], "cloud.google.com/gke-spot=preempted:NoExecute")
    wait_for(lambda: sorted(running_units(kubectl, ns, "spot").values()) == ["h100", "l4"], 60, "the preempted unit parked and replaced on the L4 pool", 0.3)
    assert unit_pods(kubectl, ns, survivor)[0]["metadata"]["uid"] == pods[survivor]["metadata"]["uid"]
    assert victim in {p["name"] for p in autoscaling(kubectl, ns, "spot")["parkedUnits"]}
    # The spot capacity comes back: the target is met, so no healthy L4 unit is moved to make room.
    l4_unit = next(u for u, t in running_units(kubectl, ns, "spot").items() if t == "l4")
    l4_uid = unit_pods(kubectl, ns, l4_unit)[0]["metadata"]["uid"]
    kubectl.run("taint", "node", spot[1], "cloud.google.com/gke-spot-")
    wait_for(lambda: next((t for t in autoscaling(kubectl, ns, "spot")["templates"] if t["name"] == "h100"),
                          {}).get("freeUnits") == 1, 30, "the autoscaler sees the spot node's room again", 0.3)
    assert sorted(running_units(kubectl, ns, "spot").values()) == ["h100", "l4"]
    assert unit_pods(kubectl, ns, l4_unit)[0]["metadata"]["uid"] == l4_uid
