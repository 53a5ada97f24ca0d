"""Kueue admission per unit, the pure decisions (kueue.py): the Workload a unit asks for, Kueue's answer read back,
pods placed on the assigned flavor, a held or evicted unit's plan, and the quota handed back."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects
from diloco_operator.plan import autoscale, kueue, unitplan

pytestmark = pytest.mark.fast
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "labels": {kueue.QUEUE_LABEL: "team-a"}}}


def unit() -> dict:
    spec = api.DilocoJobSpec.model_validate({"image": "img:1", "units": [
        {"name": "gpu", "count": 4, "podsPerUnit": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]})
    lu = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 1, 1))
    lu["metadata"]["uid"] = "lu-1"
    return lu


def workload(conditions: list[dict], admission: dict | None = None, **status) -> dict:
    wl = kueue.unit_workload(unit(), "team-a", objects.unit_pod(unit(), 0, 0))
    wl["metadata"].update(resourceVersion="7", generation=1)
    wl["status"] = {"conditions": conditions, **({"admission": admission} if admission else {}), **status}
    return wl


def cond(type_: str, status: str, reason: str = "R", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [
    {"name": kueue.POD_SET, "flavors": {"nvidia.com/gpu": "h100-spot"}, "count": 2}]}


def test_a_units_workload_asks_for_its_pods_with_their_accelerators_and_is_owned_by_the_unit():
    lu = unit()
    wl = kueue.unit_workload(lu, "team-a", objects.unit_pod(lu, 0, 0), ("high", 1000))
    assert wl["metadata"]["name"] == "demo-gpu-1" and wl["metadata"]["ownerReferences"][0]["uid"] == "lu-1"
    assert wl["metadata"]["labels"][objects.LABEL_UNIT] == "demo-gpu-1"
    [pod_set] = wl["spec"]["podSets"]
    assert wl["spec"]["queueName"] == "team-a" and pod_set["count"] == 2
    assert pod_set["template"]["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "8"}
    assert pod_set["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
    assert wl["spec"]["priorityClassRef"]["name"] == "high" and wl["spec"]["priority"] == 1000


def test_only_a_job_labelled_with_a_queue_is_queued():
    assert kueue.queue_name(JOB) == "team-a"
    assert kueue.queue_name({"metadata": {"labels": {}}}) is None


def test_kueues_answer_is_read_as_pending_admitted_or_evicted():
    assert kueue.read_admission(None, "team-a").state == "pending"
    pending = kueue.read_admission(workload([cond("QuotaReserved", "False", "Pending", "insufficient quota")]), "q")
    assert pending.state == "pending" and "insufficient quota" in pending.message
    admitted = kueue.read_admission(workload([cond("QuotaReserved", "True"), cond("Admitted", "True")], ADMISSION), "q")
    assert admitted.state == "admitted" and admitted.flavors == ("h100-spot",) and admitted.cluster_queue == "cq"
    evicted = kueue.read_admission(workload([cond("Admitted", "True"), cond("Evicted", "True", "Preempted", "by x")],
                                            ADMISSION), "q")
    assert evicted.state == "evicted" and evicted.reason == "Preempted" and evicted.message == "by x"
    # Released (admission cleared): waiting again, even while Kueue's Evicted condition stays
    requeued = kueue.read_admission(workload([cond("Evicted", "True", "Preempted"), cond("QuotaReserved", "False")]),
                                    "q")
    assert requeued.state == "pending"


def test_an_admitted_pod_goes_to_the_flavors_nodes_and_tolerates_their_taints():
    lu = unit()
    pod = objects.unit_pod(lu, 0, 0)
    flavor = {"spec": {"nodeLabels": {"pool": "spot-h100"},
                       "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}}
    admission = kueue.Admission("admitted", "ok", flavors=("spot",), node_selector={"zone": "a"})
    placed = kueue.place(pod, admission, [flavor, flavor])
    assert placed["spec"]["nodeSelector"] == {**pod["spec"]["nodeSelector"], "pool": "spot-h100", "zone": "a"}
    assert placed["spec"]["tolerations"].count(flavor["spec"]["tolerations"][0]) == 1
    assert all(t in placed["spec"]["tolerations"] for t in pod["spec"]["tolerations"])
    assert pod["spec"].get("nodeSelector") != placed["spec"]["nodeSelector"], "the builder's pod is not changed"


def spec_of(lu: dict) -> api.LearnerUnitSpec:
    return api.LearnerUnitSpec.model_validate(lu["spec"])


def views(inc: int = 0, deleting: bool = False) -> list[unitplan.PodView]:
    return [unitplan.PodView(name=f"demo-gpu-1-{inc}-{r}", incarnation=inc, rank=r, phase="Running", ready=True,
                             deleting=deleting) for r in range(2)]


def test_a_unit_waiting_for_admission_creates_no_pod():
    plan = kueue.plan_held(spec_of(unit()), None, [], kueue.Admission("pending", "waiting for quota"), T0, 1)
    assert plan.create == [] and plan.delete == [] and plan.events == []
    assert plan.status.phase == "Pending" and plan.status.message == "waiting for quota"
    admitted = C.get_condition(plan.status.condition_dicts(), C.ADMITTED)
    assert admitted["status"] == "False" and admitted["reason"] == C.Reason.QUEUED_IN_KUEUE


def test_an_evicted_unit_loses_its_pods_and_says_so_once_without_counting_a_restart():
    running = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 1,
               "consecutiveFailures": 0, "conditions": []}
    running = kueue.admitted_condition(api.LearnerUnitStatus.read(running), kueue.Admission("admitted", "admitted by cq"),
                                       T0, 1)
    evicted = kueue.Admission("evicted", "preempted by high", "Preempted")
    plan = kueue.plan_held(spec_of(unit()), running, views(), evicted, T0, 1)
    assert sorted(plan.delete) == ["demo-gpu-1-0-0", "demo-gpu-1-0-1"] and plan.create == []
    assert [e[1] for e in plan.events] == [C.Reason.EVICTED_BY_KUEUE] and "preempted by high" in plan.events[0][2]
    assert plan.status.restarts == 1 and plan.status.incarnation == 1, "a new incarnation, not a restart"
    assert C.get_condition(plan.status.condition_dicts(), C.ADMITTED)["reason"] == C.Reason.EVICTED_BY_KUEUE
    again = kueue.plan_held(spec_of(unit()), plan.status, views(deleting=True), evicted, T0, 1)
    assert again.events == [] and again.delete == [] and again.status.incarnation == 1


def test_a_held_unit_never_reads_as_unschedulable_so_the_autoscaler_does_not_park_it():
    stuck = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Pending", "conditions": [
        {"type": C.PODS_SCHEDULED, "status": "False", "reason": C.Reason.UNSCHEDULABLE, "message": "no room",
         "lastTransitionTime": "2025-12-31T00:00:00Z"}]}
    lu = unit()
    assert autoscale.unit_state({**lu, "status": stuck}).unschedulable_since is not None
    held = kueue.plan_held(spec_of(lu), stuck, [], kueue.Admission("evicted", "preempted", "Preempted"), T0, 1)
    assert autoscale.unit_state({**lu, "status": held.status}).unschedulable_since is None


def test_readmitted_unit_launches_its_next_incarnation_once_old_pods_are_gone():
    lu = unit()
    held = kueue.plan_held(spec_of(lu), {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running"}, [],
                           kueue.Admission("pending", "requeued"), T0, 1).status
    plan = unitplan.plan_unit(spec_of(lu), lu["spec"], held, [], T0, generation=1)
    assert plan.create == [0, 1] and plan.status.launchedIncarnation == 1 and plan.status.restarts == 0


def test_an_evicted_workloads_quota_is_handed_back_as_kueues_integrations_do():
    wl = workload([cond("QuotaReserved", "True"), cond("Admitted", "True"),
                   cond("Evicted", "True", "Preempted", "to admit ns/high")], ADMISSION)
    patch = kueue.release_status(wl, T0)
    assert patch["metadata"]["resourceVersion"] == "7" and patch["status"]["admission"] is None
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    assert conds["Requeued"]["status"] == "True" and conds["Requeued"]["reason"] == "Preempted"
    assert conds["Evicted"]["status"] == "True", "Kueue's own condition is left to Kueue"


def test_a_finished_units_workload_is_marked_finished_once():
    wl = workload([cond("Admitted", "True")], ADMISSION)
    patch = kueue.finished_status(wl, "Succeeded", "all pods completed", T0)
    assert C.is_true(patch["status"]["conditions"], "Finished")
    wl["status"]["conditions"] = patch["status"]["conditions"]
    assert kueue.finished_status(wl, "Succeeded", "all pods completed", T0) is None
