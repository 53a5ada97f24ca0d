"""`diloco syncer` as a real process: port 0 discovery, /healthz and /metrics, kill -9, restart, nothing lost."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from diloco_trainer.protocol.wire import SubmissionMeta, decode_tensors, encode_submission, quantize
from polling import wait_for

pytestmark = pytest.mark.slow  # a real syncer process

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
TOKEN = "process-test-token"


def _http(method: str, url: str, data: bytes | None = None, auth: bool = True, json_body=None):
    headers = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
    if json_body is not None:
        data, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _start(config: Path, state_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    (state_dir / "endpoint.json").unlink(missing_ok=True)
    env = {**os.environ, "DILOCO_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(TRAINER), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
         "--port", "0", "--state-dir", str(state_dir), "--checkpoint-every-s", "3600", "--log-every-s", "0"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        endpoint = state_dir / "endpoint.json"
        if endpoint.exists():
            info = json.loads(endpoint.read_text())
            if info["pid"] == proc.pid:
                return proc, info["url"]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"syncer did not come up:\n{log.read_text()}")


def test_a_killed_syncer_process_restarts_with_the_acknowledged_submission_merged(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n  compression: int8\n  quorum: 1\n")
    state_dir, log = tmp_path / "state", tmp_path / "syncer.log"
    state_dir.mkdir()
    proc, url = _start(config, state_dir, log)
    try:
        assert _http("GET", f"{url}/healthz", auth=False) == (200, b"ok")
        status, metrics = _http("GET", f"{url}/metrics", auth=False)
        assert status == 200 and b'diloco_syncer_outer_steps_total{fragment="0"} 0.0' in metrics
        assert _http("GET", f"{url}/v1/versions", auth=False)[0] == 401

        status, reply = _http("POST", f"{url}/v1/register", json_body={"learner_id": "learner-0", "unit": 0,
                                                                       "world_size": 1, "device": "cpu"})
        assert status == 200
        names = json.loads(reply)["plan"]["0"]
        status, raw = _http("GET", f"{url}/v1/fragments/0")
        theta, meta = decode_tensors(raw)
        assert status == 200 and meta["version"] == "0" and set(theta) == set(names)
        g = torch.Generator().manual_seed(0)
        deltas = {n: torch.randn(theta[n].shape, generator=g) * 1e-2 for n in names}
        payload = encode_submission(SubmissionMeta("learner-0", "learner-0:f0:1", 0, 0, 16, 4096),
                                    {n: quantize(d, "int8", 64) for n, d in deltas.items()}, "int8", 64,
                                    {n: tuple(d.shape) for n, d in deltas.items()})
        status, reply = _http("POST", f"{url}/v1/fragments/0/outer-gradient", data=payload)
        assert status == 202 and json.loads(reply)["duplicate"] is False
        wait_for(lambda: json.loads(_http("GET", f"{url}/v1/versions")[1])["versions"]["0"] == 1, 60, "the merge", 0.05)
        proc.kill()  # SIGKILL: no final checkpoint
        proc.wait(timeout=30)
        assert not (state_dir / "checkpoint").exists()

        proc, url = _start(config, state_dir, log)

        def merged():
            s = json.loads(_http("GET", f"{url}/v1/status")[1])
            return s if s["pending"] == {"0": 0, "1": 0} and s["contributions_merged"] >= 1 else None

        s = wait_for(merged, 60, "the replayed submission to merge", 0.05)
        assert s["tokens_merged"] == 4096 and s["contributions_merged"] == 1
        assert s["learners"]["learner-0"]["submissions_merged"] == 1
        # The merge journal (journal.py) published version 1 again: a learner holding it loses nothing.
        assert s["versions"]["0"] == 1 and s["versions"]["1"] == 0
        status, reply = _http("POST", f"{url}/v1/fragments/0/outer-gradient", data=payload)
        assert status == 202 and json.loads(reply)["duplicate"] is True

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        state = json.loads((state_dir / "checkpoint" / "state.json").read_text())
        assert state["tokens_merged"] == 4096 and list(state["merged_ids"]) == ["learner-0:f0:1"]
        assert list((state_dir / "spool").glob("*.safetensors")) == []
        assert not (state_dir / "endpoint.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
