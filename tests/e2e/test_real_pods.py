"""A user's own model trains in real containers on a real kubelet: a Llama-style transformers model from an inline
config, a BPE tokenizer trained on local text and token shards made by `diloco data prepare`, on a data volume (a PVC)
that the operator mounts read-only into the learner and syncer pods. The job runs in a namespace under Pod Security
`restricted` and is reconciled by the namespaced install (an operator pod holding only its Role there): every
container runs as UID 10001 with no capability, no new privileges, a seccomp filter and a read-only root; the syncer
and learner pods talk over TLS with the certificate the operator issued (spec.syncer.tls Auto, the default); a killed
learner pod (deleted, or by spec.chaos) restarts its unit while the others train on; an evicted one (a drain) hands
over its unsent work and loses none, and so does a drain of the whole node (syncer and learners evicted at once),
after which the job trains again once the node is uncordoned; a node whose kubelet stops is lost, its units move to
new pods (force-deleted ones on the lost node) and train again once it is back; a SIGKILLed syncer is replaced
by the other container of its pod (spec.syncer.standby), which resumes from the checkpoint, spool and merge journal
on the PVC losing no acknowledged update; a real Prometheus on the host scrapes the pods where their prometheus.io
annotations say and has data for every query of the Grafana dashboard; given a step budget, the units finish it
and the job succeeds with a final model that beats the unigram baseline of its tokens, which `diloco export` turns
into a directory transformers loads and generates from; a spec only the syncer can refuse (more fragments than the
model has tensors) is reported without a crash loop; deleting the job removes everything it owned.

The tests run in file order on one job (each step builds on the one before, as a user's job would): one job serves
every check, so the e2e tier pays for one set of containers starting and training."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from polling import wait_for
from cluster_kit import KUBECTL
from dashboard_kit import wait_for_data_in_every_query
from prometheus_kit import Prometheus, annotated_pods, prometheus_binary
from diloco_devcluster import realnode
from diloco_operator.api import conditions as C
from diloco_trainer.syncer.takeover import read_incarnations
from e2e_kit import (SYNCER_PORT, container_id, container_of, job_namespace, learner_step, metric_of, pid_of,
                     process_of, pv_dir, supervised_learner, syncer_status)

pytestmark = [pytest.mark.e2e]

JOB = "e2e"
UNITS = 2
# The units train until the last test that needs them training has passed, however fast or slow the machine lets
# them: no step budget at first (as a user starts a run of unknown length), then the final test gives them one as a
# user ends such a run (spec.units[].steps: their pods restart with it, finish it and the job succeeds).
FINAL_STEPS = 16  # two rounds of the outer.sync_every=8 schedule in the incarnations that finish the job
RECOVERY_TIMES: list[float] = []  # pod kill -> replacement container training again, seconds
VOCAB = 384
MOUNT = "/data"
DATA_CLAIM = "tokens"
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_trainer.cli", *args], check=True, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """What a user brings: a BPE tokenizer trained on local text and the token shards prepared with it."""
    work = tmp_path_factory.mktemp("llama-data")
    text = work / "text"
    text.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "asyncio/base_events.py", "collections/__init__.py", "dataclasses.py", "enum.py",
                 "functools.py", "inspect.py", "pathlib.py", "subprocess.py", "typing.py"):
        src = stdlib / name
        shutil.copy(src, text / f"{src.parent.name}_{src.stem}.txt")
    out = work / "data"
    out.mkdir()
    diloco("data", "tokenizer", str(text), "--vocab", str(VOCAB), "--out", str(out / "tokenizer.json"))
    diloco("data", "prepare", str(text), "--tokenizer", str(out / "tokenizer.json"), "--out", str(out / "shards"),
           "--no-progress")
    return out


def job_manifest(image: str, name: str = JOB, fragments: int = 4, units: int = UNITS) -> dict:
    unit = {"name": "cpu", "count": units, "accelerator": {"type": "cpu"},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}},
            "stateVolume": {"size": "1Gi"}}
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoJob", "metadata": {"name": name},
        "spec": {
            "image": image, "imagePullPolicy": "IfNotPresent",
            "data": {"mountPath": MOUNT, "persistentVolumeClaim": {"claimName": DATA_CLAIM}},
            "config": {"model": {"hf": LLAMA, "seq_len": 64},
                       "data": {"source": "shards", "path": f"{MOUNT}/shards", "tokenizer": f"{MOUNT}/tokenizer.json"},
                       "inner": {"batch_size": 8, "lr": 0.003, "warmup_steps": 10},
                       "outer": {"fragments": fragments, "sync_every": 8, "overlap": 2, "compression": "int4",
                                 "quorum": 1, "grace": 0.5, "lr": 1.0, "momentum": 0.0}},
            # No nodeSelector: CPU units must land on the real CPU node, never on the fake GPU/TPU pools.
            "units": [unit],
            "syncer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}, "checkpoint": {"size": "1Gi"}},
            "restartPolicy": {"maxRestarts": 20, "backoffSeconds": 0, "maxBackoffSeconds": 5},
        },
    }


def data_claim(kubectl, data: Path) -> dict:
    """A claim bound up front to a free local volume of the real node, filled with the user's data (what copying a
    data set onto a PersistentVolume does)."""
    free = [pv for pv in kubectl.get("persistentvolumes")
            if pv["spec"].get("storageClassName") == realnode.STORAGE_CLASS and pv.get("status", {}).get("phase")
            == "Available" and not pv["spec"].get("claimRef")]
    assert free, "no free local PersistentVolume on the real node"
    pv = free[-1]
    target = Path(pv["spec"]["local"]["path"])
    shutil.copytree(data, target, dirs_exist_ok=True)
    for path in [target, *target.rglob("*")]:  # readable by the image's user (10001), writable by nobody but root
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": DATA_CLAIM},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": realnode.STORAGE_CLASS,
                     "volumeName": pv["metadata"]["name"], "resources": {"requests": {"storage": "1Gi"}}}}


class Job:
    """Reads of the job under test: its objects through the API, its syncer and learners over the pod network."""

    def __init__(self, kubectl, ns: str):
        self.kubectl, self.ns = kubectl, ns
        self._token: str | None = None

    def obj(self) -> dict:
        return self.kubectl.get("dj", JOB, ns=self.ns)

    def status(self) -> dict:
        return (self.obj() or {}).get("status") or {}

    def pods(self, component: str) -> list[dict]:
        pods = self.kubectl.get("pod", ns=self.ns, selector=f"diloco.dev/job={JOB},diloco.dev/component={component}")
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def running(self, component: str) -> list[dict]:
        """Pods of the component whose every container is running (a real container, started by the kubelet)."""
        return [p for p in self.pods(component) if p.get("status", {}).get("phase") == "Running"
                and all("running" in (c.get("state") or {}) for c in p["status"].get("containerStatuses", []))]

    def unit_pod(self, unit: str) -> dict | None:
        pods = [p for p in self.running("learner") if p["metadata"]["labels"]["diloco.dev/unit"] == unit]
        return pods[0] if pods else None

    def token(self) -> str:
        if self._token is None:
            secret = self.kubectl.get("secret", f"{JOB}-token", ns=self.ns)
            self._token = base64.b64decode(secret["data"]["token"]).decode()
        return self._token

    def ca(self) -> str:
        """The CA the operator issued for the syncer (what the learners mount)."""
        return self.kubectl.get("configmap", f"{JOB}-syncer-ca", ns=self.ns)["data"]["ca.crt"]

    def syncer_status(self) -> dict | None:
        """The syncer's /v1/status, straight from its pod over TLS verified against the job's CA under the
        Service's name (None while it is not answering)."""
        pods = self.running("syncer")
        return syncer_status(pods[0] if pods else None, f"{JOB}-syncer", self.ca(), self.token())

    def outer_steps(self) -> int:
        return (self.syncer_status() or {}).get("outer_steps", -1)

    def pv_dir(self, claim: str) -> Path:
        return pv_dir(self.kubectl, self.ns, claim)


def wait_outer_steps_advance(job: Job, by: int, timeout: float, what: str) -> int:
    start = job.outer_steps()
    wait_for(lambda: job.outer_steps() >= start + by, timeout, f"{what} ({by} outer steps after {start})", 1.0)
    return job.outer_steps()


def kill_and_time_recovery(job: Job, unit: str, kill) -> float:
    """Kill a unit's pod with `kill(pod)`; wait for the unit's next incarnation to train (its step >= 1) while
    the global model keeps advancing; returns the seconds from kill to training again."""
    victim = job.unit_pod(unit)
    assert victim is not None, f"unit {unit} has no running pod"
    incarnation = int(victim["metadata"]["labels"]["diloco.dev/incarnation"])
    before = job.outer_steps()
    killed_at = time.monotonic()
    kill(victim)

    def training_again():
        pod = job.unit_pod(unit)
        if pod is None or int(pod["metadata"]["labels"]["diloco.dev/incarnation"]) <= incarnation:
            return None
        step = learner_step(pod)
        return step is not None and step >= 1
    wait_for(training_again, 180, f"unit {unit} training again after its pod was killed", 0.25)
    recovery = time.monotonic() - killed_at
    RECOVERY_TIMES.append(recovery)
    print(f"[e2e] {unit}: killed -> a new container training again in {recovery:.1f}s", file=sys.stderr)
    # The other units never stopped: the global model advanced meanwhile or advances now.
    wait_for(lambda: job.outer_steps() > before, 60, "outer steps advancing across the kill", 1.0)
    return recovery


@pytest.fixture(scope="module")
def job(kubectl, operator_pod, images, data) -> Job:
    with job_namespace(kubectl, "e2e", data_claim(kubectl, data), job_manifest(images.trainer)) as ns:
        yield Job(kubectl, ns)


def test_the_syncer_and_every_learner_run_as_real_containers_and_outer_steps_advance(job, kubectl):
    wait_for(lambda: len(job.running("syncer")) == 1 and len(job.running("learner")) == UNITS, 300,
             f"the syncer and {UNITS} learner containers running", 1.0)
    for pod in job.running("learner") + job.running("syncer"):
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME, f"{pod['metadata']['name']} not on the real node"
        assert pod["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
        # The user's data volume, read-only in every container that reads the model, tokenizer or tokens.
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "data")
        assert volume["persistentVolumeClaim"] == {"claimName": DATA_CLAIM, "readOnly": True}
        for container in pod["spec"]["containers"]:
            mount = next(m for m in container["volumeMounts"] if m["name"] == "data")
            assert mount["mountPath"] == MOUNT and mount["readOnly"] is True
    # Every learner reached the syncer through its Service name (cluster DNS + kube-proxy) and trains.
    wait_for(lambda: all((learner_step(p) or 0) >= 1 for p in job.running("learner")), 240, "every learner training", 1.0)
    wait_outer_steps_advance(job, 8, 240, "merges from real learner pods")
    # The operator reads the same progress from the syncer into the job's status.
    wait_for(lambda: job.status().get("outerSteps", 0) > 0, 60, "status.outerSteps from the syncer", 1.0)
    assert job.status().get("phase") == "Running"


def test_every_container_runs_restricted_in_a_restricted_namespace_under_an_operator_with_only_its_role(
        job, kubectl, operator_pod, images):
    # The job's namespace enforces Pod Security `restricted`: the pods above were admitted under it, an unhardened
    # pod is refused.
    labels = kubectl.get("namespaces", job.ns)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
    bare = kubectl.run("run", "bare", f"--image={images.trainer}", "--restart=Never", "-n", job.ns,
                       "--dry-run=server", check=False)
    assert bare.returncode != 0 and "violates PodSecurity" in bare.stderr, bare
    # What the kernel says of every real container (the standby's, the operator's too): the image's user, no new
    # privileges, a seccomp filter, no capability, a read-only root with /tmp writable.
    pods = job.running("syncer") + job.running("learner") + [operator_pod.pod()]
    for pod in pods:
        for status in pod["status"]["containerStatuses"]:
            proc = process_of(status["containerID"].split("://", 1)[1])
            where = f"{pod['metadata']['name']}/{status['name']}"
            assert proc["Uid"].split() == ["10001"] * 4 and proc["Gid"].split()[0] == "10001", (where, proc["Uid"])
            assert proc["NoNewPrivs"] == "1" and proc["Seccomp"] == "2", (where, proc["NoNewPrivs"], proc["Seccomp"])
            assert int(proc["CapEff"], 16) == int(proc["CapPrm"], 16) == 0, (where, proc["CapEff"])
            assert "ro" in proc["mount /"].split(",") and "rw" in proc["mount /tmp"].split(","), where
    # The operator is the namespaced install: its ServiceAccount, the job namespaces only, no cluster-wide right.
    op = operator_pod.pod()
    command = op["spec"]["containers"][0]["command"]
    assert op["spec"]["serviceAccountName"] == "diloco-operator"
    assert f"--namespace={job.ns}" in command and "--no-watch-nodes" in command, command
    user = f"system:serviceaccount:{op['metadata']['namespace']}:diloco-operator"

    def can(*args: str) -> bool:
        return kubectl.run("auth", "can-i", *args, f"--as={user}", check=False).stdout.strip() == "yes"
    assert can("create", "pods", "-n", job.ns) and can("get", "secrets", "-n", job.ns)
    for args in (["list", "pods", "-A"], ["get", "secrets", "-n", "default"], ["list", "nodes"],
                 ["create", "clusterrolebindings"]):
        assert not can(*args), f"the operator may {' '.join(args)}"


def test_learners_train_over_tls_with_the_operators_certificate_and_their_own_tokens(job, kubectl):
    link = next(c for c in job.status()["conditions"] if c["type"] == "LinkEncrypted")
    assert link["status"] == "True" and link["reason"] == "AutoCertificate", link
    for pod in job.running("learner"):  # they trained above: over https, verifying the job's CA
        container = pod["spec"]["containers"][0]
        command = container["command"]
        assert command[command.index("--syncer") + 1] == f"https://{JOB}-syncer:{SYNCER_PORT}"
        assert command[command.index("--ca") + 1] == "/etc/diloco/ca/ca.crt"
        unit = pod["metadata"]["labels"]["diloco.dev/unit"]
        assert command[command.index("--token-file") + 1] == "/etc/diloco-token/token"
        token_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "token")["secret"]
        assert token_volume["secretName"] == f"{unit}-learner-token" and token_volume["defaultMode"] == 0o440
    # Every real container holds its token as a read-only file of mode 0440 in the image's group (the pods'
    # fsGroup), and nowhere in its environment: the unit's own token in a learner, the job's in the syncer.
    for pod in job.running("learner") + job.running("syncer"):
        unit = pod["metadata"]["labels"].get("diloco.dev/unit")
        secret = kubectl.get("secret", f"{unit}-learner-token" if unit else f"{JOB}-token", ns=job.ns)
        for status in pod["status"]["containerStatuses"]:  # the syncer's standby too
            proc = Path("/proc") / pid_of(status["containerID"].split("://", 1)[1])
            where = f"{pod['metadata']['name']}/{status['name']}"
            assert not [e for e in (proc / "environ").read_bytes().split(b"\0") if b"TOKEN=" in e], where
            token_file = proc / "root" / "etc" / "diloco-token" / "token"
            st = token_file.stat()
            assert (st.st_mode & 0o777, st.st_gid) == (0o440, 10001), (where, oct(st.st_mode), st.st_gid)
            assert token_file.read_text() == base64.b64decode(secret["data"]["token"]).decode(), where
    syncer = job.running("syncer")[0]
    assert syncer["spec"]["containers"][0]["command"][-4:] == ["--tls-cert", "/etc/diloco/tls/tls.crt",
                                                               "--tls-key", "/etc/diloco/tls/tls.key"]
    ip = syncer["status"]["podIP"]
    # The syncer speaks only TLS: plain HTTP gets no answer, and a client trusting only the system's CAs refuses it.
    try:
        urllib.request.urlopen(f"http://{ip}:{SYNCER_PORT}/healthz", timeout=5)
        raise AssertionError("the syncer answered plain HTTP")
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError):
        pass
    try:
        urllib.request.urlopen(f"https://{ip}:{SYNCER_PORT}/healthz", timeout=5)
        raise AssertionError("the syncer's certificate passed without the job's CA")
    except urllib.error.URLError as exc:
        assert "CERTIFICATE_VERIFY_FAILED" in str(exc), exc
    assert job.syncer_status() is not None  # verified against the CA under the Service's name


IN_PLACE_KILLS = 3


def test_a_sigkilled_learner_process_trains_again_in_its_pod_from_a_warm_spare_without_a_container_restart(
        job, kubectl):
    """The learner container's entrypoint (`diloco pod-learner`) restarts its killed learner process in place from a
    warm spare: the same pod and container (restartCount 0, no CrashLoopBackOff), training again in seconds."""
    unit = f"{JOB}-cpu-0"
    pod = wait_for(lambda: job.unit_pod(unit), 300, f"unit {unit}'s pod running", 1.0)
    recovery = []
    for kill in range(1, IN_PLACE_KILLS + 1):
        found = wait_for(lambda: (lambda s: s if s and s[1] else None)(supervised_learner(pod)), 240,
                         f"unit {unit}'s learner with a warm spare beside it (kill {kill})", 0.5)
        wait_for(lambda: (learner_step(pod) or 0) >= 1, 240, f"unit {unit} training (kill {kill})", 0.5)
        killed_at = time.monotonic()
        os.kill(found[0], signal.SIGKILL)
        try:
            wait_for(lambda: metric_of(pod, "diloco_learner_process_restarts_total") == kill
                     and (learner_step(pod) or 0) >= 1, 120, f"unit {unit} training again after kill {kill}", 0.1)
        except AssertionError as exc:
            now = kubectl.get("pod", pod["metadata"]["name"], ns=job.ns)
            logs = kubectl.run("logs", "-n", job.ns, pod["metadata"]["name"], "--tail=60", check=False)
            raise AssertionError(f"{exc}\npod status: {json.dumps((now or {}).get('status'))[:3000]}\n"
                                 f"logs:\n{logs.stdout[-6000:]}{logs.stderr[-1000:]}") from None
        recovery.append(time.monotonic() - killed_at)
    now = kubectl.get("pod", pod["metadata"]["name"], ns=job.ns)
    assert now["metadata"]["uid"] == pod["metadata"]["uid"]
    assert now["status"]["containerStatuses"][0]["restartCount"] == 0
    assert kubectl.get("lu", unit, ns=job.ns)["status"].get("restarts", 0) == 0
    logs = kubectl.run("logs", "-n", job.ns, pod["metadata"]["name"]).stdout
    assert logs.count("restarted in place") == IN_PLACE_KILLS and "warm spare" in logs, logs[-3000:]
    print(f"[e2e] {unit}: learner process SIGKILLed -> training again in its pod in "
          f"{', '.join(f'{t:.1f}' for t in recovery)} s (median {statistics.median(recovery):.1f} s)", file=sys.stderr)


def test_a_deleted_learner_pod_restarts_its_unit_while_the_others_keep_training(job, kubectl):
    unit = f"{JOB}-cpu-0"
    kill_and_time_recovery(job, unit, lambda pod: kubectl.run("delete", "pod", "-n", job.ns,
                                                              pod["metadata"]["name"], "--wait=false"))
    lu = kubectl.get("lu", unit, ns=job.ns)
    assert lu["status"]["restarts"] >= 1
    assert len(job.running("learner")) == UNITS


def test_a_learner_killed_by_spec_chaos_restarts_its_unit(job, kubectl):
    def via_chaos(_pod):
        kubectl.run("patch", "dj", JOB, "-n", job.ns, "--type=merge", "-p", json.dumps({"spec": {"chaos": {
            "schedule": {"every": "5s"}, "target": {"kind": "learner", "units": [1]},
            "action": {"type": "kill"}, "safety": {"minAliveUnits": 1, "maxFaults": 1, "maxDuration": "10m"}}}}))
    # spec.chaos may hit only unit index 1, once.
    unit = f"{JOB}-cpu-1"
    kill_and_time_recovery(job, unit, via_chaos)
    events = kubectl.get("events", ns=job.ns)
    assert any(e["reason"] == "ChaosPodKilled" for e in events), "no ChaosPodKilled event"


def test_an_evicted_learner_hands_over_its_unsent_work_exits_0_and_its_unit_shows_no_work_lost(job, kubectl):
    """`kubectl drain`'s way out for one pod (the Eviction API: a graceful delete, as a spot reclaim's is): the
    learner finishes its step, sends every step it trained that no acknowledged outer gradient covers, exits 0
    within its grace period, and its unit's lastFault says the fault lost no work (issue 19 items 3 and 5)."""
    unit = f"{JOB}-cpu-0"
    victim = wait_for(lambda: job.unit_pod(unit), 300, f"unit {unit}'s pod running", 1.0)
    wait_for(lambda: (learner_step(victim) or 0) >= 1, 300, f"unit {unit} training", 0.5)
    name = victim["metadata"]["name"]
    grace = victim["spec"]["terminationGracePeriodSeconds"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": job.ns}}
    evicted_at = time.monotonic()
    kubectl.run("create", "--raw", f"/api/v1/namespaces/{job.ns}/pods/{name}/eviction", "-f", "-",
                input=json.dumps(eviction))

    def ended():  # the container's end as the kubelet reports it, or the pod gone (deleted once it ended)
        pod = kubectl.get("pod", name, ns=job.ns)
        if pod is None:
            return {"gone": True}
        states = [(c.get("state") or {}).get("terminated") for c in pod["status"].get("containerStatuses", [])]
        return states[0] if states and states[0] else None
    end = wait_for(ended, grace + 30, f"the evicted pod {name} to stop", 0.2)
    stopped_s = time.monotonic() - evicted_at
    if "gone" not in end:
        assert end["exitCode"] == 0, end
    print(f"[e2e] {unit}: evicted -> container {'exit ' + str(end.get('exitCode')) if 'gone' not in end else 'gone'}"
          f" after {stopped_s:.1f}s (grace {grace}s)", file=sys.stderr)
    assert stopped_s < grace, f"the learner used its whole grace period ({stopped_s:.1f} s)"
    # Its unit had a fault before (the pod deleted above): the figures must be this fault's, not that one's.
    def last_fault():
        return (kubectl.get("lu", unit, ns=job.ns)["status"].get("lastFault") or {})
    first = wait_for(lambda: (f := last_fault()).get("lostTokens") is not None and f, 240,
                     f"unit {unit}'s last fault with the work it lost", 1.0)
    # The figures are recomputed while they move: a resend of work on a fragment the others moved on waits (as a
    # rider, at most 1.5 sync periods) for that fragment's next merge, and is lost work until then.
    fault = wait_for(lambda: (f := last_fault()) and (f["lostSteps"], f["lostTokens"]) == (0, 0) and f, 60,
                     f"unit {unit}'s last fault to show no work lost (first read: {first})", 1.0)
    print(f"[e2e] {unit}: last fault {fault['reason']}, recovery {fault.get('recoverySeconds')}s, "
          f"lost {first['lostSteps']} steps / {first['lostTokens']} tokens at first read, then 0 / 0",
          file=sys.stderr)
    assert fault["incarnation"] == int(victim["metadata"]["labels"]["diloco.dev/incarnation"]) + 1, fault
    assert fault.get("recoveredAt", fault["time"]) >= fault["time"], fault  # ISO times, whole seconds


def test_a_sigkilled_syncer_resumes_from_its_checkpoint_losing_no_acknowledged_update(job, kubectl):
    wait_for(lambda: (job.syncer_status() or {}).get("last_checkpoint"), 90, "a first checkpoint", 1.0)
    before = job.syncer_status()
    pod = job.running("syncer")[0]
    state_dir = job.pv_dir(f"{JOB}-checkpoint")
    served = read_incarnations(state_dir)
    serving = container_of(served[-1])
    subprocess.run(["ctr", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", container_id(pod, serving)], check=True)
    # The other container of the pod (spec.syncer.standby) takes over from the checkpoint, spool and merge journal
    # on the PVC; the kubelet restarts the dead one in place, which then waits as the next standby.
    after = wait_for(job.syncer_status, 120, "the syncer answering again", 0.5)
    wait_for(lambda: any(c.get("restartCount", 0) >= 1 for p in job.running("syncer")
                         for c in p["status"]["containerStatuses"]), 120, "the killed container restarted", 0.5)
    (same,) = job.running("syncer")
    assert same["metadata"]["uid"] == pod["metadata"]["uid"], "the pod was replaced, not healed in place"
    took_over = read_incarnations(state_dir)[len(served)]
    assert container_of(took_over) != serving, f"{serving} served again: the pod's other container did not take over"
    print(f"[e2e] the serving {serving} container SIGKILLed -> the {container_of(took_over)} container serving "
          f"{took_over['takeover_s']:.2f} s after the lock (state load {took_over['load_s']:.2f} s)", file=sys.stderr)
    for p, version in before["versions"].items():
        assert after["versions"][p] >= version, f"fragment {p} went back from version {version}"
    assert after["tokens_merged"] >= before["tokens_merged"]
    for lid, info in before["learners"].items():
        assert after["learners"][lid]["tokens_merged"] >= info["tokens_merged"], f"{lid} lost merged tokens"
    wait_outer_steps_advance(job, 4, 120, "merges after the syncer restart")


def test_a_real_prometheus_scrapes_the_pods_where_their_annotations_say_and_every_dashboard_query_has_data(
        job, kubectl, operator_pod, tmp_path):
    # After the faults above (two learner kills, a syncer SIGKILL): Prometheus on the host scrapes the job's and the
    # operator's pods where their prometheus.io annotations say (the syncer over https), as the usual kubernetes-pods
    # scrape job would (the targets read from the API: Debian's prometheus has no Kubernetes discovery), and each
    # query of the Grafana dashboard must return data.
    pods = kubectl.get("pod", ns=job.ns) + [operator_pod.pod()]
    scrapes = annotated_pods("pods", [p for p in pods if p.get("status", {}).get("phase") == "Running"])
    with Prometheus(prometheus_binary(), tmp_path / "prometheus", scrapes) as prom:
        def scraped(component: str) -> list[dict]:
            return [t for t in prom.targets() if t["health"] == "up" and component in (
                t["labels"].get("diloco_dev_component"), t["labels"].get("app_kubernetes_io_name"))]
        wait_for(lambda: scraped("learner") and scraped("syncer") and scraped("diloco-operator"), 120,
                 "prometheus scraping the syncer, the learners and the operator", 1.0)
        assert all(t["scrapeUrl"].startswith("https://") for t in scraped("syncer")), scraped("syncer")
        wait_for_data_in_every_query(prom.query, 60)
        (restarts,) = prom.query(f'diloco_operator_unit_restarts_total{{exported_namespace="{job.ns}"}}')
        assert float(restarts["value"][1]) >= 2  # the two learner kills above
        assert prom.query('diloco_syncer_standby == 1'), "the syncer's standby took over: its gauge says so"


def test_a_drained_node_stops_the_job_cleanly_and_it_trains_again_once_the_node_is_back(job, kubectl):
    """`kubectl drain` of the real node (cordon, then the Eviction API for every pod of the job: the syncer and the
    learners at once, as a node upgrade or the reclaim of a whole spot node does): every learner stops cleanly within
    its grace period (its last metrics record is its final one), the syncer writes its final checkpoint, and while the
    node is cordoned nothing of the job runs (this cluster has no other real node to move to). Uncordoned, the job
    trains again from where it was; the next test checks that every token an incarnation saw acknowledged, those
    drained here included, is in the final model (issue 19 item 3)."""
    pods = job.running("learner") + job.running("syncer")
    assert len(pods) == UNITS + 1, [p["metadata"]["name"] for p in pods]
    before = job.outer_steps()
    drained_at = time.monotonic()
    out = subprocess.run([KUBECTL, "drain", realnode.NODE_NAME, f"--pod-selector=diloco.dev/job={JOB}",
                          "--delete-emptydir-data", "--ignore-daemonsets", "--timeout=240s"],
                         env=kubectl.env, capture_output=True, text=True, timeout=300)
    try:
        assert out.returncode == 0, out.stderr
        drain_s = time.monotonic() - drained_at
        for i in range(UNITS):
            unit = f"{JOB}-cpu-{i}"
            last = incarnations(job.pv_dir(f"{unit}-state-0") / "metrics.jsonl")[-1][-1]
            assert last.get("final"), f"{unit}'s drained learner did not stop cleanly: {last}"
        assert job.running("learner") == [] and job.running("syncer") == [], "the job runs on a cordoned node"
    finally:
        kubectl.run("uncordon", realnode.NODE_NAME)
    uncordoned = time.monotonic()
    wait_for(lambda: len(job.running("syncer")) == 1 and len(job.running("learner")) == UNITS and all(
        (learner_step(p) or 0) >= 1 for p in job.running("learner")), 300, "the job training again", 1.0)
    again_s = time.monotonic() - uncordoned
    after = wait_outer_steps_advance(job, 1, 180, "merges after the drain")
    print(f"[e2e] drain of {realnode.NODE_NAME}: the job's {len(pods)} pods evicted and gone in {drain_s:.1f}s; "
          f"uncordoned -> every learner training again in {again_s:.1f}s; outer steps {before} -> {after}",
          file=sys.stderr)
    assert after >= before, "the drained syncer's checkpoint lost merges"


def node_ready(kubectl) -> str:
    ready = C.get_condition(kubectl.get("nodes", realnode.NODE_NAME)["status"].get("conditions"), C.READY) or {}
    return ready.get("status", "Unknown")


def test_a_node_whose_kubelet_stops_is_lost_its_units_are_replaced_and_the_job_trains_again_once_it_is_back(
        job, kubectl, cluster):
    """The real node's kubelet stops (as `systemctl stop kubelet`, a hung or partitioned node does): its containers go
    on running, but nothing reports for them. The controller-manager marks the node not Ready after its grace period
    (60 s in this testbed) and taints it; the job's pods tolerate that for failurePolicy.nodeLostSeconds and are then
    evicted by the taint manager (each unit restarts as EvictedByTaint, not its failure), which no kubelet confirms;
    nodeLostSeconds past their grace period the operator force-deletes them (this namespaced operator has no right to
    read Nodes: the unconfirmed deletion is its sign of a lost node), with NodeLost on the unit's status and an Event
    (issue 19 item 2). There is no other real
    node here, so the new pods wait until the kubelet is back; it then stops the containers of the deleted pods, the
    new ones start and the job trains again. The final test checks that no acknowledged work was lost."""
    assert node_ready(kubectl) == "True"
    wait_for(lambda: len(job.running("learner")) == UNITS and all((learner_step(p) or 0) >= 1
             for p in job.running("learner")), 300, "every learner training before the kubelet stops", 1.0)
    old = {f"{JOB}-cpu-{i}": job.unit_pod(f"{JOB}-cpu-{i}") for i in range(UNITS)}
    old_uids = {p["metadata"]["uid"] for p in old.values()}
    lost_s = job.obj()["spec"].get("failurePolicy", {}).get("nodeLostSeconds", 20)
    (syncer,) = job.running("syncer")  # asked directly while the kubelet is down (its pod is then being deleted)
    before = job.outer_steps()
    stopped = time.monotonic()
    cluster.stop_process("kubelet")
    try:
        wait_for(lambda: node_ready(kubectl) != "True", 180, "the node not Ready after its kubelet stopped", 1.0)
        not_ready = time.monotonic()

        def replaced():  # every unit on a new incarnation: its old pod force-deleted, the new one waiting for a node
            for unit, pod in old.items():
                if kubectl.get("pod", pod["metadata"]["name"], ns=job.ns) is not None:
                    return False
                lu = kubectl.get("lu", unit, ns=job.ns)["status"]
                if lu.get("incarnation", 0) <= int(pod["metadata"]["labels"]["diloco.dev/incarnation"]):
                    return False
                if not C.is_true(lu.get("conditions"), C.NODE_LOST):  # written just after the force-delete
                    return False
            return True
        grace = max(p["spec"]["terminationGracePeriodSeconds"] for p in old.values())
        wait_for(replaced, lost_s + grace + lost_s + 60, "the lost node's learner pods force-deleted and replaced", 1.0)
        replaced_s = time.monotonic() - not_ready
        for unit in old:
            lu = kubectl.get("lu", unit, ns=job.ns)["status"]
            lost = C.get_condition(lu.get("conditions"), C.NODE_LOST) or {}
            assert lost.get("status") == "True" and lost.get("reason") == C.Reason.NODE_LOST, lu
            # This operator may not read Nodes: the taint manager's eviction (the pod's DisruptionTarget condition) is
            # what it saw first, and a restart that is not the unit's failure.
            assert (lu.get("lastFault") or {}).get("reason") == C.Reason.EVICTED_BY_TAINT, lu
            assert lu.get("consecutiveFailures", 0) == 0, lu
        events = [e for e in kubectl.get("events", ns=job.ns) if e["reason"] == C.Reason.NODE_LOST]
        assert {e["involvedObject"]["name"] for e in events} >= set(old), events
        # Nothing stalls meanwhile: the containers of the lost node still run (a partitioned node's would) and merge.
        during = (syncer_status(syncer, f"{JOB}-syncer", job.ca(), job.token()) or {}).get("outer_steps", -1)
        assert during > before, f"outer steps {before} -> {during} while the kubelet was down"
    finally:
        cluster.start_process("kubelet")
    restarted = time.monotonic()
    wait_for(lambda: node_ready(kubectl) == "True", 180, "the node Ready again", 1.0)
    wait_for(lambda: not (old_uids & running_pod_uids()), 120, "the deleted pods' containers stopped", 1.0)
    wait_for(lambda: len(job.running("syncer")) == 1 and len(job.running("learner")) == UNITS and all(
        (learner_step(p) or 0) >= 1 for p in job.running("learner")), 300, "the job training again", 1.0)
    again_s = time.monotonic() - restarted
    after = wait_outer_steps_advance(job, 1, 180, "merges after the kubelet is back")
    for unit in old:
        lost = C.get_condition(kubectl.get("lu", unit, ns=job.ns)["status"]["conditions"], C.NODE_LOST)
        assert lost["status"] == "False" and lost["reason"] == C.Reason.RUNNING_ELSEWHERE, lost
    print(f"[e2e] kubelet of {realnode.NODE_NAME} stopped -> node not Ready after {not_ready - stopped:.1f}s -> "
          f"both learner pods force-deleted and replaced {replaced_s:.1f}s later (nodeLostSeconds {lost_s}, grace "
          f"{grace}s); outer steps {before} -> {during} while it was down; kubelet back -> training again in "
          f"{again_s:.1f}s, outer steps {after}", file=sys.stderr)


def incarnations(metrics_jsonl: Path) -> list[list[dict]]:
    """A learner's metrics records split by incarnation (its step counts from 0 again after each restart)."""
    runs: list[list[dict]] = []
    for line in metrics_jsonl.read_text().splitlines():
        rec = json.loads(line)
        if not runs or rec["step"] < runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(rec)
    return runs


@pytest.mark.timeout(1500)  # its own waits: up to 1200 s for the job, 120 s for the syncer to go, then evaluation
def test_the_job_succeeds_and_its_final_model_beats_the_unigram_baseline_and_exports_to_transformers(
        job, kubectl, data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diloco_trainer.config import TrainConfig
    from diloco_trainer.data.corpus import unigram_loss
    from diloco_trainer.data.source import open_tokens
    from diloco_trainer.runtime import report
    from diloco_trainer.syncer.store import Spool, read_checkpoint

    # The user ends the run: a step budget for its units. Their pods restart with it (each learner hands over its
    # unsent work on the way out, as on any graceful stop), train it to the end, and the job succeeds.
    assert job.status().get("phase") == "Running", job.status()
    kubectl.run("patch", "dj", JOB, "-n", job.ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/units/0/steps", "value": FINAL_STEPS}]))
    wait_for(lambda: job.status().get("phase") in ("Succeeded", "Failed"), 1200, "the job finishing", 2.0)
    assert job.status()["phase"] == "Succeeded", job.status()
    # A finished job's syncer is scaled to zero: it wrote its final checkpoint to the PVC on SIGTERM.
    wait_for(lambda: not job.pods("syncer"), 120, "the syncer pod gone after the job finished", 1.0)
    state_dir = job.pv_dir(f"{JOB}-checkpoint")  # its --state-dir: checkpoint/ and spool/
    ckpt = read_checkpoint(state_dir)
    assert ckpt is not None, "no checkpoint in the syncer's PVC"
    cfg = TrainConfig.model_validate(ckpt.state["config"])
    assert cfg.model.hf is not None and cfg.model.hf.model_type == "llama"
    # The same tokens, read here from the user's copy instead of the pods' mount.
    here = cfg.data.model_copy(update={"path": str(data / "shards"), "tokenizer": str(data / "tokenizer.json")})
    tokens = open_tokens(here, VOCAB)
    val = tokens.sample("val", 200_000)
    val_loss = report.evaluate_theta(cfg, ckpt.theta, val, 8, cfg.inner.batch_size)
    unigram = unigram_loss(tokens.sample("train", 2_000_000), val)
    print(f"[e2e] final validation loss {val_loss:.3f} vs unigram {unigram:.3f}; pod kill -> training again: "
          f"median {statistics.median(RECOVERY_TIMES):.1f}s of {[round(t, 1) for t in RECOVERY_TIMES]}",
          file=sys.stderr)
    assert val_loss < unigram
    # No acknowledged update lost: every token a learner incarnation saw acknowledged is in the final model.
    # Incarnations that stopped gracefully logged their final count; a killed one may have had more acked
    # after its last record, so the syncer's count is at least the sum.
    merged = ckpt.state["learners"]
    # For a failure's message only: spool entries whose ids the checkpoint does not list as merged (the syncer's
    # next start would replay them; the spool also keeps merged entries until a second checkpoint covers them).
    spooled: dict[str, int] = {}
    for entry in Spool(state_dir / "spool").load_all():
        if entry.meta["submission_id"] not in ckpt.state["merged_ids"]:
            spooled[entry.meta["learner_id"]] = spooled.get(entry.meta["learner_id"], 0) + entry.meta["c_tokens"]
    for i in range(UNITS):
        unit = f"{JOB}-cpu-{i}"
        runs = incarnations(job.pv_dir(f"{unit}-state-0") / "metrics.jsonl")
        acked = sum(run[-1]["acked_tokens"] for run in runs)
        assert runs[-1][-1].get("final"), f"{unit}'s last incarnation did not finish cleanly"
        assert runs[-1][-1]["step"] == FINAL_STEPS, f"{unit}'s last incarnation trained {runs[-1][-1]['step']} steps"
        assert merged[unit]["tokens_merged"] >= acked > 0, (unit, merged[unit], acked, "spooled:", spooled)
    # The final model leaves as a directory transformers loads, with the tokenizer, and generates from.
    out = tmp_path / "llama-hf"
    diloco("export", str(state_dir), str(out), "--format", "hf", "--tokenizer", str(data / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("def main(", return_tensors="pt")
    with torch.no_grad():
        # At least 16 tokens: a trained model may emit its end-of-text token early, which would end greedy decoding.
        generated = model.generate(**prompt, min_new_tokens=16, max_new_tokens=16, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 16
    text = tokenizer.decode(generated[0])
    print(f"[e2e] generated: {text!r}", file=sys.stderr)
    assert text.startswith("def main(")


def test_a_spec_that_only_its_syncer_can_refuse_is_reported_without_a_crash_loop(job):
    # Only building the model counts its tensors (2 layers: 21); the CRD admits the job, the syncer refuses it (exit
    # 2, reason in the termination message the kubelet keeps), the operator reports it and stops the syncer.
    manifest = job_manifest(job.kubectl.get("dj", JOB, ns=job.ns)["spec"]["image"], "too-split", fragments=64, units=1)
    del manifest["spec"]["units"][0]["stateVolume"]
    job.kubectl.apply(manifest, "-n", job.ns)
    try:
        def refused():
            dj = job.kubectl.get("dj", "too-split", ns=job.ns) or {}
            ready = next((c for c in (dj.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), {})
            return ready if ready.get("reason") == "InvalidSpec" else None
        ready = wait_for(refused, 300, "the refused job Ready=False/InvalidSpec", 1.0)
        assert ready["message"].startswith("spec.config.outer.fragments (64) must not exceed the model's"), ready
        wait_for(lambda: job.kubectl.get("deployment", "too-split-syncer", ns=job.ns)["spec"]["replicas"] == 0
                 and not job.kubectl.get("pod", ns=job.ns, selector="diloco.dev/job=too-split,diloco.dev/component=syncer"),
                 120, "the refused syncer scaled to zero and gone", 1.0)
    finally:
        job.kubectl.run("delete", "dj", "too-split", "-n", job.ns, "--wait=false", check=False)


def test_deleting_the_job_removes_every_owned_object_and_container(job, kubectl):
    pod_uids = {p["metadata"]["uid"] for p in kubectl.get("pod", ns=job.ns, selector=f"diloco.dev/job={JOB}")}
    left: dict[str, list[str]] = {}

    def all_gone():
        for kind in ("lu", "pod", "deployment", "services", "configmap", "secret", "pvc"):
            left[kind] = [o["metadata"]["name"] for o in kubectl.get(kind, ns=job.ns, selector=f"diloco.dev/job={JOB}")]
        return not any(left.values())
    all_gone()
    assert all(left[k] for k in ("lu", "deployment", "services", "configmap", "secret", "pvc")), left
    kubectl.run("delete", "dj", JOB, "-n", job.ns, "--wait=false")
    try:
        wait_for(all_gone, 120, "every object of the job deleted", 1.0)
    except BaseException:
        print(f"[e2e] left after deleting the job: {left}", file=sys.stderr)
        raise
    # ... and their containers: nothing of the job's pods still runs in containerd.
    wait_for(lambda: not (pod_uids & running_pod_uids()), 60, "the job's containers gone from the node", 1.0)


def running_pod_uids() -> set[str]:
    """UIDs of the pods whose containers (or sandboxes) containerd runs for the kubelet."""
    uids = set()
    for task in realnode.running_tasks():
        info = subprocess.run(["ctr", "-n", "k8s.io", "containers", "info", task], capture_output=True, text=True)
        try:
            uids.add(json.loads(info.stdout)["Labels"].get("io.kubernetes.pod.uid", ""))
        except (ValueError, KeyError):
            continue
    return uids


def test_the_operator_pod_stayed_live_under_its_probe_and_counted_its_work(operator_pod):
    pod = operator_pod.pod()
    container = pod["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["spec"]["serviceAccountName"] == "diloco-operator"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, operator_pod.logs()
    metrics = operator_pod.metrics()
    assert 'diloco_operator_reconciles_total{kind="job",result="ok"}' in metrics, metrics[:2000]
