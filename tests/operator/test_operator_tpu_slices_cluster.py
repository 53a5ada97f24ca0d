"""Multi-host TPU units on the local control plane with the real kube-scheduler (kwok nodes): a unit of several TPU
hosts lands all its pods in one node pool (on GKE, one slice: the only place its chips are linked), never split
across slices, and never in a slice another unit uses; a unit with no free slice stays Pending and says so."""

from __future__ import annotations

import pytest

from diloco_kube.labels import POOL_LABEL
from diloco_operator.api import conditions as C

from polling import wait_for
from test_operator_autoscale_cluster import nodes  # noqa: F401 (a fixture)
from test_operator_cluster import condition, job, running, unit_pods

pytestmark = pytest.mark.cluster
TOPOLOGY = "2x4x1"  # this test's slices only: no other pool of the testbed has it
SLICE = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": TOPOLOGY}
TPU_TAINT = ({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"},)
HOST = {"cpu": "208", "memory": "448Gi", "google.com/tpu": "4", "pods": "110"}


def pools_of(kubectl, ns: str, unit: str) -> set[str]:
    return {kubectl.get("node", p["spec"]["nodeName"])["metadata"]["labels"][POOL_LABEL]
            for p in unit_pods(kubectl, ns, unit) if p["spec"].get("nodeName")}


def test_a_multi_host_tpu_unit_takes_one_whole_slice_of_its_own(kubectl, operator, ns, nodes):
    slices = [f"{ns}-slice-a", f"{ns}-slice-b"]
    for name in ("slice-a", "slice-b"):
        nodes.add(name, 2, HOST, SLICE, taints=TPU_TAINT)
    template = {"name": "v5p", "count": 2, "podsPerUnit": 2,
                "accelerator": {"type": "tpu-v5p-slice", "count": 4, "topology": TOPOLOGY}}
    kubectl.apply(job("slices", [template]), "-n", ns)
    units = ["slices-v5p-0", "slices-v5p-1"]

    def placed() -> dict[str, set[str]] | None:
        pods = {u: unit_pods(kubectl, ns, u) for u in units}
        if not all(len(ps) == 2 and all(running(p) for p in ps) for ps in pods.values()):
            return None
        return {u: pools_of(kubectl, ns, u) for u in units}
    where = wait_for(placed, 60, "both units' pods running")
    assert all(len(pools) == 1 for pools in where.values()), f"a unit split across slices: {where}"
    assert where[units[0]] | where[units[1]] == set(slices), f"two units in one slice: {where}"

    # A third unit finds no free slice: its pods wait, none in a slice the others use, and its status says why.
    kubectl.run("scale", "dj", "slices", "-n", ns, "--replicas=3")
    third = "slices-v5p-2"
    cond = wait_for(lambda: (lu := kubectl.get("lu", third, ns=ns)) and (c := condition(lu, C.PODS_SCHEDULED))
                    .get("status") == "False" and c, 60, f"{third}'s PodsScheduled=False")
    assert cond["reason"] == C.Reason.UNSCHEDULABLE, cond
    assert [p["spec"].get("nodeName") for p in unit_pods(kubectl, ns, third)] in ([None, None], [None]), \
        "a pod of the third unit placed in a slice another unit uses"
    assert {u: pools_of(kubectl, ns, u) for u in units} == where, "the running units moved"
