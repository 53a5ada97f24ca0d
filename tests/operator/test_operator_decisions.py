"""Unit tests of the pure reconcile decisions (no cluster): unit healing, scaling, status and conditions."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from diloco_kube.client import status_patch
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects
from diloco_operator.plan import jobplan, unitplan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}


def job_spec(**kw) -> api.DilocoJobSpec:
    base = {"image": "img:1", "units": [{"name": "gpu", "count": 2, "podsPerUnit": 2,
                                         "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                                        {"name": "cpu", "count": 1}]}
    base.update(kw)
    return api.DilocoJobSpec.model_validate(base)


def unit_spec(pods: int = 2, **policy) -> tuple[api.LearnerUnitSpec, dict]:
    spec = objects.unit_spec("demo", job_spec(restartPolicy={"backoffSeconds": 2, "maxRestarts": 2, **policy}),
                             api.UnitTemplate(name="gpu", podsPerUnit=pods), 0, 0)
    return spec, spec.model_dump(mode="json", exclude_none=True)


def pod(rank: int, inc: int = 0, phase: str = "Running", ready: bool = True, h: str | None = None, **kw):
    return unitplan.PodView(name=f"demo-gpu-0-{inc}-{rank}", incarnation=inc, rank=rank, phase=phase, ready=ready,
                            node=f"n{rank}", spec_hash=h, **kw)


def test_a_new_unit_creates_all_its_pods_and_records_the_launch():
    spec, raw = unit_spec()
    plan = unitplan.plan_unit(spec, raw, None, [], T0)
    assert plan.create == [0, 1] and plan.delete == []
    assert plan.status.launchedIncarnation == 0 and plan.status.phase == "Pending"


def test_a_running_unit_is_left_alone():
    spec, raw = unit_spec()
    h = objects.pod_spec_hash(raw)
    status = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, h=h), pod(1, h=h)], T0)
    assert plan.create == [] and plan.delete == [] and plan.status.phase == "Running"
    assert plan.status.podsReady == 2 and plan.events == []


def test_a_deleted_pod_restarts_the_whole_unit_with_backoff_and_counts_it():
    spec, raw = unit_spec()
    h = objects.pod_spec_hash(raw)
    status = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, h=h)], T0)  # rank 1 was deleted
    assert plan.delete == ["demo-gpu-0-0-0"], "the surviving rank is restarted with the group"
    assert plan.create == [] and plan.status.incarnation == 1 and plan.status.restarts == 1
    assert plan.status.phase == "Restarting" and plan.status.restartAfter == C.now_iso(T0 + timedelta(seconds=2))
    assert plan.events[0][1] == C.Reason.POD_DELETED
    # Before the backoff ends nothing is created; afterwards the new incarnation's pods are.
    waiting = unitplan.plan_unit(spec, raw, plan.status, [], T0 + timedelta(seconds=1))
    assert waiting.create == [] and waiting.requeue_after == pytest.approx(1.0)
    later = unitplan.plan_unit(spec, raw, plan.status, [], T0 + timedelta(seconds=2))
    assert later.create == [0, 1] and later.status.launchedIncarnation == 1


@pytest.mark.parametrize("disruption, reason", [
    ("DeletionByTaintManager", C.Reason.EVICTED_BY_TAINT), ("EvictionByEvictionAPI", C.Reason.EVICTED),
    ("PreemptionByScheduler", C.Reason.PREEMPTED)])
def test_a_pod_kubernetes_deletes_and_says_why_restarts_the_unit_at_once_and_is_not_its_failure(disruption, reason):
    """The taint manager evicting from a node not Ready past nodeLostSeconds (the sign of a lost node for an operator
    that may not read Nodes), a drain, a preemption: counted in status, with the reason, but no backoff and not
    towards maxRestarts (a unit that already used its restarts still restarts)."""
    spec, raw = unit_spec(maxRestarts=1)
    h = objects.pod_spec_hash(raw)
    status = {"incarnation": 1, "launchedIncarnation": 1, "phase": "Running", "restarts": 1}
    evicted = pod(1, 1, h=h, deleting=True, disruption=disruption)
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, 1, h=h), evicted], T0)
    assert plan.status.phase != "Failed" and plan.status.incarnation == 2 and plan.status.restarts == 2
    assert plan.status.consecutiveFailures == 0 and plan.status.restartAfter == C.now_iso(T0), "no backoff"
    assert plan.status.lastFault.reason == reason and "demo-gpu-0-1-1" in plan.status.lastFault.message
    assert plan.events[0][1] == reason and plan.delete == ["demo-gpu-0-1-0"], "the other rank goes with it"
    # A node-pressure eviction by the kubelet stays the unit's failure (a learner over its requests goes first).
    by_kubelet = pod(1, 1, "Failed", False, h=h, failure="Evicted", disruption="TerminationByKubelet")
    failed = unitplan.plan_unit(spec, raw, status, [pod(0, 1, h=h), by_kubelet], T0)
    assert failed.status.phase == "Failed" and failed.events[0][1] == C.Reason.BACKOFF_LIMIT_EXCEEDED


def test_a_pods_disruption_target_condition_is_read():
    manifest = {"metadata": {"name": "p", "labels": {}, "deletionTimestamp": "2026-01-01T00:00:30Z"},
                "status": {"phase": "Running", "conditions": [
                    {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                     "message": "Taint manager: deleting due to NoExecute taint"}]}}
    assert unitplan.pod_view(manifest).disruption == "DeletionByTaintManager"
    manifest["status"]["conditions"][0]["status"] = "False"
    assert unitplan.pod_view(manifest).disruption is None


def test_a_failed_pod_is_a_counted_restart_and_backoff_doubles():
    spec, raw = unit_spec(maxRestarts=5)
    status = {"incarnation": 3, "launchedIncarnation": 3, "restarts": 2, "consecutiveFailures": 2}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, 3), pod(1, 3, "Failed", False, failure="exit code 137")], T0)
    assert plan.status.restarts == 3 and plan.events[0][1] == C.Reason.POD_FAILED
    assert "exit code 137" in plan.events[0][2]
    assert plan.requeue_after == pytest.approx(8.0)  # 2s * 2**(3-1)


def test_old_pods_must_be_gone_before_a_new_incarnation_starts():
    spec, raw = unit_spec()
    status = {"incarnation": 1, "launchedIncarnation": 0, "restarts": 1, "restartAfter": C.now_iso(T0)}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, 0, deleting=True)], T0 + timedelta(seconds=5))
    assert plan.create == [] and plan.status.phase == "Restarting"


def test_the_restart_limit_makes_the_unit_failed_and_that_sticks():
    spec, raw = unit_spec(maxRestarts=1)
    status = {"incarnation": 1, "launchedIncarnation": 1, "restarts": 1}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, 1, "Failed", False)], T0)
    assert plan.status.phase == "Failed" and plan.events[0][1] == C.Reason.BACKOFF_LIMIT_EXCEEDED
    again = unitplan.plan_unit(spec, raw, plan.status, [], T0 + timedelta(hours=1))
    assert again.status.phase == "Failed" and again.create == []


def test_a_changed_spec_recreates_the_pods_without_counting_a_restart():
    spec, raw = unit_spec()
    status = {"incarnation": 0, "launchedIncarnation": 0, "restarts": 0}
    plan = unitplan.plan_unit(spec, raw, status, [pod(0, h="old"), pod(1, h="old")], T0)
    assert plan.status.restarts == 0 and plan.status.incarnation == 1
    assert plan.events[0][1] == C.Reason.SPEC_CHANGED and plan.requeue_after == pytest.approx(0.2)


def test_an_unschedulable_pod_sets_pods_scheduled_false_once():
    spec, raw = unit_spec(pods=1)
    status = {"incarnation": 0, "launchedIncarnation": 0}
    p = pod(0, phase="Pending", ready=False, unschedulable="0/8 nodes: Insufficient nvidia.com/gpu")
    plan = unitplan.plan_unit(spec, raw, status, [p], T0)
    cond = C.get_condition(plan.status.condition_dicts(), C.PODS_SCHEDULED)
    assert cond["status"] == "False" and cond["reason"] == C.Reason.UNSCHEDULABLE
    assert [e[1] for e in plan.events] == [C.Reason.UNSCHEDULABLE]
    assert unitplan.plan_unit(spec, raw, plan.status, [p], T0).events == [], "the Event is posted on the flip only"


def test_condition_transition_time_moves_only_when_status_flips():
    conds = C.set_condition([], C.READY, False, "A", "", T0)
    conds = C.set_condition(conds, C.READY, False, "B", "other reason", T0 + timedelta(minutes=1))
    assert conds[0]["lastTransitionTime"] == C.now_iso(T0) and conds[0]["reason"] == "B"
    conds = C.set_condition(conds, C.READY, True, "C", "", T0 + timedelta(minutes=2))
    assert conds[0]["lastTransitionTime"] == C.now_iso(T0 + timedelta(minutes=2))


def test_distribute_grows_round_robin_within_max_and_shrinks_from_the_last_template():
    ts = [api.UnitTemplate(name="a", count=1, maxCount=2), api.UnitTemplate(name="b", count=1, minCount=1)]
    assert jobplan.distribute(ts, 2) == {"a": 1, "b": 1}
    assert jobplan.distribute(ts, 5) == {"a": 2, "b": 3}
    assert jobplan.distribute(ts, 1) == {"a": 0, "b": 1}
    assert jobplan.distribute(ts, 0) == {"a": 0, "b": 1}, "minCount bounds the shrink"


def _views(plan: jobplan.UnitsPlan) -> list[jobplan.UnitView]:
    return [jobplan.UnitView(n, s.template, s.index, s.unitIndex, "Running", 1, 1, 0, False, False,
                             s.model_dump(mode="json", exclude_none=True)) for n, s in plan.create.items()]


def test_scaling_adds_and_removes_units_without_touching_the_others():
    spec = job_spec()
    first = jobplan.plan_units("demo", spec, [])
    assert sorted(first.create) == ["demo-cpu-0", "demo-gpu-0", "demo-gpu-1"]
    assert sorted(s.unitIndex for s in first.create.values()) == [0, 1, 2]
    existing = _views(first)
    up = jobplan.plan_units("demo", job_spec(replicas=5), existing)
    assert up.delete == [] and up.update == {} and sorted(up.create) == ["demo-cpu-1", "demo-gpu-2"]
    assert {s.unitIndex for s in up.create.values()} == {3, 4}, "new units get unused data shards"
    down = jobplan.plan_units("demo", job_spec(replicas=1), existing)
    assert down.create == {} and down.update == {} and down.delete == ["demo-gpu-1", "demo-cpu-0"]


def test_a_changed_job_image_updates_existing_unit_specs():
    existing = _views(jobplan.plan_units("demo", job_spec(), []))
    plan = jobplan.plan_units("demo", job_spec(image="img:2"), existing)
    assert sorted(plan.update) == ["demo-cpu-0", "demo-gpu-0", "demo-gpu-1"] and not plan.create and not plan.delete


def _unit(name: str, phase: str, unschedulable: bool = False, restarts: int = 0) -> jobplan.UnitView:
    return jobplan.UnitView(name, "gpu", int(name[-1]), int(name[-1]), phase, 1, 1, restarts, unschedulable, False, {})


def test_job_status_is_running_and_ready_with_all_units_and_the_syncer_up():
    typed, events = jobplan.job_status("demo", job_spec(), 1, [_unit("u0", "Running"), _unit("u1", "Running"),
                                                               _unit("u2", "Running")], True, None, T0)
    st = typed.wire()
    assert st["phase"] == "Running" and st["unitsReady"] == 3 and st["unitsDesired"] == 3
    assert C.is_true(st["conditions"], C.READY) and C.is_true(st["conditions"], C.QUORUM_AVAILABLE)
    assert not C.is_true(st["conditions"], C.DEGRADED) and not C.is_true(st["conditions"], C.PROGRESSING)
    assert events == []


def test_an_unschedulable_unit_degrades_the_job_and_posts_one_event():
    units = [_unit("u0", "Running"), _unit("u1", "Pending", unschedulable=True), _unit("u2", "Running")]
    st, events = jobplan.job_status("demo", job_spec(), 1, units, True, None, T0)
    st = st.wire()
    deg = C.get_condition(st["conditions"], C.DEGRADED)
    assert deg["status"] == "True" and deg["reason"] == C.Reason.UNITS_UNSCHEDULABLE and "u1" in deg["message"]
    assert [e[1] for e in events] == [C.Reason.UNITS_UNSCHEDULABLE]
    st2, events2 = jobplan.job_status("demo", job_spec(), 1, units, True, st, T0 + timedelta(seconds=5))
    assert events2 == [] and st2.wire()["conditions"] == st["conditions"]


def test_too_few_runnable_units_for_the_quorum_fail_the_job_for_good():
    spec = job_spec(config={"outer": {"quorum": 2}})
    units = [_unit("u0", "Failed"), _unit("u1", "Failed"), _unit("u2", "Running")]
    st, events = jobplan.job_status("demo", spec, 1, units, True, None, T0)
    assert st.phase == "Failed" and C.is_true(st.condition_dicts(), C.FAILED)
    assert any(e[1] == "JobFailed" for e in events)
    healed = [_unit("u0", "Running"), _unit("u1", "Running"), _unit("u2", "Running")]
    assert jobplan.job_status("demo", spec, 1, healed, True, st, T0)[0].phase == "Failed"


def test_status_patch_writes_only_changes_and_nulls_removed_keys():
    assert status_patch({"a": 1}, {"a": 1}) is None
    assert status_patch({"a": 1, "b": 2}, {"a": 3}) == {"a": 3, "b": None}


def test_a_units_new_fault_replaces_every_figure_of_the_one_before_in_the_status_it_writes():
    """A merge patch merges objects: the new lastFault's patch must null what the old one had and the new one has
    not yet (its recovery and lost work), or a second fault would show the first one's figures."""
    first = {"phase": "Running", "lastFault": {"time": "t1", "reason": "PodDeleted", "incarnation": 2,
                                               "recoveredAt": "t1+5", "recoverySeconds": 5, "lostSteps": 0,
                                               "lostTokens": 128}}
    second = {"phase": "Restarting", "lastFault": {"time": "t2", "reason": "PodDeleted", "incarnation": 3}}
    patch = status_patch(first, second)
    assert patch == {"phase": "Restarting", "lastFault": {"time": "t2", "incarnation": 3, "recoveredAt": None,
                                                          "recoverySeconds": None, "lostSteps": None,
                                                          "lostTokens": None}}
    assert merge_patched(first, patch) == second
    assert status_patch({"o": {"a": 1}}, {"o": {}}) == {"o": {"a": None}}
    assert status_patch({"o": 1}, {"o": {"a": 1}}) == {"o": {"a": 1}}


def merge_patched(doc: dict, patch: dict) -> dict:
    """RFC 7386, as the API server applies a merge patch."""
    out = dict(doc)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = merge_patched(out.get(key) if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = value
    return out


def test_pods_are_placed_on_their_accelerator_pool_with_rendezvous_env():
    spec = job_spec()
    tmpl = spec.units[0]
    uspec = objects.unit_spec("demo", spec, tmpl, 1, 4)
    unit = objects.learner_unit(JOB, uspec)
    unit["metadata"]["uid"] = "lu-1"
    p = objects.unit_pod(unit, incarnation=2, rank=1)
    env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
    assert p["metadata"]["name"] == "demo-gpu-1-2-1"
    assert p["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
    assert p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "rank-0.demo-gpu-1"
    assert env["DILOCO_SYNCER_URL"] == "https://demo-syncer:8470" and env["DILOCO_UNIT"] == "4"
    cmd = p["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["diloco", "pod-learner"] and cmd[cmd.index("--device") + 1] == "cuda"
    # A rank of a two-pod unit is never restarted alone (it could not rejoin its group): the operator restarts the unit.
    assert cmd[2:cmd.index("--")] == ["--max-restarts", "0", "--spares", "0"]
    assert p["metadata"]["ownerReferences"][0]["uid"] == "lu-1" and p["spec"]["restartPolicy"] == "Never"


def test_syncer_status_summary_and_address():
    from diloco_operator.plan import jobstatus
    from diloco_operator.reconcile import syncer_status
    from diloco_trainer.protocol.messages import SyncerStatus
    doc = {"outer_steps": 7, "versions": {"0": 3, "1": 4}, "learners": {"demo-gpu-0": {"last_seen": 1767225600.5}}}
    reading = jobstatus.SyncerReading(SyncerStatus.model_validate(doc), 1767225601.0)
    assert reading.learners_seen == {"demo-gpu-0": "2026-01-01T00:00:00Z"} and reading.last_checkpoint is None
    assert syncer_status.syncer_address(JOB, 8470) == "http://demo-syncer.ns.svc:8470"
    with_ckpt = jobstatus.SyncerReading(SyncerStatus.model_validate({**doc, "last_checkpoint": 1767225660}), 0)
    assert with_ckpt.last_checkpoint == "2026-01-01T00:01:00Z"
    annotated = {**JOB, "metadata": {**JOB["metadata"], "annotations": {syncer_status.URL_ANNOTATION: "http://x:1/"}}}
    assert syncer_status.syncer_address(annotated, 8470, trust_annotation=True) == "http://x:1"


def test_the_syncer_url_annotation_is_followed_only_when_the_operator_trusts_it():
    from diloco_operator.reconcile import syncer_status
    def annotated(url: str) -> dict:
        return {**JOB, "metadata": {**JOB["metadata"], "annotations": {syncer_status.URL_ANNOTATION: url}}}
    # The operator sends the job's token to that address: a job's author alone must not choose it.
    assert syncer_status.syncer_address(annotated("http://attacker.example"), 8470) == "http://demo-syncer.ns.svc:8470"
    assert syncer_status.syncer_address(annotated("https://attacker.example"), 8470, tls=True) == \
        "https://demo-syncer.ns.svc:8470"
    # Trusted (an operator outside the cluster, by its admin's choice): followed.
    assert syncer_status.syncer_address(annotated("https://127.0.0.1:9"), 8470, tls=True, trust_annotation=True) == \
        "https://127.0.0.1:9"
    # Trusted, but plain HTTP while the job's TLS is on: the token would travel in clear, so the Service instead,
    # and the reason names the annotation. Without TLS the job chose plain HTTP everywhere: followed.
    plain = annotated("http://127.0.0.1:9")
    assert syncer_status.syncer_address(plain, 8470, tls=True, trust_annotation=True) == "https://demo-syncer.ns.svc:8470"
    assert "annotation diloco.dev/syncer-url: 'http://127.0.0.1:9' is not https://" in \
        syncer_status.annotation_problem(plain, tls=True, trust_annotation=True)
    assert syncer_status.annotation_problem(plain, tls=False, trust_annotation=True) is None
    assert syncer_status.annotation_problem(plain, tls=True, trust_annotation=False) is None  # not followed anyway
    assert syncer_status.syncer_address(plain, 8470, tls=False, trust_annotation=True) == "http://127.0.0.1:9"


def test_a_unit_with_a_state_volume_mounts_one_claim_per_rank():
    spec = job_spec(units=[{"name": "gpu", "podsPerUnit": 2, "accelerator": {"type": "nvidia-l4", "count": 1},
                            "stateVolume": {"size": "5Gi"}}])
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"
    pvc = objects.unit_state_pvc(unit, 1)
    assert pvc["metadata"]["name"] == "demo-gpu-0-state-1" and pvc["metadata"]["ownerReferences"][0]["uid"] == "lu-1"
    vols = objects.unit_pod(unit, 3, 1)["spec"]["volumes"]
    assert vols[0] == {"name": "state", "persistentVolumeClaim": {"claimName": "demo-gpu-0-state-1"}}
    plain = objects.learner_unit(JOB, objects.unit_spec("demo", job_spec(), job_spec().units[0], 0, 0))
    plain["metadata"]["uid"] = "lu-2"
    assert objects.unit_state_pvc(plain, 0) is None
    assert objects.unit_pod(plain, 0, 0)["spec"]["volumes"][0] == {"name": "state", "emptyDir": {}}


def test_a_data_volume_is_mounted_read_only_into_every_learner_pod_and_the_syncer():
    spec = job_spec(data={"mountPath": "/data", "subPath": "run-1", "persistentVolumeClaim": {"claimName": "tokens"}})
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"
    want_volume = {"name": "data", "persistentVolumeClaim": {"claimName": "tokens", "readOnly": True}}
    want_mount = {"name": "data", "mountPath": "/data", "readOnly": True, "subPath": "run-1"}
    for rank in (0, 1):
        pod_spec = objects.unit_pod(unit, 0, rank)["spec"]
        assert want_volume in pod_spec["volumes"]
        assert want_mount in pod_spec["containers"][0]["volumeMounts"]
    syncer = objects.syncer_deployment(JOB, spec)["spec"]["template"]["spec"]
    assert want_volume in syncer["volumes"]
    assert all(want_mount in c["volumeMounts"] for c in syncer["containers"])  # the standby too
    nfs = job_spec(data={"nfs": {"server": "10.0.0.2", "path": "/export/tokens"}}).data.volume("data")
    assert nfs == {"name": "data", "nfs": {"server": "10.0.0.2", "path": "/export/tokens", "readOnly": True}}
    plain = objects.learner_unit(JOB, objects.unit_spec("demo", job_spec(), job_spec().units[0], 0, 0))
    plain["metadata"]["uid"] = "lu-2"
    assert all(v["name"] != "data" for v in objects.unit_pod(plain, 0, 0)["spec"]["volumes"])


def test_a_template_image_overrides_the_jobs_image_for_its_units_only():
    spec = job_spec(units=[{"name": "tpu", "image": "trainer-xla:1", "accelerator": {"type": "tpu-v5p-slice",
                                                                                   "count": 4}},
                           {"name": "gpu", "accelerator": {"type": "nvidia-l4", "count": 1}}])
    images = {}
    for i, template in enumerate(spec.units):
        unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, template, 0, i))
        unit["metadata"]["uid"] = f"lu-{i}"
        images[template.name] = objects.unit_pod(unit, 0, 0)["spec"]["containers"][0]["image"]
    assert images == {"tpu": "trainer-xla:1", "gpu": "img:1"}
    syncer = objects.syncer_deployment(JOB, spec)["spec"]["template"]["spec"]["containers"][0]
    assert syncer["image"] == "img:1"


def test_every_learner_pod_command_is_accepted_by_the_learner_itself(monkeypatch, tmp_path):
    """The pods' command lines go through the learner's own parser and checks: distinct, in-range data shards
    for every unit (also after scaling past the templates' counts), metrics served on the declared port."""
    import argparse

    from diloco_trainer.learner import main as learner_main

    spec = job_spec(units=[{"name": "gpu", "count": 2, "maxCount": 3, "accelerator": {"type": "nvidia-l4", "count": 1}},
                           {"name": "cpu", "count": 2}])
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)  # the pods have none
    shards = set()
    for tmpl, index, unit_index in ((spec.units[0], 0, 0), (spec.units[0], 1, 1), (spec.units[1], 0, 2),
                                    (spec.units[1], 1, 3), (spec.units[1], 2, 7)):  # unit 7: scaled past the counts
        unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, tmpl, index, unit_index))
        unit["metadata"]["uid"] = "lu"
        container = objects.unit_pod(unit, 0, 0)["spec"]["containers"][0]
        # The learner's process is supervised in the pod and restarted in place from a warm spare (runtime/podsup.py).
        assert container["command"][:3] == ["diloco", "pod-learner", "--"]
        parser = argparse.ArgumentParser()
        learner_main.configure(parser)
        args = objects.learner_arguments(container["command"])
        ca = args.index("--ca") + 1  # the CA the pod mounts from its ConfigMap: a file here
        assert args[ca] == f"{objects.LEARNER_CA_DIR}/ca.crt"
        args[ca] = str(tmp_path / "ca.crt")
        (tmp_path / "ca.crt").write_text("a CA")
        token = args.index("--token-file") + 1  # the unit's token Secret the pod mounts: a file here
        assert args[token] == objects.TOKEN_FILE
        args[token] = str(tmp_path / "token")
        (tmp_path / "token").write_text("unit-token\n")
        opts = learner_main.options_from_args(parser.parse_args(args))
        assert opts.token == "unit-token"
        assert opts.metrics_port == container["ports"][0]["containerPort"] == api.METRICS_PORT
        shards.add((opts.unit, opts.units))
    assert {u for u, _ in shards} == {0, 1, 2, 3, 7}
    assert all(units == 5 for u, units in shards if u < 5)  # 3 (maxCount) + 2 (count): stable under scaling
    assert (7, 8) in shards


def sharded_spec(shards: int = 3, **kw) -> api.DilocoJobSpec:
    return job_spec(config={"outer": {"fragments": 4}, "syncer": {"shards": shards}}, **kw)


def test_each_syncer_shard_gets_its_own_deployment_volume_and_service_and_serves_only_its_shard():
    spec = sharded_spec(3)
    for shard in range(3):
        dep = objects.syncer_deployment(JOB, spec, shard=shard)
        pod = dep["spec"]["template"]["spec"]
        assert dep["metadata"]["name"] == f"demo-syncer-{shard}"
        assert dep["spec"]["selector"]["matchLabels"][objects.LABEL_SHARD] == str(shard)
        syncer, standby = pod["containers"]
        assert syncer["command"][syncer["command"].index("--shard") + 1] == str(shard)
        assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == f"demo-checkpoint-{shard}"
        assert objects.checkpoint_pvc(JOB, spec, shard)["metadata"]["name"] == f"demo-checkpoint-{shard}"
        svc = objects.syncer_service(JOB, shard, 3)
        assert svc["metadata"]["name"] == f"demo-syncer-{shard}"
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # Three shards' pods never share a selector: a Service routes to exactly its own shard.
    selectors = {tuple(sorted(objects.syncer_service(JOB, i, 3)["spec"]["selector"].items())) for i in range(3)}
    assert len(selectors) == 3


def test_the_syncer_bounds_a_learners_tokens_by_the_largest_unit_of_the_job():
    command = objects.syncer_deployment(JOB, job_spec())["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--max-unit-processes") + 1] == "2"  # the gpu units' podsPerUnit


def test_a_single_syncer_keeps_its_names_and_selector_so_an_upgrade_replaces_nothing():
    dep = objects.syncer_deployment(JOB, job_spec())
    assert dep["metadata"]["name"] == "demo-syncer"
    assert dep["spec"]["selector"]["matchLabels"] == {objects.LABEL_JOB: "demo", objects.LABEL_COMPONENT: "syncer"}
    assert "--shard" not in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert objects.checkpoint_pvc(JOB, job_spec())["metadata"]["name"] == "demo-checkpoint"
    unit = objects.unit_spec("demo", job_spec(), job_spec().units[1], 0, 2)
    assert "syncerShards" not in unit.model_dump(mode="json", exclude_none=True)


def test_the_standby_container_waits_on_the_same_volume_with_the_same_command_and_no_port_of_its_own():
    pod = objects.syncer_deployment(JOB, job_spec(), tls_hash="h")["spec"]["template"]["spec"]
    syncer, standby = pod["containers"]
    assert standby["name"] == "standby"
    assert standby["command"] == [*syncer["command"], "--standby", "--no-fork-successor"]
    assert standby["volumeMounts"] == syncer["volumeMounts"] and standby["env"] == syncer["env"]
    assert standby["resources"] == syncer["resources"]
    assert "ports" not in standby and "readinessProbe" not in standby
    off = objects.syncer_deployment(JOB, job_spec(syncer={"standby": False}))["spec"]["template"]["spec"]
    assert [c["name"] for c in off["containers"]] == ["syncer"]
    # The Service keeps routing to the pod while its dead container restarts: the standby serves meanwhile.
    assert objects.syncer_service(JOB)["spec"]["publishNotReadyAddresses"] is True


def test_learners_dial_every_shard_in_shard_order():
    spec = sharded_spec(2)
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[1], 0, 2))
    unit["metadata"]["uid"] = "lu-1"
    cmd = objects.unit_pod(unit, 0, 0)["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--syncer") + 1] == "https://demo-syncer-0:8470,https://demo-syncer-1:8470"


def test_shard_statuses_name_each_shard_with_its_fragments_and_merges():
    from diloco_operator.plan import jobplan
    spec = sharded_spec(3)
    from diloco_trainer.protocol.messages import SyncerStatus
    shards = jobplan.shard_statuses("demo", spec, [True, False, True],
                                    {0: SyncerStatus(outer_steps=5, owned=[0, 3], shards=3), 1: None})
    assert [s.model_dump(exclude_none=True) for s in shards] == [
        {"shard": 0, "name": "demo-syncer-0", "ready": True, "outerSteps": 5, "fragments": [0, 3]},
        {"shard": 1, "name": "demo-syncer-1", "ready": False, "fragments": [1]},
        {"shard": 2, "name": "demo-syncer-2", "ready": True, "fragments": [2]},
    ]
    status, _ = jobplan.job_status("demo", spec, 1, [], False, {}, datetime(2026, 1, 1, tzinfo=timezone.utc),
                                   shards_down=["demo-syncer-1"])
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.reason == "SyncerNotReady" and "demo-syncer-1" in ready.message


def test_the_jobs_syncer_numbers_add_up_over_its_shards():
    from diloco_operator.plan import jobstatus
    from diloco_operator.reconcile import syncer_status
    from diloco_trainer.protocol.messages import LearnerStatus, SyncerStatus
    t = T0.timestamp()
    combined = jobstatus.combine([
        jobstatus.SyncerReading(SyncerStatus(outer_steps=4, versions={"0": 6}, owned=[0], last_checkpoint=t + 9,
                                                 learners={"a": LearnerStatus(last_seen=t + 5)}), t + 20),
        jobstatus.SyncerReading(SyncerStatus(outer_steps=3, versions={"1": 2}, owned=[1], last_checkpoint=t + 3,
                                                 learners={"a": LearnerStatus(last_seen=t + 7),
                                                           "b": LearnerStatus(last_seen=t + 1)}), t + 10)])
    assert combined.status.outer_steps == 7 and sum(combined.status.versions.values()) == 8
    assert combined.last_checkpoint == "2026-01-01T00:00:03Z" and combined.at == t + 10
    assert combined.learners_seen == {"a": "2026-01-01T00:00:07Z", "b": "2026-01-01T00:00:01Z"}
    one_without = jobstatus.combine([jobstatus.SyncerReading(SyncerStatus(last_checkpoint=t), t),
                                         jobstatus.SyncerReading(SyncerStatus(), t)])
    assert one_without.last_checkpoint is None  # not every shard could resume from a checkpoint yet
    assert jobstatus.combine([]) is None
    annotated = {**JOB, "metadata": {**JOB["metadata"], "annotations": {
        syncer_status.URL_ANNOTATION: "http://x:1/, http://y:2"}}}
    assert syncer_status.syncer_address(annotated, 8470, shard=1, shards=2, trust_annotation=True) == "http://y:2"
    assert syncer_status.syncer_address(JOB, 8470, tls=True, shard=1, shards=2) == "https://demo-syncer-1.ns.svc:8470"


def test_a_job_may_not_have_more_syncer_shards_than_fragments():
    with pytest.raises(ValueError, match="syncer.shards"):
        job_spec(config={"outer": {"fragments": 2}, "syncer": {"shards": 3}})


def test_a_remote_template_needs_its_cluster_and_one_syncer_url_per_shard():
    west = {"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "https://a:1"}
    units = [{"name": "far", "cluster": "west"}]
    spec = job_spec(units=units, clusters=[west])
    uspec = objects.unit_spec("demo", spec, spec.units[0], 0, 0)
    assert uspec.cluster == "west" and uspec.syncerUrl == "https://a:1"
    with pytest.raises(ValueError, match="names no spec.clusters entry"):
        job_spec(units=units)
    with pytest.raises(ValueError, match="one URL per syncer shard"):
        job_spec(units=units, clusters=[west], config={"outer": {"fragments": 4}, "syncer": {"shards": 2}})


def test_an_object_for_a_remote_cluster_names_its_home_owner_instead_of_an_owner_reference():
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", job_spec(), job_spec().units[1], 0, 0))
    unit["metadata"]["uid"] = "lu-9"
    pod = objects.in_remote_cluster(objects.unit_pod(unit, 0, 0), "far-ns")
    assert "ownerReferences" not in pod["metadata"] and pod["metadata"]["namespace"] == "far-ns"
    assert pod["metadata"]["annotations"][objects.ANNOTATION_HOME_OWNER] == "LearnerUnit/demo-cpu-0/lu-9"
    assert pod["metadata"]["labels"][objects.LABEL_JOB] == "demo"  # how the operator finds it there again


def test_an_existing_object_is_the_jobs_only_if_the_job_controls_it():
    desired = objects.config_map(JOB, job_spec())
    ours = {"metadata": {"name": "demo-config", "ownerReferences": [objects.owner_ref(JOB)]}}
    assert objects.same_controller(desired, ours)
    assert not objects.same_controller(desired, {"metadata": {"name": "demo-config"}})  # a user's ConfigMap
    other_job = {**JOB, "metadata": {**JOB["metadata"], "uid": "u-2"}}
    assert not objects.same_controller(desired, {"metadata": {"ownerReferences": [objects.owner_ref(other_job)]}})
    not_controller = {**objects.owner_ref(JOB), "controller": False}
    assert not objects.same_controller(desired, {"metadata": {"ownerReferences": [not_controller]}})
    # In a remote cluster the owner is named by annotation, and the same rule holds.
    remote = objects.in_remote_cluster(desired, "far")
    assert objects.controller_uid(remote) == "u-1" and objects.same_controller(remote, remote)
    assert not objects.same_controller(remote, objects.in_remote_cluster(objects.config_map(other_job, job_spec()),
                                                                         "far"))


def _learner_unit(owner: dict | None, name: str = "demo-cpu-0") -> dict:
    spec = objects.unit_spec("demo", job_spec(), api.UnitTemplate(name="cpu"), 0, 0)
    unit = objects.learner_unit(JOB, spec)
    unit["metadata"]["name"] = name
    if owner is None:
        del unit["metadata"]["ownerReferences"]
    else:
        unit["metadata"]["ownerReferences"] = [objects.owner_ref(owner)]
    return unit


def test_a_unit_is_run_for_a_job_only_if_that_job_is_its_controller():
    assert unitplan.not_controlled_by_job(_learner_unit(JOB), JOB) is None
    why = unitplan.not_controlled_by_job(_learner_unit(None, "stray"), JOB)
    assert "LearnerUnit ns/stray names job demo but is not controlled by it" in why
    assert "no controller reference" in why and "runs no pods and makes no token" in why
    other = {**JOB, "metadata": {**JOB["metadata"], "uid": "u-other"}}
    assert "its controller is DilocoJob demo (uid u-other)" in unitplan.not_controlled_by_job(_learner_unit(other), JOB)
    # Neither an ownerReference that is not the controller nor the remote clusters' home-owner annotation counts.
    weak = _learner_unit(JOB)
    weak["metadata"]["ownerReferences"][0]["controller"] = False
    assert unitplan.not_controlled_by_job(weak, JOB) is not None
    annotated = objects.in_remote_cluster(_learner_unit(JOB), "ns")
    assert objects.controller_uid(annotated) == "u-1" and unitplan.not_controlled_by_job(annotated, JOB) is not None


def test_a_refused_unit_says_why_in_ready_false_and_warns_only_when_the_refusal_is_new():
    why = unitplan.not_controlled_by_job(_learner_unit(None, "stray"), JOB)
    status, events = unitplan.refused_status(None, why, T0, 1)
    ready = C.get_condition(status.condition_dicts(), C.READY)
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "NotControlledByJob", why)
    assert status.message == why and events == [("Warning", "NotControlledByJob", why)]
    again, events = unitplan.refused_status(status, why, T0 + timedelta(minutes=1), 1)
    assert again == status and events == [], "looked at again: nothing new to write or tell"


def test_the_job_never_creates_a_unit_over_a_name_someone_elses_unit_holds():
    plan = jobplan.plan_units("demo", job_spec(), [], foreign={"demo-gpu-0", "demo-cpu-0"})
    assert sorted(plan.create) == ["demo-cpu-1", "demo-gpu-1", "demo-gpu-2"], "the next free index instead"
