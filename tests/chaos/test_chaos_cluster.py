"""Chaos against a DilocoJob on the real control plane (apiserver, scheduler, kwok, the operator running):
pods are deleted on schedule with Events, kwok fails a pod with an exit code, and the job heals. The chaos tool
runs as its own ServiceAccount with exactly chaos/rbac.yaml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco_chaos.inject.experiment import parse_experiment
from diloco_chaos.inject.record import Record, summarize
from diloco_chaos.inject.runner import run_experiment
from diloco_chaos.inject.targets.kubernetes import KubernetesTarget
from diloco_trainer.protocol.chaos_record import read_record
from test_operator_cluster import cpu_units, events, job, unit_pods, wait_job_ready  # helpers only

from polling import wait_for
from cluster_kit import PYTHONPATH, ROOT

pytestmark = pytest.mark.cluster


@pytest.fixture
def chaos_kubeconfig(testbed, kubectl, ns, tmp_path) -> str:
    """chaos/rbac.yaml installed for `ns`, and a kubeconfig that authenticates as its ServiceAccount."""
    docs = [d for d in yaml.safe_load_all((ROOT / "chaos" / "rbac.yaml").read_text()) if d]
    for d in docs:
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            d["metadata"]["name"] += f"-{ns}"
            if d["kind"] == "ClusterRoleBinding":
                d["roleRef"]["name"] += f"-{ns}"
                d["subjects"][0]["namespace"] = ns
        else:
            d["metadata"]["namespace"] = ns
    kubectl.apply("---\n".join(yaml.safe_dump(d) for d in docs))
    token = kubectl.run("create", "token", "diloco-chaos", "-n", ns, "--duration=1h").stdout.strip()
    config = yaml.safe_load(Path(testbed.kubeconfig).read_text())
    config["users"] = [{"name": "chaos", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "chaos"
    path = tmp_path / "chaos-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    yield str(path)
    for d in docs:
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            kubectl.run("delete", d["kind"].lower(), d["metadata"]["name"], check=False)


def _exp(**spec):
    return parse_experiment({"name": "cluster-test", **spec})


async def test_pods_of_a_dilocojob_are_deleted_on_schedule_with_events_and_the_job_heals(
        kubectl, operator, ns, chaos_kubeconfig, tmp_path):
    kubectl.apply(job("victims", cpu_units(3)), "-n", ns)
    wait_job_ready(kubectl, ns, "victims", 3)
    exp = _exp(schedule={"every": "2s", "seed": 3}, action={"type": "kill"},
               safety={"minAliveUnits": 2, "maxConcurrent": 1, "maxFaults": 3, "maxDuration": "2m",
                       "recoveryTimeout": "60s", "namespace": ns})
    record = Record(tmp_path / "record.jsonl")
    summary = await run_experiment(exp, KubernetesTarget("victims", ns, kubeconfig=chaos_kubeconfig), record,
                                   poll_s=0.2)

    faults = [e for e in record.entries if e.event == "fault"]
    recoveries = [e for e in record.entries if e.event == "recovery"]
    assert summary["faults"] == 3 and summary["recovered"] == 3, record.entries
    killed = {uid for f in faults for uid in f.details["uids"].values()}
    assert len(killed) == 3  # three different pods (a unit may be hit again once its replacement runs)
    # On schedule: each fault on a 2 s tick (ticks while a victim was still down were skipped, and recorded).
    start = record.entries[0].time
    for f in faults:
        ticks = (f.scheduled_at - start) / 2.0
        assert ticks >= 0.99 and abs(ticks - round(ticks)) < 0.05
        assert f.time - f.scheduled_at < 1.5
    for r in recoveries:
        assert 0 < r.trained_again_s < 60 and r.merged_again_s is None
    print(f"\nchaos pod kill -> replacement Running and Ready: median {summary['trained_again_s_median']:.2f}s, "
          f"all {[round(r.trained_again_s, 2) for r in recoveries]}")
    # An Event on every victim pod and on its unit, from the chaos tool.
    chaos_events = events(kubectl, ns, "ChaosPodKilled")
    for f in faults:
        (pod,) = f.members
        assert any(e["involvedObject"]["kind"] == "Pod" and e["involvedObject"]["name"] == pod
                   and e["source"]["component"] == "diloco-chaos" and f"fault #{f.fault}" in e["message"]
                   for e in chaos_events), chaos_events
        assert any(e["involvedObject"]["kind"] == "LearnerUnit" and e["involvedObject"]["name"] == f.unit
                   for e in chaos_events)
    # The job healed: every unit ready again on new pods, 3 restarts in all, never below quorum.
    dj = wait_job_ready(kubectl, ns, "victims", 3)
    assert dj["status"]["restarts"] == 3
    now = {p["metadata"]["uid"] for u in range(3) for p in unit_pods(kubectl, ns, f"victims-cpu-{u}")}
    assert not now & killed


async def test_a_pod_fails_with_the_exit_code_through_kwok(kubectl, operator, ns, chaos_kubeconfig, tmp_path):
    kubectl.apply(job("crash", cpu_units(2)), "-n", ns)
    wait_job_ready(kubectl, ns, "crash", 2)
    exp = _exp(schedule={"every": "1s"}, target={"units": [1]}, action={"type": "fail", "exitCode": 3},
               safety={"minAliveUnits": 1, "maxFaults": 1, "maxDuration": "1m", "recoveryTimeout": "60s"})
    record = Record(tmp_path / "record.jsonl")
    summary = await run_experiment(exp, KubernetesTarget("crash", ns, kubeconfig=chaos_kubeconfig), record,
                                   poll_s=0.2)
    assert summary["faults"] == 1 and summary["recovered"] == 1, record.entries
    (fault,) = [e for e in record.entries if e.event == "fault"]
    assert fault.unit == "crash-cpu-1"

    def failed_seen():
        return [e for e in events(kubectl, ns, "PodFailed") if e["involvedObject"]["name"] == "crash-cpu-1"]
    try:
        seen = wait_for(failed_seen, 60, "the operator's PodFailed event", 0.2)
    except BaseException:
        print([(e["reason"], e["involvedObject"]["name"], e["message"]) for e in kubectl.get("events", ns=ns)])
        raise
    assert "exit code 3" in seen[0]["message"]
    assert any(e["involvedObject"]["name"] == fault.members[0] for e in events(kubectl, ns, "ChaosPodFailed"))
    assert kubectl.get("lu", "crash-cpu-1", ns=ns)["status"]["restarts"] == 1
    assert kubectl.get("lu", "crash-cpu-0", ns=ns)["status"].get("restarts", 0) == 0


def test_a_dry_run_from_the_cli_touches_no_pod(kubectl, operator, ns, chaos_kubeconfig, tmp_path):
    kubectl.apply(job("calm", cpu_units(2)), "-n", ns)
    wait_job_ready(kubectl, ns, "calm", 2)
    before = {p["metadata"]["uid"] for u in range(2) for p in unit_pods(kubectl, ns, f"calm-cpu-{u}")}
    spec = {"name": "calm-dry", "schedule": {"every": "500ms"}, "safety": {"maxFaults": 3, "maxDuration": "30s"}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    out = subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", "chaos", "run", str(tmp_path / "exp.yaml"), "--job", "calm",
         "--namespace", ns, "--kubeconfig", chaos_kubeconfig, "--dry-run", "--plain",
         "--record", str(tmp_path / "record.jsonl")],
        env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("WOULD kill") == 3 and "DRY RUN" in out.stdout
    summary = summarize(read_record(tmp_path / "record.jsonl"))
    assert summary["faults"] == 3 and summary["dry_run_faults"] == 3
    assert {p["metadata"]["uid"] for u in range(2) for p in unit_pods(kubectl, ns, f"calm-cpu-{u}")} == before
    assert events(kubectl, ns, "ChaosPodKilled") == []


async def test_the_target_refuses_other_namespaces_and_what_kubernetes_cannot_do(ns, chaos_kubeconfig, kubectl):
    target = KubernetesTarget("nothing", ns, kubeconfig=chaos_kubeconfig)
    with pytest.raises(ValueError, match="safety.namespace"):
        await target.preflight(_exp(schedule={"every": "1s"}, safety={"namespace": "elsewhere"}))
    with pytest.raises(ValueError, match="action.type pause"):
        await target.preflight(_exp(schedule={"every": "1s"}, action={"type": "pause", "duration": "1s"}))
    with pytest.raises(ValueError, match="not found"):
        await target.preflight(_exp(schedule={"every": "1s"}))
    sa = f"system:serviceaccount:{ns}:diloco-chaos"
    checks = [("delete", "pods", ns, "yes"), ("create", "events", ns, "yes"),
              ("get", "secrets", ns, "no"), ("create", "pods/exec", ns, "no"),
              ("delete", "dilocojobs.diloco.dev", ns, "no"), ("delete", "pods", "default", "no")]
    for verb, resource, where, expected in checks:
        out = kubectl.run("auth", "can-i", verb, resource, "-n", where, "--as", sa, check=False)
        assert out.stdout.strip() == expected, (verb, resource, where, out.stdout, out.stderr)


async def test_each_syncer_shard_is_a_target_of_its_own_and_a_fault_takes_one_shard(
        kubectl, operator, ns, chaos_kubeconfig, tmp_path):
    config = {"outer": {"fragments": 4}, "syncer": {"shards": 2}}
    kubectl.apply(job("sharded", cpu_units(1), config=config), "-n", ns)
    wait_job_ready(kubectl, ns, "sharded", 1)
    selector = "diloco.dev/job=sharded,diloco.dev/component=syncer"
    target = KubernetesTarget("sharded", ns, kubeconfig=chaos_kubeconfig)
    candidates = [c for c in await target.candidates() if c.role == "syncer"]
    assert [c.unit for c in candidates] == ["sharded-syncer-0", "sharded-syncer-1"]
    assert all(len(c.members) == 1 for c in candidates)
    exp = _exp(schedule={"every": "2s", "seed": 1}, target={"kind": "syncer"}, action={"type": "kill"},
               safety={"maxConcurrent": 1, "maxFaults": 2, "maxDuration": "2m", "recoveryTimeout": "60s",
                       "namespace": ns})
    record = Record(tmp_path / "record.jsonl")
    summary = await run_experiment(exp, target, record, poll_s=0.2)
    assert summary["faults"] == 2 and summary["recovered"] == 2, record.entries
    faults = [e for e in record.entries if e.event == "fault"]
    for f in faults:  # one shard's pod per fault, never both: the pod of that shard's Deployment
        (pod,) = f.details["uids"]
        assert f.unit in ("sharded-syncer-0", "sharded-syncer-1") and pod.startswith(f.unit + "-"), f
    # Both shards run again on new pods where they were hit, each Deployment healed on its own.
    wait_job_ready(kubectl, ns, "sharded", 1)
    shards = kubectl.get("dj", "sharded", ns=ns)["status"]["syncerShards"]
    assert [(s["name"], s["ready"]) for s in shards] == [("sharded-syncer-0", True), ("sharded-syncer-1", True)]
    hit = {uid for f in faults for uid in f.details["uids"].values()}
    assert hit and not hit & {p["metadata"]["uid"] for p in kubectl.get(
        "pod", ns=ns, selector=selector) if not p["metadata"].get("deletionTimestamp")}
