"""The operator spends few API requests per unit (issue 9's scale targets): one Event per kind of unit change per
reconcile, no headless Service for single-pod units, a restart without backoff in one pass (one status write)."""

from __future__ import annotations

from datetime import datetime, timezone

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects
from diloco_operator.plan import jobplan, unitplan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "scale", "namespace": "ns", "uid": "u-1", "generation": 1}}


def job_spec(cpu: int = 1000, backoff: float = 0) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({
        "image": "img:1", "restartPolicy": {"backoffSeconds": backoff, "maxRestarts": 5},
        "units": [{"name": "cpu", "count": cpu},
                  {"name": "v5p", "count": 1, "podsPerUnit": 2, "accelerator": {"type": "tpu-v5p-slice", "count": 4}}]})


def unit(spec: api.DilocoJobSpec, template: int = 0) -> tuple[dict, api.LearnerUnitSpec, dict]:
    uspec = objects.unit_spec("scale", spec, spec.units[template], 0, template)
    lu = objects.learner_unit(JOB, uspec)
    lu["metadata"]["uid"] = "lu-1"
    return lu, uspec, lu["spec"]


def running(name: str, inc: int = 0, spec_hash: str | None = None) -> unitplan.PodView:
    return unitplan.PodView(name=name, incarnation=inc, rank=0, phase="Running", ready=True, node="n0",
                            spec_hash=spec_hash)


def test_a_thousand_units_created_at_once_are_one_event_per_template_within_the_message_limit():
    plan = jobplan.plan_units("scale", job_spec(), [])
    events = jobplan.unit_events(plan)
    assert [(e[1], e[2].split(":")[0]) for e in events] == [
        (C.Reason.UNIT_CREATED, "created 1000 learner unit(s) of cpu, 1 pod(s) each"),
        (C.Reason.UNIT_CREATED, "created 1 learner unit(s) of v5p, 2 pod(s) each")]
    assert len(events[0][2]) <= 1000 and events[0][2].endswith("more") and "scale-cpu-0 (unit index 0)" in events[0][2]
    assert events[1][2].endswith("scale-v5p-0 (unit index 1000)")


def test_removed_units_are_one_event_per_reason():
    plan = jobplan.UnitsPlan(delete=["scale-cpu-3", "scale-cpu-2", "scale-cpu-1"])
    events = jobplan.unit_events(plan, parked=["scale-cpu-2"])
    assert events == [("Normal", C.Reason.UNIT_REMOVED,
                       "removed 1 learner unit(s) (parked: their pods could not be placed): scale-cpu-2"),
                      ("Normal", C.Reason.UNIT_REMOVED, "removed 2 learner unit(s) (scaled down): scale-cpu-3, scale-cpu-1")]


def test_a_single_pod_unit_needs_no_headless_service_and_meets_itself_on_localhost():
    lu, uspec, _ = unit(job_spec())
    assert not objects.needs_unit_service(uspec)
    env = {e["name"]: e.get("value") for e in objects.unit_pod(lu, 0, 0)["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "localhost"
    tpu, tpu_spec, _ = unit(job_spec(), template=1)
    assert objects.needs_unit_service(tpu_spec)
    env = {e["name"]: e.get("value") for e in objects.unit_pod(tpu, 0, 1)["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "rank-0.scale-v5p-0" and env["TPU_WORKER_HOSTNAMES"] == "rank-0.scale-v5p-0,rank-1.scale-v5p-0"


def test_a_first_launch_posts_no_event_of_its_own():
    _, uspec, raw = unit(job_spec())
    plan = unitplan.plan_unit(uspec, raw, None, [], T0)
    assert plan.create == [0] and plan.events == [] and plan.status.launchedIncarnation == 0


def test_a_deleted_pod_without_backoff_is_replaced_in_the_same_pass_with_one_event():
    _, uspec, raw = unit(job_spec(backoff=0))
    status = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    plan = unitplan.plan_unit(uspec, raw, status, [], T0)  # the pod is gone
    assert plan.create == [0] and plan.delete == [] and plan.requeue_after is None
    assert plan.status.incarnation == plan.status.launchedIncarnation == 1 and plan.status.restarts == 1
    assert plan.status.phase == "Pending" and "restartAfter" not in plan.status
    assert [e[1] for e in plan.events] == [C.Reason.POD_DELETED]


def test_a_restart_still_waits_for_old_pods_or_a_backoff_and_then_tells_the_pods_it_created():
    _, uspec, raw = unit(job_spec(backoff=0))
    spec_changed = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    waiting = unitplan.plan_unit(uspec, raw, spec_changed, [running("scale-cpu-0-0-0", spec_hash="old")], T0)
    assert waiting.create == [] and waiting.delete == ["scale-cpu-0-0-0"] and waiting.status.phase == "Restarting"
    _, uspec, raw = unit(job_spec(backoff=2))
    plan = unitplan.plan_unit(uspec, raw, {**spec_changed, "incarnation": 0}, [], T0)
    assert plan.create == [] and plan.status.phase == "Restarting"
    later = unitplan.plan_unit(uspec, raw, plan.status, [], datetime(2026, 1, 1, 0, 0, 3, tzinfo=timezone.utc))
    assert later.create == [0] and [e[1] for e in later.events] == [C.Reason.PODS_CREATED]


def test_only_a_launch_still_starting_with_its_restart_on_record_may_wait_for_its_running_status():
    _, uspec, raw = unit(job_spec())
    launched = unitplan.plan_unit(uspec, raw, None, [], T0).status
    assert unitplan.status_may_wait(launched), "pods created, none ready yet"
    placed = unitplan.PodView(name="scale-cpu-0-0-0", incarnation=0, rank=0, phase="Pending", node="n0")
    assert unitplan.status_may_wait(unitplan.plan_unit(uspec, raw, launched, [placed], T0).status)
    refused = unitplan.PodView(name="scale-cpu-0-0-0", incarnation=0, rank=0, phase="Pending", unschedulable="no room")
    assert not unitplan.status_may_wait(unitplan.plan_unit(uspec, raw, launched, [refused], T0).status)
    assert not unitplan.status_may_wait(unitplan.plan_unit(uspec, raw, launched, [running("scale-cpu-0-0-0")], T0).status)
    restarted = unitplan.plan_unit(uspec, raw, launched.model_copy(update={"phase": "Running"}), [], T0).status
    assert restarted.phase == "Pending" and not unitplan.status_may_wait(restarted, launched), \
        "a restart not on record yet is written at once"
    on_record = restarted.model_copy(update={"phase": "Restarting", "launchedIncarnation": 0})  # written when the old pod went
    assert unitplan.status_may_wait(restarted, on_record), "then its launch may wait for the Running status"
