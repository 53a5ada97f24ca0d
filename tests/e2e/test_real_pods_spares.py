"""Warm spare pods on a real kubelet (spec.units[].spares): a spare pod starts, imports torch and transformers and
waits; when its unit's learner pod is deleted, the operator relabels the spare as the unit's pod and annotates it
with the unit's sealed identity, the kubelet rewrites the spare's downward-API file, and the spare trains as that
learner (likewise when the pod's container is SIGKILLed and the pod fails), in the same container (no new container, no image pull, no import), while the deleted pod hands over its
unsent work; a new spare follows. Measured: pod deleted -> the unit's learner training again (a transformers Llama).

The tests run in file order on one job."""

from __future__ import annotations

import base64
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polling import wait_for
from e2e_kit import container_id, job_namespace, learner_step, pid_of, syncer_status

pytestmark = [pytest.mark.e2e]

JOB, UNIT, SPARE = "warm", "warm-cpu-0", "diloco.dev/spare"
KILLS = 4  # deleted, container SIGKILLed, deleted, SIGKILLed
TAKEOVER_TIMES: list[float] = []
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def job_manifest(image: str) -> dict:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoJob", "metadata": {"name": JOB},
        "spec": {
            "image": image, "imagePullPolicy": "IfNotPresent",
            # The Llama of test_real_pods.py (transformers), on the standard library's bytes (no data volume).
            "config": {"model": {"hf": LLAMA, "seq_len": 64},
                       "data": {"max_bytes": 200000}, "inner": {"batch_size": 8, "warmup_steps": 5},
                       "outer": {"fragments": 2, "sync_every": 8, "overlap": 2, "compression": "int4",
                                 "quorum": 1, "grace": 0.5}},
            "units": [{"name": "cpu", "count": 1, "spares": 1, "accelerator": {"type": "cpu"},
                       "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}}],
            "syncer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}, "checkpoint": {"size": "1Gi"}},
            # A long backoff: a unit that waited for it (no spare) would show here as a 30 s recovery.
            "restartPolicy": {"maxRestarts": 20, "backoffSeconds": 30, "maxBackoffSeconds": 60},
        },
    }


class SpareJob:
    def __init__(self, kubectl, ns: str):
        self.kubectl, self.ns = kubectl, ns
        self._token = self._ca = None

    def _running(self, selector: str) -> list[dict]:
        return [p for p in self.kubectl.get("pod", ns=self.ns, selector=selector)
                if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") == "Running"
                and all("running" in (c.get("state") or {}) for c in p["status"].get("containerStatuses", []))]

    def unit_pod(self) -> dict | None:
        pods = self._running(f"diloco.dev/unit={UNIT}")
        return pods[0] if len(pods) == 1 else None

    def spares(self) -> list[dict]:
        return self._running(f"diloco.dev/job={JOB},{SPARE}=waiting")

    def syncer_status(self) -> dict | None:
        if self._token is None:
            self._token = base64.b64decode(self.kubectl.get("secret", f"{JOB}-token", ns=self.ns)["data"]["token"]
                                           ).decode()
            self._ca = self.kubectl.get("configmap", f"{JOB}-syncer-ca", ns=self.ns)["data"]["ca.crt"]
        pods = self._running(f"diloco.dev/job={JOB},diloco.dev/component=syncer")
        return syncer_status(pods[0] if pods else None, f"{JOB}-syncer", self._ca, self._token, 2.0)

    def merged(self) -> int:
        return ((self.syncer_status() or {}).get("learners", {}).get(UNIT) or {}).get("tokens_merged", 0)


def warm(pod: dict) -> bool:
    """Whether a spare pod's warm learner process has imported and warmed up (it said ready in its spares dir)."""
    try:
        root = Path("/proc") / pid_of(container_id(pod, "learner")) / "root" / "tmp"
        return any(root.glob("diloco-pod-learner-*/spares/spare-*/ready"))
    except (OSError, StopIteration, KeyError):
        return False


@pytest.fixture(scope="module")
def job(kubectl, operator_pod, images) -> SpareJob:
    with job_namespace(kubectl, "e2e-spares", job_manifest(images.trainer)) as ns:
        yield SpareJob(kubectl, ns)


def test_a_warm_spare_pod_waits_beside_the_training_unit(job, kubectl):
    wait_for(lambda: (pod := job.unit_pod()) and (learner_step(pod) or 0) >= 1, 300, f"{UNIT} training", 1.0)
    (spare,) = wait_for(lambda: job.spares() or None, 120, "a running spare pod", 1.0)
    wait_for(lambda: warm(spare), 180, "the spare's learner process warm", 0.5)
    assert learner_step(spare) is None, "a spare trains nothing (it serves no learner metrics)"
    log = kubectl.run("logs", "-n", job.ns, spare["metadata"]["name"]).stdout
    assert "waiting for an assignment" in log, log


def test_a_deleted_or_sigkilled_learner_pods_unit_trains_again_on_the_warm_spare_in_seconds_losing_no_acknowledged_work(
        job, kubectl):
    """Deleted (graceful: the pod drains its unsent work meanwhile), then its container SIGKILLed (the pod fails:
    restartPolicy Never; the operator acts on the container's terminated state, before the kubelet moves the phase),
    and each once more."""
    for kill in range(KILLS):
        victim = wait_for(job.unit_pod, 120, f"{UNIT}'s pod before kill {kill + 1}", 0.5)
        (spare,) = wait_for(lambda: [p for p in job.spares() if warm(p)] or None, 240,
                            f"a warm spare before kill {kill + 1}", 0.5)
        wait_for(lambda: job.merged() > 0, 180, f"some of {UNIT}'s work merged", 1.0)
        acked = (job.syncer_status() or {})["learners"][UNIT]["tokens_merged"]
        how = "container SIGKILLed" if kill % 2 else "pod deleted"
        killed_at = time.monotonic()
        if kill % 2:
            subprocess.run(["ctr", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", container_id(victim, "learner")],
                           check=True)
        else:
            kubectl.run("delete", "pod", "-n", job.ns, victim["metadata"]["name"], "--wait=false")

        def training_on_the_spare():
            pod = job.unit_pod()
            return (pod is not None and pod["metadata"]["uid"] == spare["metadata"]["uid"]
                    and (learner_step(pod) or 0) >= 1)
        wait_for(training_on_the_spare, 120, f"{UNIT} training on spare {spare['metadata']['name']}", 0.1)
        TAKEOVER_TIMES.append(time.monotonic() - killed_at)
        print(f"[e2e] {UNIT}: {how} -> training again on the warm spare pod in {TAKEOVER_TIMES[-1]:.2f}s",
              file=sys.stderr)
        pod = job.unit_pod()
        assert pod["status"]["containerStatuses"][0].get("restartCount", 0) == 0, "the same container, not a new one"
        # The deleted pod handed over its unsent work: what the syncer had merged of the unit only grows.
        wait_for(lambda: job.merged() >= acked, 120, f"{UNIT}'s merged tokens >= {acked} after the takeover", 1.0)
    lu = kubectl.get("lu", UNIT, ns=job.ns)
    assert lu["status"]["restarts"] == KILLS
    print(f"[e2e] pod deleted or its container SIGKILLed -> training on a warm spare pod: median {statistics.median(TAKEOVER_TIMES):.2f}s, "
          f"all {[round(t, 2) for t in TAKEOVER_TIMES]}", file=sys.stderr)
    # And a new spare is there again.
    wait_for(lambda: job.spares() or None, 120, "a new spare pod", 1.0)
