"""CPU work stays off accelerator nodes (issue 8): GPU/TPU pools are tainted, and CPU learner pods (and a syncer
without a nodeSelector) carry a required affinity against accelerator labels, so this holds where pools are not."""

from __future__ import annotations

import pytest

from diloco_devcluster import pools
from diloco_devcluster.pools import NodePool
from diloco_kube.labels import POOL_LABEL
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects

from polling import wait_for

JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}
ACCELERATOR_POOLS = {p.name for p in pools.DEFAULT_POOLS if set(p.labels) & set(api.ACCELERATOR_NODE_LABELS)}


def _unit(template: dict) -> dict:
    spec = api.DilocoJobSpec.model_validate({"image": "img:1", "units": [template]})
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"  # the apiserver's, once created
    return unit


def _keeps_off_accelerators(pod_spec: dict) -> bool:
    terms = (pod_spec.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
    return len(terms) == 1 and {(e["key"], e["operator"]) for e in terms[0]["matchExpressions"]} == {
        (label, "DoesNotExist") for label in api.ACCELERATOR_NODE_LABELS}


def test_every_fake_accelerator_pool_is_tainted_like_a_real_one():
    for pool in pools.DEFAULT_POOLS:
        resources = {r for r in pool.capacity if r in ("nvidia.com/gpu", "google.com/tpu")}
        assert {t["key"] for t in pool.taints if t["effect"] == "NoSchedule"} == resources, pool.name
    assert ACCELERATOR_POOLS == {"gpu-h100", "gpu-l4", "tpu-v5p"}


@pytest.mark.parametrize("template", [{"name": "cpu"}, {"name": "cpu", "nodeSelector": {POOL_LABEL: "cpu"}}],
                         ids=["without nodeSelector", "with nodeSelector"])
def test_a_cpu_unit_pod_requires_a_node_without_accelerator_labels(template):
    pod = objects.unit_pod(_unit(template), 0, 0)
    assert _keeps_off_accelerators(pod["spec"])


def test_an_accelerator_unit_pod_has_no_such_affinity():
    pod = objects.unit_pod(_unit({"name": "gpu", "accelerator": {"type": "nvidia-l4", "count": 1}}), 0, 0)
    assert "affinity" not in pod["spec"] and pod["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-l4"}


def test_the_syncer_stays_off_accelerators_unless_its_nodeselector_says_otherwise():
    spec = api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu"}]})
    default = objects.syncer_deployment(JOB, spec)["spec"]["template"]["spec"]
    assert _keeps_off_accelerators(default) and "nodeSelector" not in default
    placed = spec.model_copy(update={"syncer": api.SyncerSpec(nodeSelector={POOL_LABEL: "gpu-l4"})})
    chosen = objects.syncer_deployment(JOB, placed)["spec"]["template"]["spec"]
    assert "affinity" not in chosen and chosen["nodeSelector"] == {POOL_LABEL: "gpu-l4"}


@pytest.mark.cluster
def test_cpu_units_without_nodeselector_never_land_on_accelerator_nodes(kubectl, operator, ns):
    # An UNTAINTED accelerator node with the most free CPU: the scheduler's scoring would favour it, only the
    # affinity keeps CPU pods away (the tainted pools would repel them anyway).
    bait = NodePool("gpu-untainted", 1, {"cpu": "416", "memory": "3000Gi", "nvidia.com/gpu": "8", "pods": "110"},
                    {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4", "nvidia.com/gpu.present": "true"})
    (node,) = pools.node_objects((bait,))
    kubectl.apply(node)
    try:
        wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                             for c in (kubectl.get("node", node["metadata"]["name"]) or {})
                             .get("status", {}).get("conditions", [])), 30, "the untainted GPU node Ready", 0.2)
        job = {"apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": "anywhere"},
               "spec": {"image": "diloco-trainer:test", "units": [{"name": "cpu", "count": 3, "podsPerUnit": 2}]}}
        kubectl.apply(job, "-n", ns)

        def placed():
            got = [p for p in kubectl.get("pods", ns=ns, selector="diloco.dev/job=anywhere")
                   if p["spec"].get("nodeName")]
            return got if len(got) == 7 else None  # 6 learner pods and the syncer
        for pod in wait_for(placed, 60, "6 learner pods and the syncer scheduled", 0.2):
            labels = kubectl.get("node", pod["spec"]["nodeName"])["metadata"]["labels"]
            where = f"{pod['metadata']['name']} on {pod['spec']['nodeName']} ({labels.get(POOL_LABEL)})"
            assert not set(labels) & set(api.ACCELERATOR_NODE_LABELS), where
            assert labels.get(POOL_LABEL) not in ACCELERATOR_POOLS | {"gpu-untainted"}, where
    finally:
        kubectl.run("delete", "node", node["metadata"]["name"], "--wait=false", check=False)
