"""Learner tokens carry an epoch (the unit's incarnation of its id) that the operator retires when the unit is
removed or replaced: a real `diloco syncer` process, reading the operator's epochs file as it changes, refuses a
retired token with 403 and the reason, and accepts a new unit's token before the file has caught up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from diloco_trainer.protocol.tokens import learner_token, token_identity, token_learner
from diloco_trainer.syncer.epochs import Epoch, parse_epochs, refusal
from polling import wait_for

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
TOKEN = "epoch-test-token"


def test_a_token_names_its_learner_and_epoch_and_both_are_signed():
    token = learner_token(TOKEN, "demo-cpu-1", 3)
    assert token.startswith("demo-cpu-1.e3.") and token_identity(TOKEN, token) == ("demo-cpu-1", 3)
    assert token_identity(TOKEN, token.replace(".e3.", ".e4.")) is None  # the epoch is signed
    assert token_identity("other-job", token) is None
    # Epoch 0 is the token from before epochs, unchanged; a dotted id still parses either way.
    assert learner_token(TOKEN, "a.e5") == f"a.e5.{learner_token(TOKEN, 'a.e5').rsplit('.', 1)[1]}"
    assert token_identity(TOKEN, learner_token(TOKEN, "a.e5")) == ("a.e5", 0)
    assert token_identity(TOKEN, learner_token(TOKEN, "a.e5", 2)) == ("a.e5", 2)
    assert token_learner(TOKEN, token) == "demo-cpu-1"
    with pytest.raises(ValueError, match="epoch"):
        learner_token(TOKEN, "x", -1)


def test_only_a_removed_or_replaced_units_epoch_is_refused():
    known = parse_epochs(json.dumps({"learners": {"u0": {"epoch": 2, "live": True},
                                                  "u1": {"epoch": 1, "live": False}}}))
    assert known == {"u0": Epoch(2, True), "u1": Epoch(1, False)}
    assert refusal(known, "u0", 2) is None and refusal(known, "u0", 3) is None  # a newer unit the file lags behind
    assert refusal(known, "u0", 1) == "the token of learner 'u0' (epoch 1) was retired: its unit was replaced " \
                                      "(current epoch 2)"
    assert refusal(known, "u1", 1) == "the token of learner 'u1' (epoch 1) was retired: its unit was removed"
    assert refusal(known, "u1", 0) is not None and refusal(known, "u1", 2) is None
    assert refusal(known, "never-seen", 0) is None
    with pytest.raises(ValueError, match="learners\\['u'\\]"):
        parse_epochs('{"learners": {"u": {"epoch": "1", "live": true}}}')


def _register(url: str, token: str, learner: str) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/register", method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        data=json.dumps({"learner_id": learner, "unit": 0, "world_size": 1, "device": "cpu"}).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _publish(path: Path, learners: dict) -> None:
    """Replace the file the way a ConfigMap volume does: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(json.dumps({"learners": learners}))
    os.replace(tmp, path)


@pytest.mark.slow
def test_a_real_syncer_refuses_a_retired_learner_token_as_soon_as_the_epochs_file_says_so(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n")
    epochs, state = tmp_path / "epochs.json", tmp_path / "state"
    _publish(epochs, {"job-cpu-0": {"epoch": 1, "live": True}, "job-cpu-1": {"epoch": 1, "live": True}})
    env = {**os.environ, "DILOCO_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(TRAINER), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config),
                             "--host", "127.0.0.1", "--port", "0", "--state-dir", str(state),
                             "--learner-epochs", str(epochs)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = state / "endpoint.json"
        url = wait_for(lambda: endpoint.exists() and json.loads(endpoint.read_text())["url"], 120,
                       "the syncer to listen", 0.1)
        old = learner_token(TOKEN, "job-cpu-1", 1)
        assert _register(url, old, "job-cpu-1")[0] == 200
        # Unit 1 is scaled away: the operator marks its epoch retired; the running syncer reads that at once.
        _publish(epochs, {"job-cpu-0": {"epoch": 1, "live": True}, "job-cpu-1": {"epoch": 1, "live": False}})
        assert _register(url, old, "job-cpu-1") == (
            403, {"error": "the token of learner 'job-cpu-1' (epoch 1) was retired: its unit was removed"})
        # A new unit of that name gets epoch 2: accepted before the file says so, and the old token stays refused.
        new = learner_token(TOKEN, "job-cpu-1", 2)
        assert _register(url, new, "job-cpu-1")[0] == 200
        _publish(epochs, {"job-cpu-0": {"epoch": 1, "live": True}, "job-cpu-1": {"epoch": 2, "live": True}})
        status, answer = _register(url, old, "job-cpu-1")
        assert status == 403 and "replaced (current epoch 2)" in answer["error"]
        assert _register(url, new, "job-cpu-1")[0] == 200
        # The token from before epochs (epoch 0) of a unit the file knows is older than its epoch: refused too.
        assert _register(url, learner_token(TOKEN, "job-cpu-0"), "job-cpu-0")[0] == 403
        # Others are untouched; the job's own token acts as anyone; a broken file keeps the last good contents.
        assert _register(url, learner_token(TOKEN, "job-cpu-0", 1), "job-cpu-0")[0] == 200
        assert _register(url, TOKEN, "job-cpu-1")[0] == 200
        epochs.write_text("{not json")
        assert _register(url, old, "job-cpu-1")[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
