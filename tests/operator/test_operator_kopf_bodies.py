"""The operator's copies of kopf's watch bodies: the cache's copy is a deep one, and kopf's diff base comes out as
kopf's own storage builds it, for the objects the operator watches."""

from __future__ import annotations

import copy
import json

import kopf
import pytest

from diloco_operator.api import models as api
from diloco_operator.kopf_bodies import SlimDiffBaseStorage, tree_copy
from diloco_operator.objects import builders as objects

JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 3,
                    "labels": {"team": "lm"},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": '{"spec":{}}',
                                    "kopf.zalando.org/last-handled-configuration": '{"spec":{}}\n',
                                    "note": "kept"},
                    "managedFields": [{"manager": "kubectl", "operation": "Apply",
                                       "fieldsV1": {"f:spec": {"f:units": {}}}}]},
       "spec": {"image": "img:1", "units": [{"name": "cpu", "count": 2}],
                "chaos": {"schedule": {"intervalSeconds": 30}, "action": "kill-learner"}},
       "status": {"phase": "Training", "conditions": [{"type": "Ready", "status": "True"}], "unitsReady": 2}}


def _watched_objects() -> list[dict]:
    spec = api.DilocoJobSpec.model_validate(JOB["spec"] | {"chaos": None})
    unit_spec = objects.unit_spec("demo", spec, spec.units[0], 0, 0)
    unit = objects.learner_unit(JOB, unit_spec)
    unit["metadata"] |= {"uid": "u-2", "resourceVersion": "17", "generation": 1,
                         "managedFields": [{"manager": "diloco-operator", "fieldsV1": {"f:status": {}}}]}
    unit["status"] = {"phase": "Running", "incarnation": 1, "restarts": 1,
                      "conditions": [{"type": "Ready", "status": "True", "reason": "PodsRunning"}]}
    pod = objects.unit_pod(unit, incarnation=1, rank=0)
    pod["metadata"] |= {"uid": "u-3", "resourceVersion": "18",
                        "managedFields": [{"manager": "kwok", "subresource": "status", "fieldsV1": {"f:status": {}}}]}
    pod["spec"]["nodeName"] = "kwok-node-0"
    pod["status"] = {"phase": "Running", "podIP": "10.244.0.7",
                     "conditions": [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized", "Ready")],
                     "containerStatuses": [{"name": "learner", "ready": True, "restartCount": 0,
                                            "state": {"running": {"startedAt": "2026-11-27T06:00:00Z"}}}]}
    return [copy.deepcopy(JOB), unit, pod]


@pytest.mark.parametrize("obj", _watched_objects(), ids=["job", "unit", "pod"])
def test_the_cache_copy_of_a_body_is_equal_to_it_and_shares_nothing_mutable(obj):
    raw = copy.deepcopy(obj)
    snapshot = tree_copy(kopf.Body(raw))
    assert snapshot == obj and type(snapshot) is dict
    assert json.loads(json.dumps(snapshot)) == snapshot  # plain dicts and lists, as a parsed API object
    # What kopf holds changing afterwards (its live views are updated in place) does not reach the copy, at any depth.
    raw["metadata"]["labels"]["changed"] = "yes"
    raw["status"]["conditions"][0]["status"] = "False"
    raw["status"]["conditions"].append({"type": "New"})
    raw["spec"].clear()
    assert snapshot == obj


@pytest.mark.parametrize("obj", _watched_objects(), ids=["job", "unit", "pod"])
@pytest.mark.parametrize("extra_fields", [None, ["status.phase"], ["metadata.generation"]])
def test_the_slim_diff_base_is_the_essence_kopfs_own_storage_builds(obj, extra_fields):
    ours = SlimDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(obj)), extra_fields=extra_fields)
    kopfs = kopf.AnnotationsDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(obj)), extra_fields=extra_fields)
    assert ours == kopfs
    assert "status" not in ours or extra_fields == ["status.phase"]
    assert "kopf.zalando.org/last-handled-configuration" not in ours.get("metadata", {}).get("annotations", {})


def test_the_slim_diff_base_shares_nothing_with_the_body():
    obj = _watched_objects()[0]
    body = kopf.Body(obj)
    essence = SlimDiffBaseStorage().build(body=body)
    obj["spec"]["units"][0]["count"] = 5
    obj["metadata"]["labels"]["team"] = "other"
    assert essence["spec"]["units"][0]["count"] == 2 and essence["metadata"]["labels"]["team"] == "lm"
