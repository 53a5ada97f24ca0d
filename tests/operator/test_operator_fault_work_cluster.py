"""Status shows a fault's cost (issue 19 item 5) on a real control plane: a unit's pod deleted, its LearnerUnit says
why, how long the unit took to run again, and the work its ended learner life took with it, in `kubectl get lu`,
the job's status and the operator's /metrics. The syncer is real (run here, kwok runs no containers); the test plays
the learner's two lives over its API: heartbeats, and outer gradients the syncer merges."""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.request

import pytest
import torch

from diloco_operator.api import conditions as C
from diloco_trainer.protocol.wire import SubmissionMeta, decode_tensors, encode_submission, quantize

from polling import wait_for
from test_operator_cluster import cpu_units, job, job_syncer, unit_pods, wait_job_ready  # helpers only

pytestmark = pytest.mark.cluster
UNIT = "lost-cpu-0"
PER_STEP = 256  # tokens a step, as the fake learner reports them


def table_row(header: str, row: str) -> dict[str, str]:
    """kubectl's table row by its header's column positions (an empty column, e.g. CLUSTER, splits no word)."""
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = zip(starts, starts[1:] + [None])
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def test_a_units_last_fault_shows_its_recovery_and_the_work_its_ended_learner_life_took_with_it(
        kubectl, operator, ns, tmp_path):
    tiny = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2},
            "outer": {"fragments": 2, "compression": "none"}}
    kubectl.apply(job("lost", cpu_units(1), config=tiny), "-n", ns)
    wait_job_ready(kubectl, ns, "lost", 1)
    syncer, state, token = job_syncer(kubectl, ns, "lost", tmp_path)
    life = {"incarnation": "aaaa", "step": 10, "tokens": 10 * PER_STEP}  # the first life: 10 steps trained
    stop, beating = threading.Event(), None
    try:
        url = wait_for(lambda: (state / "endpoint.json").exists() and
                       json.loads((state / "endpoint.json").read_text())["url"], 60, "the syncer to listen", 0.2)

        def call(path: str, body: dict | bytes | None = None):
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            req = urllib.request.Request(f"{url}{path}", method="GET" if body is None else "POST", data=data,
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10, context=ssl._create_unverified_context()) as resp:
                return resp.read()
        answer = json.loads(call("/v1/register", {"learner_id": UNIT, "unit": 0, "world_size": 1, "device": "cpu"}))

        def heartbeats():
            while not stop.is_set():
                call("/v1/heartbeat", {"learner_id": UNIT, "step_time_s": 0.5, **life})
                stop.wait(0.5)
        beating = threading.Thread(target=heartbeats, daemon=True)
        beating.start()
        # The first life's outer gradients of its first 6 steps reach the model, on both fragments; 4 steps do not.
        for p in range(len(answer["plan"])):
            theta, _ = decode_tensors(call(f"/v1/fragments/{p}"))
            meta = SubmissionMeta(UNIT, f"{UNIT}.aaaa.p{p}.v0", p, 0, 6, 6 * PER_STEP)
            parts = {n: quantize(torch.zeros_like(t), "none", 64) for n, t in theta.items()}
            call(f"/v1/fragments/{p}/outer-gradient",
                 encode_submission(meta, parts, "none", 64, {n: tuple(t.shape) for n, t in theta.items()}))
        wait_for(lambda: [w["steps_merged"] for w in json.loads(call("/v1/status"))["learners"][UNIT]["incarnations"]]
                 == [12], 30, "the first life's 6 steps merged on both fragments", 0.2)
        kubectl.run("annotate", "dj", "lost", "-n", ns, f"diloco.dev/syncer-url={url}")
        wait_for(lambda: kubectl.get("lu", UNIT, ns=ns)["status"].get("lastContribution"), 30,
                 "the operator to read the syncer", 0.2)

        (victim,) = unit_pods(kubectl, ns, UNIT)
        kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        fault = wait_for(lambda: kubectl.get("lu", UNIT, ns=ns)["status"].get("lastFault"), 60, "the fault", 0.2)
        # The next life starts after the fault (whole seconds in the status) and trains a step: the first life's
        # loss can now be told.
        fault_at = C.parse_time(fault["time"]).timestamp()
        wait_for(lambda: time.time() >= fault_at + 1.5, 5, "a second past the fault's time", 0.1)
        life.update(incarnation="bbbb", step=1, tokens=PER_STEP)
        seen: dict = {}

        def told():
            seen["unit"] = u = kubectl.get("lu", UNIT, ns=ns)
            fault_now = u["status"]["lastFault"]
            return fault_now.get("lostTokens") is not None and fault_now.get("recoverySeconds") is not None and u
        try:
            lu = wait_for(told, 90, "the fault's recovery and work lost in the unit's status", 0.2)
        except AssertionError as exc:  # say what the unit and the syncer showed instead
            raise AssertionError(f"{exc}\nunit status: {seen.get('unit', {}).get('status')}\nsyncer: "
                                 f"{json.loads(call('/v1/status'))['learners'].get(UNIT)}") from None
        fault = lu["status"]["lastFault"]
        assert fault["reason"] == "PodDeleted" and (fault["lostSteps"], fault["lostTokens"]) == (4, 4 * PER_STEP)
        assert 0 <= fault["recoverySeconds"] < 60
        assert 1.5 <= fault["trainingAgainSeconds"] < 60, "the next life was first heard of 1.5 s after the fault"
        header, row = kubectl.run("get", "lu", UNIT, "-n", ns).stdout.splitlines()
        columns = table_row(header, row)
        assert (columns["LAST-FAULT"], columns["LOST-TOKENS"]) == ("PodDeleted", str(4 * PER_STEP)), columns
        assert float(columns["RECOVERY"]) == fault["recoverySeconds"]
        dj = wait_for(lambda: (d := kubectl.get("dj", "lost", ns=ns))["status"].get("lastFault", {}).get(
            "lostTokens") is not None and d, 60, "the job's last fault with its work lost", 0.2)
        assert dj["status"]["lastFault"]["unit"] == UNIT and dj["status"]["lastFault"]["lostSteps"] == 4
        line = f'diloco_operator_job_last_fault_lost_tokens{{job="lost",namespace="{ns}"}} {float(4 * PER_STEP)}'
        wait_for(lambda: line in urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics",
                                                        timeout=5).read().decode(), 60, line, 0.5)
    finally:
        stop.set()
        if beating is not None:
            beating.join(timeout=15)
        syncer.terminate()
        syncer.wait(timeout=30)
