"""Learner token epochs (issue 20, Medium 8): the operator gives each unit's token an epoch, retires it when the
unit is scaled away or deleted, and publishes the epochs in a ConfigMap the syncer mounts; a real syncer given
that file refuses the retired tokens with 403 and a reason, and takes the new unit's."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from diloco_operator.objects import builders as O
from diloco_operator.plan import jobplan
from diloco_trainer.protocol.tokens import learner_token

from polling import wait_for
from cluster_kit import PYTHONPATH
from test_operator_cluster import cpu_units, job, wait_job_ready


def view(name: str, epoch: int, deleting: bool = False) -> jobplan.UnitView:
    return jobplan.UnitView(name, "cpu", int(name[-1]), int(name[-1]), "Running", 1, 1, 0, False, deleting, {},
                            token_epoch=epoch)


def test_a_new_unit_takes_a_fresh_epoch_and_a_removed_one_is_marked_not_live():
    plan = jobplan.UnitsPlan(create={"j-cpu-1": None, "j-cpu-2": None}, delete=["j-cpu-3"])
    known = {"j-cpu-0": {"epoch": 1, "live": True}, "j-cpu-1": {"epoch": 4, "live": True},
             "j-cpu-3": {"epoch": 1, "live": True}}
    out, new = jobplan.token_epochs(known, [view("j-cpu-0", 1), view("j-cpu-3", 1)], plan)
    # j-cpu-1 is gone (deleted by hand) and comes back: epoch 5, and epoch 4's token is refused from now on.
    assert new == {"j-cpu-1": 5, "j-cpu-2": 1}
    assert out == {"j-cpu-0": {"epoch": 1, "live": True}, "j-cpu-1": {"epoch": 5, "live": True},
                   "j-cpu-2": {"epoch": 1, "live": True}, "j-cpu-3": {"epoch": 1, "live": False}}
    # A unit being deleted, and one from before epochs (epoch 0): retired all the same.
    out, new = jobplan.token_epochs({}, [view("j-cpu-0", 0, deleting=True)], jobplan.UnitsPlan())
    assert out == {"j-cpu-0": {"epoch": 0, "live": False}} and new == {}


def _epochs(kubectl, ns: str) -> dict:
    cm = kubectl.get("configmap", "ep-learner-epochs", ns=ns)
    return json.loads(cm["data"]["epochs.json"])["learners"] if cm else {}


def _token(kubectl, ns: str, unit: str, uid: str) -> str | None:
    secret = kubectl.get("secret", f"{unit}-learner-token", ns=ns)
    if not secret or secret["metadata"]["ownerReferences"][0]["uid"] != uid:
        return None
    return base64.b64decode(secret["data"]["token"]).decode()


def _register(url: str, token: str, learner: str) -> tuple[int, str | None]:
    req = urllib.request.Request(f"{url}/v1/register", method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        data=json.dumps({"learner_id": learner, "unit": 0, "world_size": 1, "device": "cpu"}).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.mark.cluster
def test_a_scaled_away_or_deleted_units_token_is_retired_and_its_successor_gets_a_new_one(kubectl, operator, ns,
                                                                                         tmp_path):
    tiny = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}, "outer": {"fragments": 2}}
    kubectl.apply(job("ep", cpu_units(2), config=tiny, syncer={"tls": {"mode": "Disabled"}}), "-n", ns)
    wait_job_ready(kubectl, ns, "ep", 2)
    units = {u: kubectl.get("lu", u, ns=ns) for u in ("ep-cpu-0", "ep-cpu-1")}
    assert {u: lu["metadata"]["annotations"][O.ANNOTATION_TOKEN_EPOCH] for u, lu in units.items()} == {
        "ep-cpu-0": "1", "ep-cpu-1": "1"}
    assert wait_for(lambda: _epochs(kubectl, ns) == {"ep-cpu-0": {"epoch": 1, "live": True},
                                                     "ep-cpu-1": {"epoch": 1, "live": True}}, 30, "the epochs", 0.2)
    job_token = base64.b64decode(kubectl.get("secret", "ep-token", ns=ns)["data"]["token"]).decode()
    old = {u: wait_for(lambda u=u: _token(kubectl, ns, u, lu["metadata"]["uid"]), 30, f"{u}'s token", 0.2)
           for u, lu in units.items()}
    assert old["ep-cpu-1"] == learner_token(job_token, "ep-cpu-1", 1)
    # The syncer pods mount that ConfigMap and read it (kwok runs no containers: a real syncer runs here on the
    # same file, refreshed as the kubelet refreshes a ConfigMap volume).
    pod = kubectl.get("deployment", "ep-syncer", ns=ns)["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--learner-epochs") + 1] == "/etc/diloco-epochs/epochs.json"
    assert {"name": "learner-epochs", "configMap": {"name": "ep-learner-epochs", "optional": True,
                                                     "defaultMode": 420}} in pod["volumes"]
    epochs_file = tmp_path / "epochs.json"

    def project() -> None:
        (tmp_path / "new.json").write_text(kubectl.get("configmap", "ep-learner-epochs", ns=ns)["data"]["epochs.json"])
        os.replace(tmp_path / "new.json", epochs_file)
    project()
    config = tmp_path / "config.yaml"
    config.write_text(kubectl.get("configmap", "ep-config", ns=ns)["data"]["config.yaml"])
    state = tmp_path / "state"
    syncer = subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
         "--port", "0", "--state-dir", str(state), "--learner-epochs", str(epochs_file)],
        env={**os.environ, "DILOCO_TOKEN": job_token, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for(lambda: (state / "endpoint.json").exists() and
                       json.loads((state / "endpoint.json").read_text())["url"], 60, "the syncer to listen", 0.2)
        assert _register(url, old["ep-cpu-1"], "ep-cpu-1") == (200, None)

        # Scaled away: its epoch is retired, and the syncer refuses its token.
        kubectl.run("scale", "dj", "ep", "-n", ns, "--replicas=1")
        wait_for(lambda: _epochs(kubectl, ns).get("ep-cpu-1") == {"epoch": 1, "live": False}, 30,
                 "ep-cpu-1's epoch retired", 0.2)
        project()
        assert _register(url, old["ep-cpu-1"], "ep-cpu-1") == (
            403, "the token of learner 'ep-cpu-1' (epoch 1) was retired: its unit was removed")
        assert _register(url, old["ep-cpu-0"], "ep-cpu-0") == (200, None)

        # Scaled back: a new ep-cpu-1 with epoch 2 and a token of its own; the old one stays refused.
        kubectl.run("scale", "dj", "ep", "-n", ns, "--replicas=2")
        wait_job_ready(kubectl, ns, "ep", 2)
        lu = kubectl.get("lu", "ep-cpu-1", ns=ns)
        assert lu["metadata"]["annotations"][O.ANNOTATION_TOKEN_EPOCH] == "2"
        new = wait_for(lambda: _token(kubectl, ns, "ep-cpu-1", lu["metadata"]["uid"]), 30, "the new token", 0.2)
        assert new == learner_token(job_token, "ep-cpu-1", 2) != old["ep-cpu-1"]
        assert _register(url, new, "ep-cpu-1") == (200, None)  # before the file says so: never waits on it
        wait_for(lambda: _epochs(kubectl, ns).get("ep-cpu-1") == {"epoch": 2, "live": True}, 30, "epoch 2", 0.2)
        project()
        assert _register(url, old["ep-cpu-1"], "ep-cpu-1")[0] == 403

        # A unit deleted by hand is put back by the job under a new epoch: the deleted one's token is refused.
        kubectl.run("delete", "lu", "ep-cpu-0", "-n", ns, "--wait=false")
        wait_for(lambda: _epochs(kubectl, ns).get("ep-cpu-0") == {"epoch": 2, "live": True}, 60,
                 "ep-cpu-0 back under epoch 2", 0.2)
        project()
        status, error = _register(url, old["ep-cpu-0"], "ep-cpu-0")
        assert status == 403 and error.endswith("its unit was replaced (current epoch 2)")
        assert _register(url, job_token, "ep-cpu-0") == (200, None)  # the job's own token is not a unit's
    finally:
        syncer.terminate()
        syncer.wait(timeout=30)
