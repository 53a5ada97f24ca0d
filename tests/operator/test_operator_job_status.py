"""The job status is one typed model (api.DilocoJobStatus) built by jobplan/jobstatus: its wire form is what the
status dicts were before typing (data/job_status_before_typing.json, written by the dict-based code), plus the
progress a person reads."""

from __future__ import annotations

import json
from pathlib import Path

from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client import REGISTRY

from diloco_operator import metrics
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects
from diloco_operator.plan import jobplan, jobstatus, unitplan
from diloco_operator.plan.jobstatus import SyncerReading
from diloco_trainer.protocol.messages import LearnerStatus, SyncerStatus

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def spec(**kw):
    base = {"image": "img:1", "units": [{"name": "gpu", "count": 2, "podsPerUnit": 2,
                                         "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                                        {"name": "cpu", "count": 1}]}
    base.update(kw)
    return api.DilocoJobSpec.model_validate(base)


def unit(name, phase, unschedulable=False, restarts=0, deleting=False):
    return jobplan.UnitView(name, "gpu", int(name[-1]), int(name[-1]), phase, 1, 1, restarts, unschedulable, deleting,
                            {})


RUNNING3 = [unit("u0", "Running"), unit("u1", "Running"), unit("u2", "Running")]
# What the dict-based code read as {"outerSteps": 12, "version": 9, "lastCheckpoint": "2026-01-01T00:00:30Z"}.
INFO = SyncerStatus(outer_steps=12, versions={"0": 4, "1": 5}, last_checkpoint=T0.timestamp() + 30,
                    learners={"u0": LearnerStatus(last_seen=T0.timestamp() + 31)})
OLD_RUNNING = {"phase": "Running", "startTime": "2025-12-31T23:00:00Z", "outerSteps": 3, "version": 2,
               "syncerShards": [{"shard": 0, "name": "demo-syncer", "ready": True, "outerSteps": 3,
                                 "fragments": [0, 1]}],
               "autoscaling": {"targetUnits": 3, "desiredUnits": 3, "runningUnits": 3, "templates": [],
                               "parkedUnits": []},
               "conditions": [{"type": "LinkEncrypted", "status": "True", "reason": "AutoCertificate",
                               "message": "https", "lastTransitionTime": "2025-12-31T23:00:00Z",
                               "observedGeneration": 1}]}
OLD_FAILED = {"phase": "Failed", "completionTime": "2025-12-31T23:30:00Z", "message": "gone",
              "syncerRefusal": {"generation": 2, "message": "bad", "at": "2025-12-31T23:10:00Z"}, "conditions": []}

SCENARIOS = {
    "all running, first reconcile": dict(units=RUNNING3, syncer_ready=True, old=None),
    "all running with syncer info, after a Running status": dict(units=RUNNING3, syncer_ready=True, old=OLD_RUNNING,
                                                                 syncer=INFO),
    "nothing yet, syncer down by shard": dict(units=[], syncer_ready=False, old={}, shards_down=["demo-syncer"]),
    "restarting and unschedulable": dict(units=[unit("u0", "Restarting", restarts=2), unit("u1", "Pending", True),
                                                unit("u2", "Running"), unit("u3", "Running", deleting=True)],
                                         syncer_ready=True, old=OLD_RUNNING),
    "a failed unit, quorum 3": dict(units=[unit("u0", "Failed"), unit("u1", "Running"), unit("u2", "Running")],
                                    syncer_ready=True, old=OLD_RUNNING, spec_kw={"config": {"outer": {"quorum": 3}}}),
    "all succeeded": dict(units=[unit("u0", "Succeeded"), unit("u1", "Succeeded"), unit("u2", "Succeeded")],
                          syncer_ready=True, old=OLD_RUNNING),
    "terminal sticks": dict(units=RUNNING3, syncer_ready=True, old=OLD_FAILED),
    "scaling to the autoscaler's 5": dict(units=RUNNING3, syncer_ready=True, old=OLD_RUNNING, desired=5),
}


def _run(scenario):
    s = dict(scenario)
    return jobplan.job_status("demo", spec(**s.pop("spec_kw", {})), 1, s.pop("units"), s.pop("syncer_ready"),
                              s.pop("old"), T0 + timedelta(seconds=60), **s)


BEFORE = json.loads((Path(__file__).parent / "data" / "job_status_before_typing.json").read_text())


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_typed_job_status_writes_what_the_status_dicts_wrote(scenario):
    status, events = _run(SCENARIOS[scenario])
    assert isinstance(status, api.DilocoJobStatus)
    assert status.wire() == BEFORE[scenario]["status"]
    assert [list(e) for e in events] == BEFORE[scenario]["events"]


def test_a_written_status_reads_back_into_the_same_model():
    status, _ = _run(SCENARIOS["all running with syncer info, after a Running status"])
    assert api.DilocoJobStatus.read(status.wire()) == status
    assert api.DilocoJobStatus.read(None).wire() == {"conditions": []}


def _reading(at_s: float, **learners) -> SyncerReading:
    status = SyncerStatus(outer_steps=6, versions={"0": 3, "1": 3}, fragments=2, tokens_merged=2 * 3000,
                          live_learners=sum(1 for ls in learners.values() if ls.live), learners=learners)
    return SyncerReading(status, T0.timestamp() + at_s)


def _created(name: str, seconds_after_t0: int, fault: api.UnitFault | None = None) -> jobplan.UnitView:
    return jobplan.UnitView(name, "gpu", int(name[-1]), int(name[-1]), "Running", 1, 1, 0, False, False, {},
                            created=jobplan.C.now_iso(T0 + timedelta(seconds=seconds_after_t0)), last_fault=fault)


def test_progress_is_goodput_and_merged_work_from_the_syncer_with_tokens_merged_per_fragment():
    # u0: 100 s allocated, 50 steps of 1 s, 40 of them merged (80 fragment submissions over P=2): useful 40 s.
    # u1: 100 s allocated, the syncer never heard from it: allocated, not busy.
    reading = _reading(100, u0=LearnerStatus(step=50, step_time_s=1.0, steps_merged=80, tokens=4000, live=True))
    out = jobstatus.progress(reading, [_created("u0", 0), _created("u1", 0)], fragments=2)
    assert out == {"goodput": 0.2, "mergedFraction": 0.8, "tokensTrained": 4000, "tokensMergedPerFragment": 3000,
                   "learnersAlive": 1}


def test_progress_names_no_goodput_it_cannot_divide_for():
    reading = _reading(100)  # no unit, no learner: nothing allocated, nothing trained
    out = jobstatus.progress(reading, [], fragments=2)
    assert "goodput" not in out and "mergedFraction" not in out
    assert out["tokensTrained"] == 0 and out["learnersAlive"] == 0


def _observe(old, readings, units=None) -> api.DilocoJobStatus:
    spec_ = spec(config={"outer": {"fragments": 2}})
    obs = jobstatus.JobObservation(name="demo", spec=spec_, generation=1, units=units or RUNNING3,
                                   old=api.DilocoJobStatus.read(old), now=T0 + timedelta(seconds=100),
                                   shard_ready=[True], shard_readings=readings)
    return jobstatus.observe(obs)[0]


def test_a_job_whose_syncer_never_answered_shows_no_progress_rather_than_zeros():
    status = _observe(None, {0: None}).wire()
    for key in ("goodput", "mergedFraction", "tokensTrained", "tokensMergedPerFragment", "learnersAlive",
                "outerSteps", "lastFault"):
        assert key not in status, key
    assert status["syncerShards"] == [{"shard": 0, "name": "demo-syncer", "ready": True, "fragments": [0, 1]}]


def test_the_job_keeps_its_last_known_progress_while_the_syncer_does_not_answer():
    units = [_created("u0", 0), _created("u1", 0), _created("u2", 0)]
    reading = _reading(100, u0=LearnerStatus(step=50, step_time_s=1.0, steps_merged=100, tokens=4000, live=True))
    seen = _observe({"syncerRefusal": {"message": "bad", "at": "2026-01-01T00:00:00Z"}}, {0: reading}, units)
    assert seen.syncerRefusal is None and seen.outerSteps == 6 and seen.tokensMergedPerFragment == 3000
    assert seen.goodput == 0.167 and seen.learnersAlive == 1  # 50 useful s of 300 allocated
    later = _observe(seen.wire(), {0: None}, units)
    assert (later.goodput, later.tokensTrained, later.outerSteps) == (seen.goodput, 4000, 6)


def test_the_jobs_last_fault_is_its_units_latest_restart_with_the_time_it_took_to_run_again():
    old = api.UnitFault(time="2026-01-01T00:00:10Z", reason="PodDeleted", message="pod gone", incarnation=1,
                        recoveredAt="2026-01-01T00:00:14Z")
    new = api.UnitFault(time="2026-01-01T00:01:00Z", reason="PodFailed", message="exit code 137", incarnation=3)
    fault = jobstatus.last_fault([_created("u0", 0, old), _created("u1", 0, new), _created("u2", 0)])
    assert fault.model_dump(exclude_none=True) == {"unit": "u1", "time": "2026-01-01T00:01:00Z", "reason": "PodFailed",
                                                   "message": "exit code 137", "incarnation": 3}
    recovered = jobstatus.last_fault([_created("u0", 0, old)])
    assert recovered.unit == "u0" and recovered.recoverySeconds == 4.0
    assert jobstatus.last_fault([_created("u0", 0)]) is None


def test_the_operator_exports_a_jobs_goodput_and_last_recovery_and_drops_them_with_the_job():
    def sample(name):
        return REGISTRY.get_sample_value(name, {"namespace": "metrics-ns", "job": "demo"})
    units = [_created("u0", 0, api.UnitFault(time="2026-01-01T00:00:10Z", reason="PodDeleted", message="pod gone",
                                             incarnation=1, recoveredAt="2026-01-01T00:00:14Z", lostSteps=3,
                                             lostTokens=768)), _created("u1", 0)]
    reading = _reading(100, u0=LearnerStatus(step=50, step_time_s=1.0, steps_merged=80, tokens=4000, live=True))
    status = _observe(None, {0: reading}, units)
    metrics.export_job_status("metrics-ns", "demo", status)
    assert sample("diloco_operator_job_goodput") == status.goodput == 0.2
    assert sample("diloco_operator_job_merged_fraction") == status.mergedFraction == 0.8
    assert sample("diloco_operator_job_last_recovery_seconds") == 4.0
    assert sample("diloco_operator_job_last_fault_lost_steps") == 3
    assert sample("diloco_operator_job_last_fault_lost_tokens") == 768
    # A status without those figures (the syncer never answered, no fault) exports none: no false zero.
    metrics.export_job_status("metrics-ns", "demo", _observe(None, {0: None}, [_created("u0", 0)]))
    assert sample("diloco_operator_job_goodput") is None and sample("diloco_operator_job_last_recovery_seconds") is None
    metrics.export_job_status("metrics-ns", "demo", status)
    metrics.UNIT_RESTARTS.labels("metrics-ns", "demo").inc()
    metrics.forget_job("metrics-ns", "demo")
    for name in ("diloco_operator_job_goodput", "diloco_operator_job_merged_fraction",
                 "diloco_operator_job_last_recovery_seconds", "diloco_operator_job_last_fault_lost_tokens",
                 "diloco_operator_unit_restarts_total"):
        assert sample(name) is None, name


def test_a_restarted_unit_records_its_fault_and_when_its_pods_were_ready_again():
    spec_ = objects.unit_spec("demo", spec(restartPolicy={"backoffSeconds": 2, "maxRestarts": 3}),
                              api.UnitTemplate(name="gpu", podsPerUnit=1), 0, 0)
    raw = spec_.model_dump(mode="json", exclude_none=True)
    h = objects.pod_spec_hash(raw)

    def pod(inc, phase="Running", **kw):
        return unitplan.PodView(name=f"demo-gpu-0-{inc}-0", incarnation=inc, rank=0, phase=phase,
                                ready=phase == "Running", node="n0", spec_hash=h, **kw)
    running = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0}
    failed = unitplan.plan_unit(spec_, raw, running, [pod(0, "Failed", failure="exit code 137")], T0)
    fault = failed.status.lastFault
    assert (fault.time, fault.reason, fault.incarnation, fault.recoveredAt) == (
        "2026-01-01T00:00:00Z", jobplan.C.Reason.POD_FAILED, 1, None) and "exit code 137" in fault.message
    relaunched = unitplan.plan_unit(spec_, raw, failed.status, [], T0 + timedelta(seconds=2))
    assert relaunched.create == [0] and relaunched.status.lastFault.recoveredAt is None
    back = unitplan.plan_unit(spec_, raw, relaunched.status, [pod(1)], T0 + timedelta(seconds=7))
    assert back.status.phase == "Running" and back.status.lastFault.recoveredAt == "2026-01-01T00:00:07Z"
    assert back.status.lastFault.recoverySeconds == 7.0, "the unit's own status says it too (kubectl get lu)"
    view = jobplan.unit_view({"metadata": {"name": "demo-gpu-0"}, "spec": raw, "status": back.status.wire()})
    assert jobstatus.last_fault([view]).recoverySeconds == 7.0
