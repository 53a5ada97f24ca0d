"""Warm spare pods (spec.units[].spares) on the local control plane: the job keeps its template's spares; a deleted
learner pod's unit takes one over at once (no backoff, no new pod to start) by one patch that relabels it as the
unit's pod and hands it the unit's token sealed for that pod alone; a new spare follows; spares built from an old
template are replaced; the unit of a lost node takes over a spare on another node. kwok runs no containers: what the spare process does with its assignment is the trainer
tests' (tests/trainer/test_pod_learner.py) and the e2e tier's."""

from __future__ import annotations

import base64
import json
import statistics
import time

import pytest

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import spares as S
from diloco_trainer.protocol.assignment import ANNOTATION, decode_key, unseal
from diloco_trainer.protocol.tokens import learner_token

from polling import wait_for
from test_operator_autoscale_cluster import POOL, nodes  # noqa: F401 (a fixture)
from test_operator_cluster import cpu_units, events, job, running, unit_pods, wait_events, wait_job_ready
from test_operator_node_loss_cluster import CPU_NODE, SLACK_S, lose

pytestmark = pytest.mark.cluster
SPARE = "diloco.dev/spare"


def spares(kubectl, ns: str, name: str) -> list[dict]:
    return [p for p in kubectl.get("pods", ns=ns, selector=f"diloco.dev/job={name},{SPARE}=waiting")
            if not p["metadata"].get("deletionTimestamp")]


def secret_text(kubectl, ns: str, name: str, key: str) -> str:
    return base64.b64decode(kubectl.get("secret", name, ns=ns)["data"][key]).decode()


def test_a_deleted_pods_unit_takes_over_a_warm_spare_at_once_and_a_new_spare_follows(kubectl, operator, ns):
    # A 30 s backoff: a unit that waited for it, or for a new pod, would miss the 10 s below.
    manifest = job("warm", cpu_units(2, spares=1))
    manifest["spec"]["restartPolicy"] = {"backoffSeconds": 30, "maxRestarts": 20}
    kubectl.apply(manifest, "-n", ns)
    wait_job_ready(kubectl, ns, "warm", 2)
    (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "warm") if running(p)] or None, 60, "a running spare")
    assert spare["metadata"]["ownerReferences"][0]["kind"] == "DilocoJob"
    wait_for(lambda: kubectl.get("dj", "warm", ns=ns)["status"].get("sparesWaiting") == 1, 30,
             "the job's status.sparesWaiting 1 (kubectl get dj -o wide: Spares)")
    command = spare["spec"]["containers"][0]["command"]
    assert "--assignment-file" in command and "--learner-id" not in command and "--token-file" not in command
    assert all(v["name"] != "token" for v in spare["spec"]["volumes"]), "a spare mounts no unit's token"
    key = decode_key(secret_text(kubectl, ns, "warm-spare-key", "key"))
    job_token = secret_text(kubectl, ns, "warm-token", "token")

    times = []
    for kill in range(2):
        (victim,) = [p for p in unit_pods(kubectl, ns, "warm-cpu-1") if not p["metadata"].get("deletionTimestamp")]
        (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "warm") if running(p)] or None, 60,
                            f"a running spare before kill {kill + 1}")
        started = time.monotonic()
        kubectl.testbed.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")

        def taken_over():
            pods = [p for p in unit_pods(kubectl, ns, "warm-cpu-1") if p["metadata"]["uid"] == spare["metadata"]["uid"]]
            return pods[0] if pods else None
        took = wait_for(taken_over, 20, f"spare {spare['metadata']['name']} taking over warm-cpu-1", 0.05)
        times.append(time.monotonic() - started)
        labels = took["metadata"]["labels"]
        assert SPARE not in labels and labels["diloco.dev/incarnation"] == str(kill + 1)
        owner = took["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("LearnerUnit", "warm-cpu-1")
        lu = kubectl.get("lu", "warm-cpu-1", ns=ns)
        got = unseal(key, took["metadata"]["name"], took["metadata"]["annotations"][ANNOTATION])
        epoch = int(lu["metadata"]["annotations"]["diloco.dev/token-epoch"])
        assert (got.learner_id, got.unit, got.token) == ("warm-cpu-1", 1, learner_token(job_token, "warm-cpu-1", epoch))
        with pytest.raises(ValueError):  # sealed for that pod alone: the same text on another pod does not open
            unseal(key, "another-pod", took["metadata"]["annotations"][ANNOTATION])
        # A new spare follows, and the unit runs on the one it took (restart counted, no backoff waited).
        wait_for(lambda: [p for p in spares(kubectl, ns, "warm") if running(p)
                          and p["metadata"]["uid"] != spare["metadata"]["uid"]] or None, 30, "a new spare")
        lu = wait_for(lambda: (lu := kubectl.get("lu", "warm-cpu-1", ns=ns))["status"].get("phase") == "Running"
                      and lu["status"].get("restarts") == kill + 1 and lu, 30, "the unit Running again")
        assert lu["status"]["lastFault"]["incarnation"] == kill + 1
    assert len(unit_pods(kubectl, ns, "warm-cpu-0")) == 1, "the other unit untouched"
    assert any("warm spare pod takes over" in e.get("message", "") for e in events(kubectl, ns, "PodDeleted"))
    print(f"\npod deleted -> a spare is the unit's pod: median {statistics.median(times):.2f}s, "
          f"all {[round(t, 2) for t in times]}")

    # A changed template (a new image): the spares built from the old one are replaced.
    old = {p["metadata"]["uid"] for p in spares(kubectl, ns, "warm")}
    kubectl.run("patch", "dj", "warm", "-n", ns, "--type=merge", "-p", '{"spec": {"image": "diloco-trainer:v2"}}')
    new = wait_for(lambda: [p for p in spares(kubectl, ns, "warm")
                            if p["metadata"]["uid"] not in old and running(p)] or None, 60, "a spare of the new image")
    assert new[0]["spec"]["containers"][0]["image"] == "diloco-trainer:v2"
    wait_for(lambda: not [p for p in kubectl.get("pods", ns=ns, selector=f"diloco.dev/job=warm,{SPARE}=waiting")
                          if p["metadata"]["uid"] in old], 60, "the old spare gone")

    # Spares off: none kept.
    kubectl.run("patch", "dj", "warm", "-n", ns, "--type=json", "-p",
                '[{"op": "replace", "path": "/spec/units/0/spares", "value": 0}]')
    wait_for(lambda: not kubectl.get("pods", ns=ns, selector=f"diloco.dev/job=warm,{SPARE}=waiting"), 60,
             "no spare left")
    wait_for(lambda: "sparesWaiting" not in kubectl.get("dj", "warm", ns=ns)["status"], 30,
             "no sparesWaiting in the status of a job that keeps none")


def test_the_unit_of_a_lost_node_takes_over_a_spare_on_another_node_once_the_node_counts_as_lost(
        kubectl, operator, ns, nodes):
    """Two kwok nodes with room for one pod each: the unit on one, its spare on the other. The unit's node dies (kwok
    no longer answers for it, Ready=Unknown): nodeLostSeconds later the unit's pod is force-deleted and the spare on
    the healthy node is the unit's pod; a spare on a node that is not Ready is never taken (the new one has no room
    and waits, Pending)."""
    pool = f"{ns}-spare"
    nodes.add("spare", 2, CPU_NODE, {}, taints=())
    units = [{"name": "cpu", "count": 1, "spares": 1, "nodeSelector": {POOL: pool},
              "resources": {"requests": {"cpu": "3"}}}]
    kubectl.apply(job("far", units, restartPolicy={"backoffSeconds": 120, "maxRestarts": 20}), "-n", ns)
    (pod,) = wait_for(lambda: [p for p in unit_pods(kubectl, ns, "far-cpu-0") if running(p)] or None, 60,
                      "the unit running", 0.2)
    (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "far") if running(p)] or None, 60,
                        "its spare running", 0.2)
    assert spare["spec"]["nodeName"] != pod["spec"]["nodeName"], "one pod per node"
    lose(kubectl, pod["spec"]["nodeName"])
    started = time.monotonic()
    lost_s = api.NODE_LOST_SECONDS

    def on_the_spare():
        now = unit_pods(kubectl, ns, "far-cpu-0")
        return now if [p["metadata"]["uid"] for p in now] == [spare["metadata"]["uid"]] else None
    wait_for(on_the_spare, lost_s + SLACK_S, f"far-cpu-0 on its spare within {lost_s}+{SLACK_S}s of NotReady", 0.1)
    took = time.monotonic() - started
    print(f"\nnode NotReady -> its unit on a warm spare on another node: {took:.1f}s (nodeLostSeconds {lost_s})")
    assert took >= lost_s - 1, "not before the node had been lost for nodeLostSeconds"
    # The status follows the pods at the unit's next reconcile: until then it may still say Running on the lost node.
    wait_for(lambda: (st := kubectl.get("lu", "far-cpu-0", ns=ns)["status"]).get("phase") == "Running"
             and st.get("nodes") == [spare["spec"]["nodeName"]] and st.get("restarts") == 1, 10,
             f"the unit Running again on {spare['spec']['nodeName']}, one restart counted", 0.2)
    assert "warm spare pod takes over" in " ".join(e.get("message", "") for e in events(kubectl, ns, C.Reason.NODE_LOST))


def test_two_units_losing_their_pods_at_once_share_one_spare_and_the_other_gets_a_new_pod(kubectl, operator, ns):
    """One spare, two pods deleted in the same instant: exactly one unit takes the spare (the takeover patch is
    conditional on the spare's resourceVersion, so a second taker gets 409 and creates a pod instead, or sees no free
    spare and restarts as before); both units run again, and the spare is replaced."""
    manifest = job("race", cpu_units(3, spares=1))
    manifest["spec"]["restartPolicy"] = {"backoffSeconds": 0, "maxRestarts": 20}
    kubectl.apply(manifest, "-n", ns)
    wait_job_ready(kubectl, ns, "race", 3)
    (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "race") if running(p)] or None, 60, "a running spare")
    victims = {u: unit_pods(kubectl, ns, u)[0]["metadata"]["uid"] for u in ("race-cpu-0", "race-cpu-1")}
    for unit in victims:
        name = unit_pods(kubectl, ns, unit)[0]["metadata"]["name"]
        kubectl.testbed.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")

    def both_back():
        now = {u: [p for p in unit_pods(kubectl, ns, u) if p["metadata"]["uid"] != victims[u]] for u in victims}
        return now if all(len(ps) == 1 and running(ps[0]) for ps in now.values()) else None
    now = wait_for(both_back, 30, "both units running on a new pod", 0.1)
    took = [u for u, (p,) in now.items() if p["metadata"]["uid"] == spare["metadata"]["uid"]]
    assert len(took) == 1, f"exactly one unit takes the one spare: {took}"
    wait_for(lambda: [p for p in spares(kubectl, ns, "race") if running(p)] or None, 30, "a new spare")
    assert len(unit_pods(kubectl, ns, "race-cpu-2")) == 1


def test_a_unit_whose_pod_cannot_be_placed_takes_the_place_of_the_spare_that_holds_it(kubectl, operator, ns, nodes):
    """Tried as a new user would (issue 40): the warm spare was placed first on a node with room for one learner,
    and the unit's pod stayed Pending (Insufficient cpu) while the spare ran. Here the node has room for one
    learner; the spare runs there; a unit of its template is added and its pod cannot be placed: the spare becomes
    that unit's pod (the same pod, no restart counted), and the new spare behind it waits for room, holding none."""
    (node,) = nodes.add("full", 1, {"cpu": "4", "memory": "16Gi", "pods": "110"}, {}, taints=())
    template = {"name": "cpu", "count": 0, "spares": 1, "nodeSelector": {POOL: f"{ns}-full"},
                "resources": {"requests": {"cpu": "3"}}}
    base = {**cpu_units(1)[0], "name": "base"}  # a unit elsewhere: the quorum of 1 needs one
    kubectl.apply(job("place", [base, template]), "-n", ns)
    (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "place") if running(p)] or None, 60,
                        "the spare running on the node")
    assert spare["spec"]["nodeName"] == node
    kubectl.run("patch", "dj", "place", "-n", ns, "--type=json", "-p",
                json.dumps([{"op": "replace", "path": "/spec/units/1/count", "value": 1}]))
    unit = "place-cpu-0"

    def the_spare_as_the_units_pod() -> dict | None:
        pods = unit_pods(kubectl, ns, unit)
        return pods[0] if len(pods) == 1 and pods[0]["metadata"]["uid"] == spare["metadata"]["uid"] else None
    took = wait_for(the_spare_as_the_units_pod, 60, f"the spare as unit {unit}'s pod")
    assert took["spec"]["nodeName"] == node and running(took)
    (placed,) = wait_events(kubectl, ns, C.Reason.SPARE_TOOK_PLACE)
    assert "Insufficient cpu" in placed["message"] and unit in placed["involvedObject"]["name"], placed
    lu = wait_for(lambda: (u := kubectl.get("lu", unit, ns=ns)) and (u.get("status") or {}).get("phase") == "Running"
                  and u, 30, f"{unit} Running")
    assert lu["status"]["incarnation"] == 1 and not lu["status"].get("restarts"), lu["status"]
    # The spare the job keeps behind it waits for room on the full node: it holds nothing.
    (behind,) = wait_for(lambda: spares(kubectl, ns, "place") or None, 30, "a new spare")
    assert behind["metadata"]["uid"] != spare["metadata"]["uid"] and not behind["spec"].get("nodeName")


def test_pods_that_only_carry_a_units_or_a_spares_labels_are_neither_deleted_nor_taken(kubectl, operator, ns):
    """Issue 38, Low 7: a pod author in the namespace labels pods as a unit's (an old incarnation, which the
    operator deletes when it is the unit's) and as a waiting spare of the job (which the operator would count,
    delete beyond the count, or hand a unit's sealed assignment). Only the controller ownerReference makes a pod
    the unit's or the job's: both stand untouched through a restart that takes a spare, and the real spare is the
    one taken."""
    kubectl.apply(job("own", cpu_units(1, spares=1)), "-n", ns)
    wait_job_ready(kubectl, ns, "own", 1)
    (spare,) = wait_for(lambda: [p for p in spares(kubectl, ns, "own") if running(p)] or None, 60, "a running spare")
    (victim,) = unit_pods(kubectl, ns, "own-cpu-0")
    labels = victim["metadata"]["labels"]
    container = {"name": "learner", "image": "diloco-trainer:test"}
    stale = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "own-cpu-0-impostor", "labels": {**labels, "diloco.dev/incarnation": "7"}},
        "spec": {"nodeName": spare["spec"]["nodeName"], "containers": [container]}}
    fake_spare = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "own-cpu-spare-impostor", "labels": spare["metadata"]["labels"],
        "annotations": {S.ANNOTATION_SPARE_HASH: spare["metadata"]["annotations"][S.ANNOTATION_SPARE_HASH]}},
        "spec": {"nodeName": spare["spec"]["nodeName"], "containers": [container]}}
    made = {p["metadata"]["name"]: kubectl.testbed.create(f"/api/v1/namespaces/{ns}/pods", p)
            for p in (stale, fake_spare)}
    wait_for(lambda: all((p := kubectl.get("pod", n, ns=ns)) is not None and running(p) for n in made), 30,
             "the impostor pods running (not deleted)")

    kubectl.testbed.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")
    took = wait_for(lambda: (ps := unit_pods(kubectl, ns, "own-cpu-0")) and [
        p for p in ps if p["metadata"]["labels"].get("diloco.dev/incarnation") == "1" and running(p)], 60,
        "the unit's incarnation 1 running")
    assert [p["metadata"]["uid"] for p in took] == [spare["metadata"]["uid"]], "the job's own spare is taken"
    wait_for(lambda: kubectl.get("dj", "own", ns=ns)["status"].get("sparesWaiting") == 1, 60,
             "a new spare of the job's own waiting (the impostor not counted)")
    for name, created in made.items():
        now = kubectl.get("pod", name, ns=ns)
        assert now is not None and not now["metadata"].get("deletionTimestamp"), f"{name} was deleted"
        assert now["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"] or \
            now["metadata"]["labels"] == created["metadata"]["labels"], f"{name} was relabelled: {now['metadata']}"
