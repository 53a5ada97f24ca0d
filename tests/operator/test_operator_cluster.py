"""The operator on a real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), kopf
running for real: placement on fake GPU/TPU pools, self-healing, scaling, cascading deletion, restart."""

from __future__ import annotations

import base64
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from pathlib import Path

import pytest

from diloco_kube.labels import FAIL_POD_EXIT_CODE_ANNOTATION, FAIL_POD_LABEL, POOL_LABEL
from diloco_operator.api import models as api
from diloco_operator.objects.builders import secret_name

from polling import wait_for
from cluster_kit import PYTHONPATH

pytestmark = pytest.mark.cluster
FAIL_POD_MESSAGE_ANNOTATION = "pod-container-running-failed.stage.kwok.x-k8s.io/message"
FAST = {"backoffSeconds": 0, "maxRestarts": 20}


def job(name: str, units: list[dict], **spec) -> dict:
    body = {"image": "diloco-trainer:test", "units": units,
            "syncer": {"nodeSelector": {POOL_LABEL: "cpu"}}, "restartPolicy": FAST}
    body.update(spec)
    return {"apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": name}, "spec": body}


def cpu_units(count: int, **kw) -> list[dict]:
    return [{"name": "cpu", "count": count, "nodeSelector": {POOL_LABEL: "cpu"}, **kw}]


def pods(kubectl, ns: str, selector: str) -> list[dict]:
    return [p for p in kubectl.get("pods", ns=ns, selector=selector) if not p["metadata"].get("deletionTimestamp")]


def running(p: dict) -> bool:
    return p["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))


def unit_pods(kubectl, ns: str, unit: str) -> list[dict]:
    return pods(kubectl, ns, f"diloco.dev/unit={unit}")


def condition(obj: dict, ctype: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def wait_job_ready(kubectl, ns: str, name: str, units: int, timeout: float = 60, restarts: int | None = None) -> dict:
    """Wait until the job is Running and Ready with `units` ready units (and, if given, `restarts` counted:
    the job's status follows its units' within a reconcile, so it is awaited, not read once)."""
    def ready():
        dj = kubectl.get("dj", name, ns=ns)
        st = dj.get("status", {}) if dj else {}
        ok = st.get("phase") == "Running" and st.get("unitsReady") == units and condition(dj, "Ready").get("status") == "True"
        return dj if ok and (restarts is None or st.get("restarts") == restarts) else None
    return wait_for(ready, timeout, f"job {name} Running with {units} ready units"
                    + (f" and {restarts} restarts" if restarts is not None else ""), 0.2)


def events(kubectl, ns: str, reason: str) -> list[dict]:
    return [e for e in kubectl.get("events", ns=ns) if e.get("reason") == reason]


def wait_events(kubectl, ns: str, reason: str, match=lambda e: True, timeout: float = 15) -> list[dict]:
    """The `reason` Events that `match`, once there is one: a reconcile posts its Events after its other writes, so
    a test that has just seen those writes may look before the Events are there."""
    return wait_for(lambda: [e for e in events(kubectl, ns, reason) if match(e)], timeout, f"a {reason} Event", 0.2)


def serving_pair(kubectl, ns: str, job_name: str, where) -> list[str]:
    """--tls-cert/--tls-key for a syncer run here with the certificate the operator issued for the job (Auto TLS):
    the operator reads a TLS job's syncer only over https, verified against the job's CA."""
    data = kubectl.get("secret", f"{job_name}-syncer-tls", ns=ns)["data"]
    for key in ("tls.crt", "tls.key"):
        (where / key).write_bytes(base64.b64decode(data[key]))
    return ["--tls-cert", str(where / "tls.crt"), "--tls-key", str(where / "tls.key")]


def job_syncer(kubectl, ns: str, job_name: str, where) -> tuple[subprocess.Popen, Path, str]:
    """A real syncer run here (kwok runs no containers) on the config, token and certificate the operator generated
    for the job, with its state in where/state (its endpoint.json says where it listens); and the job's token."""
    token = base64.b64decode(kubectl.get("secret", f"{job_name}-token", ns=ns)["data"]["token"]).decode()
    config = where / "config.yaml"
    config.write_text(kubectl.get("configmap", f"{job_name}-config", ns=ns)["data"]["config.yaml"])
    state = where / "state"
    env = {**os.environ, "DILOCO_TOKEN": token, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config),
                             "--host", "127.0.0.1", "--port", "0", "--state-dir", str(state),
                             *serving_pair(kubectl, ns, job_name, where)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, state, token


def node_pool(kubectl, node: str) -> str:
    return kubectl.get("node", node)["metadata"]["labels"][POOL_LABEL]


def test_mixed_gpu_tpu_job_lands_each_unit_on_its_pool(kubectl, operator, ns):
    units = [
        {"name": "h100", "count": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
        {"name": "l4", "count": 1, "accelerator": {"type": "nvidia-l4", "count": 4}},
        {"name": "v5p", "count": 1, "podsPerUnit": 2, "accelerator": {"type": "tpu-v5p-slice", "count": 4,
                                                                      "topology": "2x2x2"}},
    ]
    kubectl.apply(job("mixed", units), "-n", ns)
    dj = wait_job_ready(kubectl, ns, "mixed", 4)
    assert condition(dj, "QuorumAvailable")["status"] == "True" and dj["status"]["syncerReady"] is True
    learners = pods(kubectl, ns, "diloco.dev/job=mixed,diloco.dev/component=learner")
    assert len(learners) == 5
    want = {"h100": "gpu-h100", "l4": "gpu-l4", "v5p": "tpu-v5p"}
    for p in learners:
        assert node_pool(kubectl, p["spec"]["nodeName"]) == want[p["metadata"]["labels"]["diloco.dev/template"]]
    tpu = [p for p in learners if p["metadata"]["labels"]["diloco.dev/template"] == "v5p"]
    assert len({p["spec"]["nodeName"] for p in tpu}) == 2, "a 4-chip-per-host slice needs two hosts"
    env = {e["name"]: e.get("value") for e in tpu[0]["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "rank-0.mixed-v5p-0"
    syncer = pods(kubectl, ns, "diloco.dev/job=mixed,diloco.dev/component=syncer")
    assert [node_pool(kubectl, p["spec"]["nodeName"]) for p in syncer] == ["cpu"]
    lu = kubectl.get("lu", "mixed-h100-1", ns=ns)
    assert lu["status"]["nodePool"] == "gpu-h100" and lu["status"]["podsReady"] == 1
    created = events(kubectl, ns, "UnitCreated")  # one Event per template and reconcile, naming its units
    assert len(created) == 3 and sum(int(e["message"].split()[1]) for e in created) == 4
    assert all(f"mixed-{u}" in " ".join(e["message"] for e in created) for u in ("h100-0", "h100-1", "l4-0", "v5p-0"))
    assert not [s for s in kubectl.get("services", ns=ns) if s["metadata"]["name"] in ("mixed-h100-0", "mixed-l4-0")]
    assert kubectl.get("services", "mixed-v5p-0", ns=ns), "a 2-pod unit rendezvous through its headless Service"


def test_a_pod_asking_for_more_gpus_than_any_node_stays_pending_and_degrades_the_job(kubectl, operator, ns):
    units = [{"name": "huge", "count": 1, "accelerator": {"type": "nvidia-h100-80gb", "count": 16}},
             *cpu_units(1)]
    kubectl.apply(job("greedy", units), "-n", ns)

    def degraded():
        dj = kubectl.get("dj", "greedy", ns=ns)
        c = condition(dj, "Degraded")
        return dj if c.get("status") == "True" and c.get("reason") == "UnitsUnschedulable" else None
    dj = wait_for(degraded, 30, "Degraded=True/UnitsUnschedulable", 0.2)
    assert "greedy-huge-0" in condition(dj, "Degraded")["message"]
    lu = kubectl.get("lu", "greedy-huge-0", ns=ns)
    assert condition(lu, "PodsScheduled")["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in condition(lu, "PodsScheduled")["message"]
    operator.wait_looked_again()  # no churn: an unplaceable pod is not a failure to restart
    (p,) = unit_pods(kubectl, ns, "greedy-huge-0")
    assert p["status"]["phase"] == "Pending" and p["metadata"]["name"] == "greedy-huge-0-0-0"
    assert kubectl.get("lu", "greedy-huge-0", ns=ns)["status"]["restarts"] == 0
    assert [e for e in events(kubectl, ns, "Unschedulable") if e["involvedObject"]["name"] == "greedy-huge-0"]


def test_a_deleted_learner_pod_is_replaced_and_other_units_are_untouched(kubectl, operator, ns):
    kubectl.apply(job("heal", cpu_units(3)), "-n", ns)
    dj = wait_job_ready(kubectl, ns, "heal", 3)
    quorum_since = condition(dj, "QuorumAvailable")["lastTransitionTime"]
    others = {p["metadata"]["uid"] for u in ("heal-cpu-0", "heal-cpu-2") for p in unit_pods(kubectl, ns, u)}
    times, phases = [], set()
    for kill in range(5):
        (victim,) = unit_pods(kubectl, ns, "heal-cpu-1")
        started = time.monotonic()  # deleted through the API: the figure excludes a kubectl process start
        kubectl.testbed.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")

        def replaced():
            phases.add(kubectl.get("dj", "heal", ns=ns)["status"]["phase"])
            new = [p for p in unit_pods(kubectl, ns, "heal-cpu-1") if p["metadata"]["uid"] != victim["metadata"]["uid"]]
            return new if new and all(running(p) for p in new) else None
        (new,) = wait_for(replaced, 30, f"replacement of {victim['metadata']['name']}", 0.05)
        times.append(time.monotonic() - started)
        assert int(new["metadata"]["labels"]["diloco.dev/incarnation"]) == kill + 1
    assert phases == {"Running"}, "the job stays Running while one unit heals"
    assert {p["metadata"]["uid"] for u in ("heal-cpu-0", "heal-cpu-2") for p in unit_pods(kubectl, ns, u)} == others
    lu = kubectl.get("lu", "heal-cpu-1", ns=ns)
    assert lu["status"]["restarts"] == 5
    dj = wait_job_ready(kubectl, ns, "heal", 3, restarts=5)
    assert condition(dj, "QuorumAvailable")["lastTransitionTime"] == quorum_since, "K=1 held throughout"
    assert len([e for e in events(kubectl, ns, "PodDeleted") if e["involvedObject"]["name"] == "heal-cpu-1"]) >= 1
    median = statistics.median(times)
    print(f"\npod kill -> replacement Running: median {median:.2f}s, all {[round(t, 2) for t in times]}")
    with open(os.path.join(tempfile.gettempdir(), "diloco-heal-times.json"), "w") as f:
        json.dump({"median_s": median, "all_s": times}, f)
    assert median < 10


def test_a_multi_pod_unit_restarts_as_a_whole(kubectl, operator, ns):
    units = [{"name": "v5p", "count": 1, "podsPerUnit": 2, "accelerator": {"type": "tpu-v5p-slice", "count": 4}},
             *cpu_units(1)]
    kubectl.apply(job("gang", units), "-n", ns)
    wait_job_ready(kubectl, ns, "gang", 2)
    before = {p["metadata"]["labels"]["diloco.dev/rank"]: p["metadata"]["uid"] for p in unit_pods(kubectl, ns, "gang-v5p-0")}
    cpu_uid = unit_pods(kubectl, ns, "gang-cpu-0")[0]["metadata"]["uid"]
    kubectl.run("delete", "pod", "gang-v5p-0-0-1", "-n", ns, "--wait=false")

    def regrouped():
        ps = unit_pods(kubectl, ns, "gang-v5p-0")
        return ps if len(ps) == 2 and all(running(p) for p in ps) and \
            all(p["metadata"]["labels"]["diloco.dev/incarnation"] == "1" for p in ps) else None
    after = wait_for(regrouped, 30, "the TPU unit recreated as a whole", 0.1)
    assert not {p["metadata"]["uid"] for p in after} & set(before.values()), "the surviving rank was restarted too"
    assert unit_pods(kubectl, ns, "gang-cpu-0")[0]["metadata"]["uid"] == cpu_uid


def test_a_pod_failed_by_kwok_is_replaced_and_counted(kubectl, operator, ns):
    kubectl.apply(job("chaos", cpu_units(2)), "-n", ns)
    wait_job_ready(kubectl, ns, "chaos", 2)
    (victim,) = unit_pods(kubectl, ns, "chaos-cpu-0")
    name = victim["metadata"]["name"]
    kubectl.run("annotate", "pod", name, "-n", ns, f"{FAIL_POD_EXIT_CODE_ANNOTATION}=137")
    kubectl.run("label", "pod", name, "-n", ns, f"{FAIL_POD_LABEL}=true")

    def healed():
        lu = kubectl.get("lu", "chaos-cpu-0", ns=ns)
        ps = unit_pods(kubectl, ns, "chaos-cpu-0")
        return lu if lu["status"].get("restarts") == 1 and len(ps) == 1 and running(ps[0]) \
            and ps[0]["metadata"]["uid"] != victim["metadata"]["uid"] else None
    wait_for(healed, 30, "the failed pod replaced and counted", 0.1)
    failed = [e for e in events(kubectl, ns, "PodFailed") if e["involvedObject"]["name"] == "chaos-cpu-0"]
    assert failed and "exit code 137" in failed[0]["message"]
    wait_job_ready(kubectl, ns, "chaos", 2, restarts=1)


def test_the_failed_syncer_pod_is_replaced_on_the_same_checkpoint_volume(kubectl, operator, ns):
    kubectl.apply(job("sync", cpu_units(1)), "-n", ns)
    wait_job_ready(kubectl, ns, "sync", 1)
    pvc_uid = kubectl.get("pvc", "sync-checkpoint", ns=ns)["metadata"]["uid"]
    (old,) = pods(kubectl, ns, "diloco.dev/job=sync,diloco.dev/component=syncer")
    kubectl.run("delete", "pod", old["metadata"]["name"], "-n", ns, "--wait=false")

    def replaced():
        ps = [p for p in pods(kubectl, ns, "diloco.dev/job=sync,diloco.dev/component=syncer")
              if p["metadata"]["uid"] != old["metadata"]["uid"] and running(p)]
        return ps[0] if ps else None
    new = wait_for(replaced, 30, "a new syncer pod", 0.1)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in new["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["sync-checkpoint"] and kubectl.get("pvc", "sync-checkpoint", ns=ns)["metadata"]["uid"] == pvc_uid
    args = new["spec"]["containers"][0]["command"]
    assert args[:2] == ["diloco", "syncer"] and args[args.index("--state-dir") + 1] == "/var/lib/diloco"
    wait_job_ready(kubectl, ns, "sync", 1)


def test_a_restarted_unit_keeps_its_state_volume(kubectl, operator, ns):
    kubectl.apply(job("keep", cpu_units(1, stateVolume={"size": "1Gi"})), "-n", ns)
    wait_job_ready(kubectl, ns, "keep", 1)
    pvc = wait_for(lambda: (c := kubectl.get("pvc", "keep-cpu-0-state-0", ns=ns)) and
                   c.get("status", {}).get("phase") == "Bound" and c, 30, "the state PVC bound", 0.2)
    (old,) = unit_pods(kubectl, ns, "keep-cpu-0")
    kubectl.run("delete", "pod", old["metadata"]["name"], "-n", ns, "--wait=false")
    (new,) = wait_for(lambda: [p for p in unit_pods(kubectl, ns, "keep-cpu-0")
                               if p["metadata"]["uid"] != old["metadata"]["uid"] and running(p)] or None,
                      30, "the replacement pod", 0.1)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in new["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["keep-cpu-0-state-0"]
    assert kubectl.get("pvc", "keep-cpu-0-state-0", ns=ns)["metadata"]["uid"] == pvc["metadata"]["uid"]


def test_kubectl_scale_adds_and_removes_units_without_touching_the_others(kubectl, operator, ns):
    kubectl.apply(job("elastic", cpu_units(2, maxCount=5)), "-n", ns)
    wait_job_ready(kubectl, ns, "elastic", 2)
    keep = {p["metadata"]["uid"] for p in pods(kubectl, ns, "diloco.dev/unit=elastic-cpu-0")}
    lu0 = kubectl.get("lu", "elastic-cpu-0", ns=ns)["metadata"]["uid"]
    kubectl.run("scale", "dj", "elastic", "-n", ns, "--replicas=4")
    dj = wait_job_ready(kubectl, ns, "elastic", 4)
    assert dj["status"]["replicas"] == 4
    assert sorted(lu["metadata"]["name"] for lu in kubectl.get("lu", ns=ns)) == [f"elastic-cpu-{i}" for i in range(4)]
    over = kubectl.run("scale", "dj", "elastic", "-n", ns, "--replicas=9", check=False)
    assert over.returncode != 0 and "maxCount" in over.stderr
    kubectl.run("scale", "dj", "elastic", "-n", ns, "--replicas=1")
    wait_job_ready(kubectl, ns, "elastic", 1)
    wait_for(lambda: [lu["metadata"]["name"] for lu in kubectl.get("lu", ns=ns)] == ["elastic-cpu-0"], 30, "only unit 0 left", 0.2)
    wait_for(lambda: len(pods(kubectl, ns, "diloco.dev/job=elastic,diloco.dev/component=learner")) == 1, 30, "removed units' pods garbage-collected", 0.2)
    assert kubectl.get("lu", "elastic-cpu-0", ns=ns)["metadata"]["uid"] == lu0
    assert {p["metadata"]["uid"] for p in pods(kubectl, ns, "diloco.dev/unit=elastic-cpu-0")} == keep
    wait_events(kubectl, ns, "UnitRemoved")


def test_restart_limit_fails_the_unit_and_the_job_for_good(kubectl, operator, ns):
    spec = {"config": {"outer": {"quorum": 2}}, "restartPolicy": {"backoffSeconds": 0, "maxRestarts": 1}}
    kubectl.apply(job("fragile", cpu_units(2), **spec), "-n", ns)
    wait_job_ready(kubectl, ns, "fragile", 2)
    for attempt in range(2):
        (victim,) = wait_for(lambda: [p for p in unit_pods(kubectl, ns, "fragile-cpu-0") if running(p)] or None,
                             30, "a running pod to kill", 0.1)
        kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        if attempt == 0:
            wait_for(lambda: kubectl.get("lu", "fragile-cpu-0", ns=ns)["status"].get("restarts") == 1, 30, "first restart", 0.1)
    dj = wait_for(lambda: (d := kubectl.get("dj", "fragile", ns=ns))["status"].get("phase") == "Failed" and d,
                  30, "job Failed", 0.2)
    assert condition(dj, "Failed")["reason"] == "TooFewUnits"
    lu = kubectl.get("lu", "fragile-cpu-0", ns=ns)
    assert lu["status"]["phase"] == "Failed" and lu["status"]["restarts"] == 1
    wait_for(lambda: not pods(kubectl, ns, "diloco.dev/job=fragile,diloco.dev/component=learner"), 30, "a failed job's learner pods stopped", 0.2)
    wait_for(lambda: kubectl.get("deployment", "fragile-syncer", ns=ns)["spec"]["replicas"] == 0, 30, "the syncer scaled to zero", 0.2)
    operator.wait_looked_again()
    assert kubectl.get("dj", "fragile", ns=ns)["status"]["phase"] == "Failed", "terminal phases stick"
    assert not pods(kubectl, ns, "diloco.dev/job=fragile,diloco.dev/component=learner")
    assert events(kubectl, ns, "BackoffLimitExceeded") and events(kubectl, ns, "JobFailed")


def test_deleting_the_job_cascades_to_everything_it_owns(kubectl, operator, ns):
    kubectl.apply(job("gone", cpu_units(2, podsPerUnit=2)), "-n", ns)
    wait_job_ready(kubectl, ns, "gone", 2)
    sel = "diloco.dev/job=gone"
    kinds = ("learnerunits", "pods", "deployments", "services", "persistentvolumeclaims", "secrets", "configmaps")
    assert all(kubectl.get(k, ns=ns, selector=sel) for k in kinds)
    kubectl.run("delete", "dj", "gone", "-n", ns, "--wait=false")
    wait_for(lambda: not any(kubectl.get(k, ns=ns, selector=sel) for k in kinds), 60, "garbage collection of every owned object", 0.3)


def test_a_job_recreated_under_its_old_name_gets_back_every_object_it_owns(kubectl, operator, ns):
    """The objects the operator creates once and then reads back only every few minutes (token Secrets, volumes,
    Services, ConfigMaps) are the new job's: deleted with the old job, they come back for the new one at once."""
    sel = "diloco.dev/job=again"
    kinds = ("secrets", "persistentvolumeclaims", "services", "configmaps")

    def owned(uids: set[str]) -> dict[str, list[str]]:
        return {k: sorted(o["metadata"]["name"] for o in kubectl.get(k, ns=ns, selector=sel)
                          if {r["uid"] for r in o["metadata"].get("ownerReferences") or []} & uids) for k in kinds}

    def uids() -> set[str]:
        dj = kubectl.get("dj", "again", ns=ns)
        return {dj["metadata"]["uid"]} | {lu["metadata"]["uid"] for lu in kubectl.get("lu", ns=ns, selector=sel)}

    kubectl.apply(job("again", cpu_units(1, podsPerUnit=2, stateVolume={"size": "1Gi"})), "-n", ns)
    wait_job_ready(kubectl, ns, "again", 1)
    first = wait_for(lambda: all((o := owned(uids())).values()) and o, 30, "the first job's objects", 0.2)
    assert "again-cpu-0" in first["services"] and len(first["persistentvolumeclaims"]) == 3  # syncer's + 2 ranks'
    kubectl.run("delete", "dj", "again", "-n", ns)
    wait_for(lambda: not any(kubectl.get(k, ns=ns, selector=sel) for k in (*kinds, "learnerunits", "pods")), 60,
             "garbage collection of the first job's objects", 0.3)

    kubectl.apply(job("again", cpu_units(1, podsPerUnit=2, stateVolume={"size": "1Gi"})), "-n", ns)
    wait_job_ready(kubectl, ns, "again", 1)
    wait_for(lambda: owned(uids()) == first or None, 60, f"the same objects owned by the new job and its unit (first job: {first})", 0.5)


def test_a_job_recreated_before_its_old_token_secret_is_collected_gets_its_own_once_it_is(kubectl, operator, ns):
    """Re-created while the old job's token Secret still exists (held here by a finalizer, as a slow garbage
    collector would hold it): the new job does not use it (Ready=False, ObjectNotOurs), and gets its own once it is
    gone, not minutes later."""
    kubectl.apply(job("early", cpu_units(1)), "-n", ns)
    wait_job_ready(kubectl, ns, "early", 1)
    name = secret_name("early")
    kubectl.run("patch", "secret", name, "-n", ns, "--type=merge", "-p",
                json.dumps({"metadata": {"finalizers": ["diloco.dev/test-hold"]}}))
    kubectl.run("delete", "dj", "early", "-n", ns)
    wait_for(lambda: kubectl.get("secret", name, ns=ns)["metadata"].get("deletionTimestamp"), 60,
             "the garbage collector to delete the old token Secret (held by the finalizer)", 0.3)

    kubectl.apply(job("early", cpu_units(1)), "-n", ns)
    uid = wait_for(lambda: (d := kubectl.get("dj", "early", ns=ns)) and d["metadata"]["uid"], 10, "the new job")
    wait_for(lambda: (c := condition(kubectl.get("dj", "early", ns=ns), "Ready")).get("reason") == "ObjectNotOurs"
             and name in c.get("message", ""), 30, "the new job blocked by the old job's Secret", 0.3)
    kubectl.run("patch", "secret", name, "-n", ns, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
    wait_for(lambda: (s := kubectl.get("secret", name, ns=ns)) and s["metadata"]["ownerReferences"][0]["uid"] == uid,
             30, "the new job's own token Secret", 0.3)
    wait_job_ready(kubectl, ns, "early", 1)


def test_the_operator_exposes_prometheus_metrics_and_liveness(operator):
    health = urllib.request.urlopen(f"http://127.0.0.1:{operator.liveness_port}/healthz", timeout=5)
    assert health.status == 200
    text = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).read().decode()
    assert 'diloco_operator_reconciles_total{kind="unit",result="ok"}' in text
    assert "diloco_operator_unit_restarts_total" in text


def test_a_restarted_operator_picks_up_where_it_left_off(kubectl, operator, ns):
    kubectl.apply(job("resume", cpu_units(2, maxCount=3)), "-n", ns)
    wait_job_ready(kubectl, ns, "resume", 2)
    untouched = unit_pods(kubectl, ns, "resume-cpu-1")[0]["metadata"]["uid"]
    operator.stop()
    try:
        (victim,) = unit_pods(kubectl, ns, "resume-cpu-0")
        kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        kubectl.run("scale", "dj", "resume", "-n", ns, "--replicas=3")
        time.sleep(2)
        assert unit_pods(kubectl, ns, "resume-cpu-0") == [], "nothing heals while the operator is down"
        assert kubectl.get("lu", "resume-cpu-2", ns=ns) is None
    finally:
        operator.start()
    wait_job_ready(kubectl, ns, "resume", 3, timeout=90, restarts=1)
    (new,) = unit_pods(kubectl, ns, "resume-cpu-0")
    assert new["metadata"]["labels"]["diloco.dev/incarnation"] == "1"
    assert unit_pods(kubectl, ns, "resume-cpu-1")[0]["metadata"]["uid"] == untouched
    operator.wait_looked_again()
    assert len(unit_pods(kubectl, ns, "resume-cpu-0")) == 1, "no duplicate pods after the restart"


def test_job_status_reports_a_real_syncers_progress_and_units_last_contribution(kubectl, operator, ns, tmp_path):
    tiny = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}, "outer": {"fragments": 2}}
    kubectl.apply(job("live", cpu_units(1), config=tiny), "-n", ns)
    wait_job_ready(kubectl, ns, "live", 1)
    syncer, state, token = job_syncer(kubectl, ns, "live", tmp_path)
    stop, beating = threading.Event(), None
    try:
        url = wait_for(lambda: (state / "endpoint.json").exists() and
                       json.loads((state / "endpoint.json").read_text())["url"], 60, "the syncer to listen", 0.2)

        def post(path: str, body: dict) -> int:
            req = urllib.request.Request(f"{url}{path}", method="POST", data=json.dumps(body).encode(), headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=10, context=ssl._create_unverified_context()).status
        assert post("/v1/register", {"learner_id": "live-cpu-0", "unit": 0, "world_size": 1, "device": "cpu"}) == 200
        # The learner's progress as it reports it, every second (live: heard within 3 heartbeats): 10 steps of
        # 0.5 s, 2,560 tokens; nothing merged yet.

        def heartbeats():
            while not stop.is_set():
                post("/v1/heartbeat", {"learner_id": "live-cpu-0", "step": 10, "tokens": 2560, "step_time_s": 0.5})
                stop.wait(1.0)
        beating = threading.Thread(target=heartbeats, daemon=True)
        beating.start()
        assert "goodput" not in kubectl.get("dj", "live", ns=ns)["status"]  # no syncer read yet: absent, not zero
        kubectl.run("annotate", "dj", "live", "-n", ns, f"diloco.dev/syncer-url={url}")
        dj = wait_for(lambda: (d := kubectl.get("dj", "live", ns=ns))["status"].get("learnersAlive") == 1 and d,
                      30, "the syncer's progress in the job's status", 0.2)
        st = dj["status"]
        assert st["outerSteps"] == 0 and st["version"] == 0  # nothing merged: every fragment at 0
        # What a person reads: the learner's tokens, none merged, and no useful time yet (its 10 steps reached no
        # model: merged fraction 0, so goodput 0 over the unit's allocated time).
        assert (st["tokensTrained"], st["tokensMergedPerFragment"]) == (2560, 0)
        assert st["mergedFraction"] == 0 and st["goodput"] == 0
        row = kubectl.run("get", "dj", "live", "-n", ns).stdout.splitlines()
        assert dict(zip(row[0].split(), row[1].split()))["TOKENS-MERGED"] == "0"
        lu = wait_for(lambda: (u := kubectl.get("lu", "live-cpu-0", ns=ns))["status"].get("lastContribution") and u,
                      30, "the unit's last contribution", 0.2)
        assert lu["status"]["lastContribution"].endswith("Z")
        # A fault: the unit's pod is deleted; the job names the unit, when and why, and how long it took to run again.
        (victim,) = unit_pods(kubectl, ns, "live-cpu-0")
        kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        dj = wait_for(lambda: (d := kubectl.get("dj", "live", ns=ns))["status"].get("lastFault", {}).get(
            "recoverySeconds") is not None and d, 60, "the job's last fault, recovered", 0.2)
        fault = dj["status"]["lastFault"]
        assert fault["unit"] == "live-cpu-0" and fault["reason"] == "PodDeleted" and fault["incarnation"] == 1
        assert "deleted" in fault["message"] and fault["time"] <= fault["recoveredAt"]
        assert 0 <= fault["recoverySeconds"] < 60
    finally:
        stop.set()
        if beating is not None:
            beating.join(timeout=15)
        syncer.terminate()
        syncer.wait(timeout=30)


def test_a_spec_the_models_reject_is_reported_on_the_job_with_the_field(kubectl, operator, ns):
    # CEL cannot check d_model % n_heads; the operator's pydantic models do, and say so on the job.
    bad = job("odd", cpu_units(1), config={"model": {"d_model": 10, "n_heads": 4}})
    kubectl.apply(bad, "-n", ns)
    dj = wait_for(lambda: (d := kubectl.get("dj", "odd", ns=ns)) and condition(d, "Ready").get("reason") == "InvalidSpec"
                  and d, 30, "Ready=False/InvalidSpec", 0.2)
    assert "spec.config.model" in condition(dj, "Ready")["message"] and "divisible" in dj["status"]["message"]
    assert kubectl.get("lu", ns=ns) == []
    wait_events(kubectl, ns, "InvalidSpec")
    kubectl.apply(job("fine", cpu_units(1)), "-n", ns)  # the operator goes on reconciling other jobs
    wait_job_ready(kubectl, ns, "fine", 1)
    assert condition(kubectl.get("dj", "odd", ns=ns), "Ready")["reason"] == "InvalidSpec"


def test_a_spec_only_the_syncer_can_refuse_stops_its_syncer_and_names_the_field(kubectl, operator, ns):
    # A transformers model's tensor count is known only once the syncer builds it: `diloco syncer` exits 2 with the
    # reason in its termination message. kwok plays the kubelet reporting that exit (quoted: its template is YAML).
    kubectl.apply(job("big", cpu_units(1)), "-n", ns)
    wait_job_ready(kubectl, ns, "big", 1)
    selector = "diloco.dev/job=big,diloco.dev/component=syncer"
    (syncer,) = pods(kubectl, ns, selector)
    reason = "diloco syncer: outer.fragments (64) must not exceed the model's 12 parameter tensors"
    kubectl.run("annotate", "pod", syncer["metadata"]["name"], "-n", ns, f"{FAIL_POD_EXIT_CODE_ANNOTATION}=2",
                f'{FAIL_POD_MESSAGE_ANNOTATION}="{reason}"')
    kubectl.run("label", "pod", syncer["metadata"]["name"], "-n", ns, f"{FAIL_POD_LABEL}=true")
    dj = wait_for(lambda: (d := kubectl.get("dj", "big", ns=ns)) and condition(d, "Ready").get("reason") == "InvalidSpec"
                  and d, 30, "Ready=False/InvalidSpec from the syncer's exit", 0.2)
    assert condition(dj, "Ready")["message"].startswith("spec.config.outer.fragments (64) must not exceed")
    assert dj["status"]["syncerRefusal"]["generation"] == dj["metadata"]["generation"]
    # the Event follows the status write of the same reconcile
    wait_events(kubectl, ns, "InvalidSpec", lambda e: "spec.config.outer.fragments" in e["message"])
    # No crash loop: the syncer is scaled to zero and no syncer runs (kwok leaves its pod Failed, which a
    # ReplicaSet does not delete; a kubelet restarting the container would keep it Running, and scaling deletes it).
    wait_for(lambda: kubectl.get("deployment", "big-syncer", ns=ns)["spec"]["replicas"] == 0
             and all(p["status"].get("phase") == "Failed" for p in pods(kubectl, ns, selector)), 30,
             "the refused syncer scaled to zero", 0.2)
    # An edit of the spec gives the syncer the new spec at once.
    kubectl.run("patch", "dj", "big", "-n", ns, "--type=merge", "-p", '{"spec": {"config": {"outer": {"fragments": 2}}}}')
    dj = wait_job_ready(kubectl, ns, "big", 1)
    assert "syncerRefusal" not in dj["status"] and kubectl.get("deployment", "big-syncer", ns=ns)["spec"]["replicas"] == 1


def test_a_changed_image_recreates_the_pods_without_counting_restarts(kubectl, operator, ns):
    kubectl.apply(job("roll", cpu_units(2)), "-n", ns)
    wait_job_ready(kubectl, ns, "roll", 2)
    kubectl.run("patch", "dj", "roll", "-n", ns, "--type=merge", "-p", '{"spec": {"image": "diloco-trainer:v2"}}')

    def rolled():
        ps = pods(kubectl, ns, "diloco.dev/job=roll,diloco.dev/component=learner")
        return len(ps) == 2 and all(running(p) and p["spec"]["containers"][0]["image"] == "diloco-trainer:v2"
                                    for p in ps) and ps
    for p in wait_for(rolled, 30, "pods on the new image", 0.2):
        assert p["metadata"]["labels"]["diloco.dev/incarnation"] == "1"
    wait_job_ready(kubectl, ns, "roll", 2, restarts=0)
    wait_events(kubectl, ns, "UnitUpdated")
    wait_events(kubectl, ns, "SpecChanged")


def test_a_job_whose_units_all_complete_succeeds_and_stays_succeeded(kubectl, operator, ns):
    kubectl.apply(job("done", cpu_units(2, steps=100)), "-n", ns)
    wait_job_ready(kubectl, ns, "done", 2)
    learners = pods(kubectl, ns, "diloco.dev/job=done,diloco.dev/component=learner")
    assert all("--steps" in p["spec"]["containers"][0]["command"] for p in learners)
    for p in learners:  # what a kubelet reports when `diloco learner --steps N` exits 0 (kwok runs no process)
        kubectl.run("patch", "pod", p["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                    "-p", '{"status": {"phase": "Succeeded"}}')
    dj = wait_for(lambda: (d := kubectl.get("dj", "done", ns=ns))["status"].get("phase") == "Succeeded" and d,
                  30, "job Succeeded", 0.2)
    assert condition(dj, "Succeeded")["reason"] == "AllUnitsSucceeded" and dj["status"]["completionTime"]
    wait_for(lambda: kubectl.get("deployment", "done-syncer", ns=ns)["spec"]["replicas"] == 0, 30, "the syncer scaled to zero", 0.2)
    kubectl.run("delete", "pod", learners[0]["metadata"]["name"], "-n", ns, "--wait=false")
    wait_for(lambda: not [p for p in pods(kubectl, ns, "diloco.dev/job=done,diloco.dev/component=learner")
                          if p["metadata"]["uid"] == learners[0]["metadata"]["uid"]], 30, "the pod deleted", 0.2)
    operator.wait_looked_again()
    assert unit_pods(kubectl, ns, learners[0]["metadata"]["labels"]["diloco.dev/unit"]) == []
    assert kubectl.get("dj", "done", ns=ns)["status"]["phase"] == "Succeeded", "terminal phases stick"
    assert all(lu["status"]["phase"] == "Succeeded" for lu in kubectl.get("lu", ns=ns))


def test_each_syncer_shard_runs_heals_and_reports_on_its_own(kubectl, operator, ns, tmp_path):
    tiny = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}, "outer": {"fragments": 3},
            "syncer": {"shards": 2}}
    kubectl.apply(job("shard", cpu_units(1), config=tiny), "-n", ns)
    wait_job_ready(kubectl, ns, "shard", 1)
    selector = "diloco.dev/job=shard,diloco.dev/component=syncer"
    by_shard = {p["metadata"]["labels"]["diloco.dev/shard"]: p for p in pods(kubectl, ns, selector)}
    assert sorted(by_shard) == ["0", "1"]
    for shard, pod in by_shard.items():
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == [f"shard-checkpoint-{shard}"]
        assert [c["name"] for c in pod["spec"]["containers"]] == ["syncer", "standby"]
        assert kubectl.get("services", f"shard-syncer-{shard}", ns=ns)["spec"]["selector"]["diloco.dev/shard"] == shard
    (lu_pod,) = unit_pods(kubectl, ns, "shard-cpu-0")
    cmd = lu_pod["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--syncer") + 1] == "https://shard-syncer-0:8470,https://shard-syncer-1:8470"
    dj = kubectl.get("dj", "shard", ns=ns)
    assert [(s["name"], s["ready"], s["fragments"]) for s in dj["status"]["syncerShards"]] == [
        ("shard-syncer-0", True, [0, 2]), ("shard-syncer-1", True, [1])]

    # Shard 1's pod dies: only shard 1 is replaced, on its own volume; shard 0's pod is untouched.
    pvc_uid = kubectl.get("pvc", "shard-checkpoint-1", ns=ns)["metadata"]["uid"]
    kubectl.run("delete", "pod", by_shard["1"]["metadata"]["name"], "-n", ns, "--wait=false")
    wait_for(lambda: [p for p in pods(kubectl, ns, selector + ",diloco.dev/shard=1")
                      if p["metadata"]["uid"] != by_shard["1"]["metadata"]["uid"] and running(p)], 30, "a new pod for shard 1", 0.2)
    assert kubectl.get("pvc", "shard-checkpoint-1", ns=ns)["metadata"]["uid"] == pvc_uid
    assert [p["metadata"]["uid"] for p in pods(kubectl, ns, selector + ",diloco.dev/shard=0")] == [
        by_shard["0"]["metadata"]["uid"]]
    # Shard 0's Deployment deleted by hand: the operator puts it back; the job says which shard is down meanwhile.
    kubectl.run("delete", "deployment", "shard-syncer-0", "-n", ns, "--wait=false")
    wait_for(lambda: any(p["metadata"]["uid"] != by_shard["0"]["metadata"]["uid"] and running(p)
                         for p in pods(kubectl, ns, selector + ",diloco.dev/shard=0")), 60, "shard 0's Deployment and pod back", 0.2)
    wait_job_ready(kubectl, ns, "shard", 1)

    # Two real shards, on the operator's config and token: each reports its own fragments and merges.
    token = base64.b64decode(kubectl.get("secret", "shard-token", ns=ns)["data"]["token"]).decode()
    config = tmp_path / "config.yaml"
    config.write_text(kubectl.get("configmap", "shard-config", ns=ns)["data"]["config.yaml"])
    env = {**os.environ, "DILOCO_TOKEN": token, "PYTHONPATH": PYTHONPATH}
    procs, urls = [], []
    try:
        for shard in range(2):
            state = tmp_path / f"state-{shard}"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
                 "--port", "0", "--state-dir", str(state), "--shard", str(shard),
                 *serving_pair(kubectl, ns, "shard", tmp_path)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(wait_for(lambda: (state / "endpoint.json").exists() and
                                 json.loads((state / "endpoint.json").read_text())["url"], 60, f"shard {shard} to listen", 0.2))
        kubectl.run("annotate", "dj", "shard", "-n", ns, f"diloco.dev/syncer-url={','.join(urls)}")
        def reported():
            d = kubectl.get("dj", "shard", ns=ns)
            return all(s.get("outerSteps") is not None for s in d["status"]["syncerShards"]) and d
        dj = wait_for(reported, 30, "both shards' numbers in the job's status", 0.2)
        assert [(s["fragments"], s["outerSteps"]) for s in dj["status"]["syncerShards"]] == [([0, 2], 0), ([1], 0)]
        assert dj["status"]["outerSteps"] == 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def test_a_job_never_takes_over_objects_of_its_names_that_are_not_its_own(kubectl, operator, ns):
    # A job named like someone's objects: their ConfigMap "<job>-config" and Secret "<job>-token" exist already.
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nginx-config"},
                   "data": {"nginx.conf": "worker_processes 1;"}}, "-n", ns)
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "nginx-token"},
                   "stringData": {"token": "someone-elses"}}, "-n", ns)
    kubectl.apply(job("nginx", cpu_units(1)), "-n", ns)

    def blocked_by(kind: str, name: str):
        ready = condition(kubectl.get("dj", "nginx", ns=ns) or {}, "Ready")
        return ready.get("reason") == "ObjectNotOurs" and f"{kind} {ns}/{name} " in ready["message"] and ready
    ready = wait_for(lambda: blocked_by("Secret", "nginx-token"), 60, "Ready=False naming the Secret", 0.2)
    assert ready["status"] == "False" and "not this job's" in ready["message"]
    secret = kubectl.get("secret", "nginx-token", ns=ns)
    assert "ownerReferences" not in secret["metadata"] and kubectl.get("lu", ns=ns) == []
    assert kubectl.get("deployment", ns=ns) == [], "nothing of the job started on someone else's token"
    # Once the Secret is gone the job creates its own, then stops at the ConfigMap, which it leaves as it was.
    kubectl.run("delete", "secret", "nginx-token", "-n", ns)
    wait_for(lambda: blocked_by("ConfigMap", "nginx-config"), 60, "Ready=False naming the ConfigMap", 0.2)
    cm = kubectl.get("configmap", "nginx-config", ns=ns)
    assert cm["data"] == {"nginx.conf": "worker_processes 1;"} and "ownerReferences" not in cm["metadata"]
    kubectl.run("delete", "configmap", "nginx-config", "-n", ns)
    wait_job_ready(kubectl, ns, "nginx", 1, timeout=90)
    assert kubectl.get("configmap", "nginx-config", ns=ns)["metadata"]["ownerReferences"][0]["name"] == "nginx"
