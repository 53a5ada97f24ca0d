"""Unit tests of warm spare pods' pure parts (no cluster): which spare a unit can take, when a restart takes one,
what a spare pod carries (and does not), and the takeover patch."""

from __future__ import annotations

from datetime import datetime, timezone

from diloco_kube.pod_phase import effective_phase
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.objects import spares as S
from diloco_operator.plan import unitplan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}


def job_spec(**template) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu", "count": 3, "spares": 1,
                                                                         **template}]})


def unit_of(spec: api.DilocoJobSpec, index: int) -> dict:
    unit = O.learner_unit(JOB, O.unit_spec("demo", spec, spec.units[0], index, index), epoch=4)
    unit["metadata"]["uid"] = f"unit-{index}"
    return unit


def running_spare(spec: api.DilocoJobSpec, name: str, start: str, **meta) -> dict:
    pod = S.spare_pod(JOB, S.spare_template_spec("demo", spec, spec.units[0]))
    pod["metadata"].update(name=name, resourceVersion="7", **meta)
    pod["status"] = {"phase": "Running", "startTime": start}
    return pod


def test_a_spare_pod_carries_no_unit_identity_or_token_only_the_spare_key_and_its_assignment_file():
    pod = S.spare_pod(JOB, S.spare_template_spec("demo", job_spec(), job_spec().units[0]))
    meta, container = pod["metadata"], pod["spec"]["containers"][0]
    assert meta["labels"][S.LABEL_SPARE] == S.SPARE_WAITING and O.LABEL_UNIT not in meta["labels"]
    assert meta["name"].startswith("demo-cpu-spare-") and meta["ownerReferences"][0]["kind"] == "DilocoJob"
    command = container["command"]
    for flag in ("--learner-id", "--unit", "--units", "--token-file"):
        assert flag not in command, flag
    assert command[:2] == ["diloco", "pod-learner"] and "--assignment-file" in command[:command.index("--")]
    assert {e["name"] for e in container["env"]} & {"DILOCO_UNIT", "DILOCO_LEARNER_ID"} == set()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert O.TOKEN_VOLUME not in volumes and volumes["spare-key"]["secret"]["secretName"] == "demo-spare-key"
    field = volumes["assignment"]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"]
    assert field == "metadata.annotations['diloco.dev/assignment']"


def test_every_unit_of_a_template_can_take_its_spares_and_a_changed_template_cannot():
    spec = job_spec()
    hashes = {S.spare_hash(unit_of(spec, i)["spec"]) for i in range(3)}
    assert len(hashes) == 1
    assert S.spare_hash(unit_of(job_spec(image="img:2"), 0)["spec"]) not in hashes


def test_a_unit_takes_the_warmest_running_waiting_spare_of_its_template_only():
    spec = job_spec()
    unit = unit_of(spec, 1)
    old, new = running_spare(spec, "old", "2026-01-01T00:00:00Z"), running_spare(spec, "new", "2026-01-01T00:05:00Z")
    pending = running_spare(spec, "pending", "2026-01-01T00:00:00Z")
    pending["status"]["phase"] = "Pending"
    going = running_spare(spec, "going", "2026-01-01T00:00:00Z", deletionTimestamp="2026-01-01T00:06:00Z")
    stale = running_spare(job_spec(image="img:0"), "stale", "2026-01-01T00:00:00Z")
    dead = running_spare(spec, "dead", "2026-01-01T00:00:00Z")  # its container ended; the phase not moved yet
    dead["status"]["containerStatuses"] = [{"name": "learner", "state": {"terminated": {"exitCode": 137}}}]
    picked = S.usable_spares([new, pending, going, stale, dead, old], unit["spec"])
    assert [p["metadata"]["name"] for p in picked] == ["old", "new"]


def test_the_takeover_patch_relabels_reowns_and_is_conditional_on_the_spares_version():
    spec = job_spec()
    unit = unit_of(spec, 2)
    patch = S.takeover_patch(running_spare(spec, "s", "t"), unit, 3, "sealed")["metadata"]
    assert patch["resourceVersion"] == "7"
    assert patch["labels"] == {S.LABEL_SPARE: None, O.LABEL_UNIT: "demo-cpu-2", O.LABEL_INCARNATION: "3",
                               O.LABEL_RANK: "0"}
    assert patch["ownerReferences"][0]["uid"] == "unit-2" and patch["annotations"]["diloco.dev/assignment"] == "sealed"
    assert patch["annotations"][O.ANNOTATION_SPEC_HASH] == O.pod_spec_hash(unit["spec"])


def test_no_spares_for_a_finished_job_or_one_queued_in_kueue():
    spec = job_spec()
    assert S.spares_wanted(spec, queued=False, finished=False) == {"cpu": 1}
    assert S.spares_wanted(spec, queued=True, finished=False) == {}
    assert S.spares_wanted(spec, queued=False, finished=True) == {}


def _plan(status: dict, spare: bool) -> unitplan.UnitPlan:
    spec = job_spec()
    unit = unit_of(spec, 0)
    uspec = api.LearnerUnitSpec.model_validate(unit["spec"])
    return unitplan.plan_unit(uspec, unit["spec"], status, [], T0, spare=spare)  # its one pod was deleted


def test_a_running_units_deleted_pod_takes_a_spare_at_once_while_a_failing_one_backs_off():
    running = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    plan = _plan(running, spare=True)
    assert plan.take_spare and plan.create == [] and plan.requeue_after is None
    assert plan.status.incarnation == plan.status.launchedIncarnation == 1 and plan.status.restarts == 1
    assert plan.events[0][1] == C.Reason.POD_DELETED and "warm spare pod takes over" in plan.events[0][2]
    assert not _plan(running, spare=False).take_spare, "no spare up: the restart as before"
    failing = {**running, "consecutiveFailures": 1}
    plan = _plan(failing, spare=True)
    assert not plan.take_spare and plan.requeue_after and plan.requeue_after > 0, "a crash loop backs off"


def _killed_pod(spec: api.DilocoJobSpec, unit: dict, exit_code: int) -> dict:
    """The unit's pod as the kubelet first reports its container SIGKILLed: the container `terminated`, the phase
    still Running (the phase follows ~1 s later, once the kubelet has stopped the pod; measured on the real node)."""
    return {"metadata": {"name": f"{unit['metadata']['name']}-0-0",
                         "labels": {O.LABEL_INCARNATION: "0", O.LABEL_RANK: "0"},
                         "annotations": {O.ANNOTATION_SPEC_HASH: O.pod_spec_hash(unit["spec"])}},
            "spec": {"restartPolicy": "Never", "nodeName": "n1", "containers": [{"name": "learner"}]},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "learner", "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}]}}


def test_a_units_pod_whose_container_was_killed_takes_a_spare_before_the_kubelet_moves_its_phase():
    spec = job_spec()
    unit = unit_of(spec, 0)
    uspec = api.LearnerUnitSpec.model_validate(unit["spec"])
    running = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    view = unitplan.pod_view(_killed_pod(spec, unit, 137))
    assert view.phase == "Failed" and view.failure == "learner: Error (exit code 137)"
    plan = unitplan.plan_unit(uspec, unit["spec"], running, [view], T0, spare=True)
    assert plan.take_spare and plan.events[0][1] == C.Reason.POD_FAILED and "exit code 137" in plan.events[0][2]
    assert plan.status.incarnation == 1


def test_a_pods_phase_is_the_one_the_kubelet_will_report_once_every_container_has_ended():
    spec = job_spec()
    unit = unit_of(spec, 0)
    assert effective_phase(_killed_pod(spec, unit, 137)) == "Failed"
    assert effective_phase(_killed_pod(spec, unit, 0)) == "Succeeded", "a learner that finished its steps"
    two = _killed_pod(spec, unit, 137)
    two["spec"]["containers"].append({"name": "sidecar"})
    assert effective_phase(two) == "Running", "a container not reported ended yet: still Running"
    two["status"]["containerStatuses"].append({"name": "sidecar", "state": {"running": {}}})
    assert effective_phase(two) == "Running", "another container still runs"
    restarts = _killed_pod(spec, unit, 137)
    restarts["spec"]["restartPolicy"] = "OnFailure"
    assert effective_phase(restarts) == "Running", "the kubelet restarts that container: not ended"


def _unplaceable_pod(unit: dict, scheduled: bool = False) -> dict:
    """The unit's pod as the scheduler leaves it on a full node: Pending, PodScheduled=False/Unschedulable."""
    cond = ({"type": "PodScheduled", "status": "True"} if scheduled else
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 1 Insufficient cpu."})
    return {"metadata": {"name": f"{unit['metadata']['name']}-0-0",
                         "labels": {O.LABEL_INCARNATION: "0", O.LABEL_RANK: "0"},
                         "annotations": {O.ANNOTATION_SPEC_HASH: O.pod_spec_hash(unit["spec"])}},
            "spec": {"restartPolicy": "Never", "nodeName": "n1" if scheduled else None,
                     "containers": [{"name": "learner"}]},
            "status": {"phase": "Pending", "conditions": [cond]}}


def test_a_unit_whose_pod_cannot_be_placed_takes_the_place_of_a_running_spare_without_counting_a_restart():
    spec = job_spec()
    unit = unit_of(spec, 0)
    uspec = api.LearnerUnitSpec.model_validate(unit["spec"])
    pending = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Pending", "restarts": 0}
    view = unitplan.pod_view(_unplaceable_pod(unit))
    plan = unitplan.plan_unit(uspec, unit["spec"], pending, [view], T0, spare=True)
    assert plan.take_spare and plan.delete == [view.name] and plan.create == []
    assert plan.status.incarnation == plan.status.launchedIncarnation == 1
    assert plan.status.restarts == 0 and not plan.status.lastFault, "nothing failed: no restart, no fault"
    assert plan.events == [("Normal", C.Reason.SPARE_TOOK_PLACE, plan.events[0][2])]
    assert "Insufficient cpu" in plan.events[0][2] and "incarnation 1" in plan.events[0][2]
    # Without a running spare, or with the pod placed (it only starts), the unit waits for its pod as before.
    for spare, pod in ((False, _unplaceable_pod(unit)), (True, _unplaceable_pod(unit, scheduled=True))):
        plan = unitplan.plan_unit(uspec, unit["spec"], pending, [unitplan.pod_view(pod)], T0, spare=spare)
        assert not plan.take_spare and plan.delete == [] and plan.status.incarnation == 0
    # A unit of two pods does not take a spare (a spare is one pod).
    two = api.LearnerUnitSpec.model_validate({**unit["spec"], "podsPerUnit": 2})
    plan = unitplan.plan_unit(two, {**unit["spec"], "podsPerUnit": 2}, pending, [view], T0, spare=True)
    assert not plan.take_spare
