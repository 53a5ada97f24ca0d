"""A DilocoJob's spec.chaos: the operator runs the schedule on the job's own pods, the job heals and stays Running,
and the experiment's start survives in an annotation so a restarted operator resumes instead of starting over."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from diloco_operator.reconcile.chaosrun import ANNOTATION_STARTED, persisted, spec_hash

from polling import wait_for
from test_operator_cluster import cpu_units, events, job, wait_job_ready

CHAOS = {"schedule": {"every": "3s"}, "target": {"kind": "learner"}, "action": {"type": "kill"},
         "safety": {"minAliveUnits": 2, "maxConcurrent": 1, "maxFaults": 2, "maxDuration": "45s",
                    "recoveryTimeout": "30s"}}


def test_a_persisted_start_belongs_only_to_the_spec_it_was_written_for():
    digest = spec_hash(CHAOS)
    saved = {ANNOTATION_STARTED: json.dumps({"startedAt": 1700000000.5, "spec": digest})}
    assert persisted(saved, digest) == {"startedAt": 1700000000.5, "faults": 0, "ended": False}
    assert persisted(saved, spec_hash({**CHAOS, "schedule": {"every": "4s"}})) is None, "another spec starts afresh"
    assert persisted({}, digest) is None
    assert persisted({ANNOTATION_STARTED: "not json"}, digest) is None
    ended = {ANNOTATION_STARTED: json.dumps({"startedAt": 1.0, "spec": digest, "ended": True})}
    assert persisted(ended, digest)["ended"] is True
    assert spec_hash(dict(reversed(list(CHAOS.items())))) == digest, "key order does not change the digest"


@pytest.mark.cluster
def test_a_jobs_chaos_schedule_kills_learner_pods_and_the_job_heals_running(kubectl, operator, ns):
    kubectl.apply(job("wild", cpu_units(3), chaos=CHAOS), "-n", ns)
    wait_job_ready(kubectl, ns, "wild", 3)
    phases = set()

    def ended():
        phases.add(kubectl.get("dj", "wild", ns=ns)["status"]["phase"])
        return [e for e in events(kubectl, ns, "ChaosEnded") if e["involvedObject"]["name"] == "wild"]
    (end,) = wait_for(ended, 60, "the job's chaos experiment to end", 0.3)
    assert phases == {"Running"}, "one learner down at a time: the job stays Running"
    assert "2 faults" in end["message"] and "2 recovered" in end["message"], end["message"]
    assert [e["involvedObject"]["kind"] for e in events(kubectl, ns, "ChaosStarted")] == ["DilocoJob"]
    killed = [e for e in events(kubectl, ns, "ChaosPodKilled") if e["involvedObject"]["kind"] == "Pod"]
    assert len(killed) == 2 and all("wild-chaos" in e["message"] for e in killed)
    for e in killed:  # the victims are gone for good; their units were restarted by the operator
        now = kubectl.get("pod", e["involvedObject"]["name"], ns=ns) or {"metadata": {"uid": None}}
        assert now["metadata"]["uid"] != e["involvedObject"]["uid"]
    wait_job_ready(kubectl, ns, "wild", 3, restarts=2)
    meta = kubectl.get("dj", "wild", ns=ns)["metadata"]
    assert persisted(meta["annotations"], spec_hash(CHAOS))["ended"] is True, "a restart must not run it again"
    text = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).read().decode()
    assert 'diloco_chaos_faults_total{action="kill",dry_run="false",experiment="wild-chaos",role="learner"} 2.0' in text
    operator.wait_looked_again()  # a finished experiment stays finished: no third kill on the next ticks (3 s apart)
    assert len([e for e in events(kubectl, ns, "ChaosPodKilled") if e["involvedObject"]["kind"] == "Pod"]) == 2
    # A changed spec.chaos is a new experiment: fresh start, its own budget.
    again = {**CHAOS, "safety": {**CHAOS["safety"], "maxFaults": 1}}
    kubectl.run("patch", "dj", "wild", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"chaos": again}}))
    wait_for(lambda: len([e for e in events(kubectl, ns, "ChaosEnded") if e["involvedObject"]["name"] == "wild"]) == 2,
             60, "the changed experiment to run and end", 0.3)
    assert len(events(kubectl, ns, "ChaosStarted")) == 2
    assert len([e for e in events(kubectl, ns, "ChaosPodKilled") if e["involvedObject"]["kind"] == "Pod"]) == 3
    wait_job_ready(kubectl, ns, "wild", 3, restarts=3)
    kubectl.run("delete", "dj", "wild", "-n", ns, "--wait=false")
    wait_for(lambda: kubectl.get("dj", "wild", ns=ns) is None, 30, "the job (kopf's finalizer released)", 0.3)


@pytest.mark.cluster
def test_a_restarted_operator_resumes_the_chaos_schedule_without_replaying_it(kubectl, operator, ns):
    chaos = {**CHAOS, "safety": {**CHAOS["safety"], "minAliveUnits": 1, "maxDuration": "60s"}}
    kubectl.apply(job("again", cpu_units(2), chaos=chaos), "-n", ns)
    wait_job_ready(kubectl, ns, "again", 2)

    def kills():
        return [e for e in events(kubectl, ns, "ChaosPodKilled") if e["involvedObject"]["kind"] == "Pod"]
    wait_for(kills, 30, "the first chaos kill", 0.3)

    def counted():  # the count is persisted right after the kill (a death in between loses that one count)
        saved = persisted(kubectl.get("dj", "again", ns=ns)["metadata"].get("annotations") or {}, spec_hash(chaos))
        return saved if saved and saved["faults"] == 1 else None
    before = wait_for(counted, 10, "the first fault counted in the annotation", 0.1)
    operator.stop()
    try:
        time.sleep(7)  # two ticks pass while no operator runs: they are not fired on its return
        assert len(kills()) == 1
    finally:
        operator.start()
    (end,) = wait_for(lambda: [e for e in events(kubectl, ns, "ChaosEnded") if e["involvedObject"]["name"] == "again"],
                      60, "the resumed experiment to end", 0.3)
    assert len(kills()) == 2, "maxFaults spans the restart"
    assert "2 faults" in end["message"], end["message"]
    assert len(events(kubectl, ns, "ChaosStarted")) == 1, "resumed, not started again"
    after = persisted(kubectl.get("dj", "again", ns=ns)["metadata"]["annotations"], spec_hash(chaos))
    assert after["startedAt"] == before["startedAt"] and after["faults"] == 2 and after["ended"]
    assert "resumed" in (operator.logdir / f"operator-{operator.starts}.log").read_text(errors="replace")
    wait_job_ready(kubectl, ns, "again", 2, restarts=2)
