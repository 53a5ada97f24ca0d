"""Lost nodes (spec.failurePolicy.nodeLostSeconds), the pure part: when a node counts as lost, which pods go, how the
unit restarts, and the tolerations every pod carries. On the cluster: test_operator_node_loss_cluster.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects
from diloco_operator.plan import nodeloss, unitplan

pytestmark = pytest.mark.fast
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}


def job_spec(**kw) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu", "count": 1}], **kw})


def unit(pods: int = 1, max_restarts: int = 2, lost_s: int | None = None) -> tuple[api.LearnerUnitSpec, dict]:
    spec = job_spec(restartPolicy={"backoffSeconds": 10, "maxRestarts": max_restarts},
                    **({"failurePolicy": {"nodeLostSeconds": lost_s}} if lost_s else {}))
    uspec = objects.unit_spec("demo", spec, api.UnitTemplate(name="cpu", podsPerUnit=pods), 0, 0)
    return uspec, uspec.model_dump(mode="json", exclude_none=True)


def node(name: str, status: str = "True", since: datetime = T0, reason: str = "KubeletReady") -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "MemoryPressure", "status": "False", "lastTransitionTime": C.now_iso(T0 - timedelta(days=1))},
        {"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": C.now_iso(since)}]}}


def pod(rank: int, node_name: str, inc: int = 0, h: str | None = None, **kw) -> unitplan.PodView:
    return unitplan.PodView(name=f"demo-cpu-0-{inc}-{rank}", incarnation=inc, rank=rank,
                            phase=kw.pop("phase", "Running"), ready=kw.pop("ready", True), node=node_name,
                            spec_hash=h, **kw)


RUNNING = {"incarnation": 0, "launchedIncarnation": 0, "phase": "Running", "restarts": 0, "consecutiveFailures": 0}


# --- when a node is lost ------------------------------------------------------------------------------------------
def test_a_ready_node_is_not_down_and_a_not_ready_one_counts_from_its_transition():
    assert nodeloss.not_ready(node("a"), T0) is None
    down = nodeloss.not_ready(node("a", "False", T0 - timedelta(seconds=7), "KubeletNotReady"), T0)
    assert (down.node, down.status, down.reason, down.since) == ("a", "False", "KubeletNotReady",
                                                                  T0 - timedelta(seconds=7))


def test_a_node_down_since_earlier_keeps_that_time_when_ready_flips_from_false_to_unknown():
    # The kubelet said NotReady at T0-40s; then it stopped reporting and the controller-manager wrote Unknown
    # (a new lastTransitionTime). The node has not been Ready since the first.
    flipped = node("a", "Unknown", T0 - timedelta(seconds=5), "NodeStatusUnknown")
    assert nodeloss.not_ready(flipped, T0 - timedelta(seconds=40)).since == T0 - timedelta(seconds=40)


def test_a_node_without_a_ready_condition_is_unknown_from_when_it_was_first_seen():
    bare = {"metadata": {"name": "a"}, "status": {}}
    down = nodeloss.not_ready(bare, T0)
    assert (down.status, down.since) == ("Unknown", T0)


def test_only_pods_on_nodes_down_for_node_lost_seconds_are_lost_and_the_wait_for_the_next_is_told():
    down = {"dead": nodeloss.NotReady("dead", "Unknown", "NodeStatusUnknown", T0 - timedelta(seconds=25)),
            "sick": nodeloss.NotReady("sick", "False", "KubeletNotReady", T0 - timedelta(seconds=6))}
    pods = [pod(0, "dead"), pod(1, "sick"), pod(2, "fine"),
            pod(3, "dead", deleting=True),  # gracefully evicted already: its kubelet will never confirm it
            pod(4, "dead", phase="Succeeded")]  # finished: nothing to move
    lost, wait = nodeloss.lost_pods(pods, down, T0, after_s=20)
    assert [p.pod for p in lost] == ["demo-cpu-0-0-0", "demo-cpu-0-0-3"]
    assert lost[0].message == "node dead not Ready (Ready=Unknown) for 25s"
    assert wait == pytest.approx(14.0), "the pod on the node down for 6 s is looked at again 14 s later"
    assert nodeloss.lost_pods([pod(0, "fine")], down, T0, 20) == ([], None)


def test_a_pod_whose_deletion_its_node_never_confirms_is_lost_without_any_right_on_nodes():
    # The namespaced install sees no Node: a pod still there nodeLostSeconds after its grace period ended is the
    # sign (a live kubelet stops its containers at that deadline and removes it within seconds).
    pods = [pod(0, "dead", deleting=True, deletion_deadline=T0 - timedelta(seconds=21)),
            pod(1, "slow", deleting=True, deletion_deadline=T0 - timedelta(seconds=3)),
            pod(2, "fine"), pod(3, None, deleting=True, deletion_deadline=T0 - timedelta(seconds=99))]
    lost, wait = nodeloss.overdue_pods(pods, T0, after_s=20)
    assert [(p.pod, p.node) for p in lost] == [("demo-cpu-0-0-0", "dead")]
    assert lost[0].message == "node dead has not confirmed the deletion of pod demo-cpu-0-0-0 21s past its grace period"
    assert wait == pytest.approx(17.0)
    assert nodeloss.overdue_pods([pod(2, "fine")], T0, 20) == ([], None)


def test_a_pod_view_reads_when_its_deletion_grace_period_ends():
    manifest = {"metadata": {"name": "p", "labels": {}, "deletionTimestamp": "2026-01-01T00:00:30Z"},
                "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    view = unitplan.pod_view(manifest)
    assert view.deleting and view.deletion_deadline == T0 + timedelta(seconds=30)
    assert unitplan.pod_view({**manifest, "metadata": {"name": "p"}}).deletion_deadline is None


# --- how the unit restarts ----------------------------------------------------------------------------------------
def test_a_unit_on_a_lost_node_is_force_deleted_and_relaunched_at_once_without_backoff():
    spec, raw = unit()
    h = objects.pod_spec_hash(raw)
    why = "node dead not Ready (Ready=Unknown) for 21s"
    plan = unitplan.plan_unit(spec, raw, RUNNING, [pod(0, "dead", h=h)], T0, lost={"demo-cpu-0-0-0": why})
    assert plan.force_delete == ["demo-cpu-0-0-0"] and plan.delete == []
    assert plan.create == [0] and plan.status.incarnation == 1 and plan.status.launchedIncarnation == 1, \
        "no backoff and no pod left to wait for: the new incarnation launches in the same pass"
    assert plan.status.restarts == 1 and plan.status.consecutiveFailures == 0
    (type_, reason, message), = plan.events
    assert (type_, reason) == ("Warning", C.Reason.NODE_LOST)
    assert message.startswith(f"{why}: pod demo-cpu-0-0-0 force-deleted; restarting the whole unit as incarnation 1")
    cond = C.get_condition(plan.status.condition_dicts(), C.NODE_LOST)
    assert (cond["status"], cond["reason"]) == ("True", C.Reason.NODE_LOST) and why in cond["message"]


def test_a_multi_pod_unit_with_one_pod_on_a_lost_node_restarts_as_a_whole_after_its_healthy_pod_goes():
    spec, raw = unit(pods=2)
    h = objects.pod_spec_hash(raw)
    plan = unitplan.plan_unit(spec, raw, RUNNING, [pod(0, "dead", h=h), pod(1, "fine", h=h)], T0,
                              lost={"demo-cpu-0-0-0": "node dead not Ready (Ready=False) for 30s"})
    assert plan.force_delete == ["demo-cpu-0-0-0"] and plan.delete == ["demo-cpu-0-0-1"], \
        "the healthy rank is deleted gracefully (it can run its shutdown)"
    assert plan.create == [] and plan.requeue_after == pytest.approx(0.2)
    assert plan.status.phase == "Restarting" and plan.status.incarnation == 1


def test_a_lost_node_neither_backs_off_nor_fails_a_unit_at_its_restart_limit():
    spec, raw = unit(max_restarts=2)
    at_limit = {**RUNNING, "restarts": 2, "consecutiveFailures": 2}
    plan = unitplan.plan_unit(spec, raw, at_limit, [pod(0, "dead", h=objects.pod_spec_hash(raw))], T0,
                              lost={"demo-cpu-0-0-0": "node dead not Ready (Ready=Unknown) for 20s"})
    assert plan.status.phase != "Failed" and plan.create == [0]
    assert plan.status.restarts == 3


def test_a_gracefully_evicted_pod_on_a_lost_node_does_not_hold_the_restart_back():
    # The controller-manager's taint eviction deleted the pod gracefully; the node is dead, so it would stay
    # Terminating for ever and the unit would wait for it ("a clean slate") for ever.
    spec, raw = unit()
    restarting = {**RUNNING, "incarnation": 1, "restarts": 1, "phase": "Restarting"}
    old = pod(0, "dead", inc=0, deleting=True)
    waiting = unitplan.plan_unit(spec, raw, restarting, [old], T0)
    assert waiting.create == [] and "waiting for 1 old pod" in waiting.status.message
    plan = unitplan.plan_unit(spec, raw, restarting, [old], T0, lost={old.name: "node dead lost"})
    assert plan.force_delete == [old.name] and plan.create == [0]
    assert [(r, m) for _, r, m in plan.events] == [
        (C.Reason.NODE_LOST, f"node dead lost: pod {old.name} force-deleted"),
        (C.Reason.PODS_CREATED, "created 1 pod(s) of incarnation 1 on cpu")]
    assert C.is_true(plan.status.condition_dicts(), C.NODE_LOST)


def test_once_running_on_another_node_the_unit_says_where_and_keeps_what_happened():
    spec, raw = unit()
    h = objects.pod_spec_hash(raw)
    lost = unitplan.plan_unit(spec, raw, RUNNING, [pod(0, "dead", h=h)], T0,
                              lost={"demo-cpu-0-0-0": "node dead not Ready (Ready=Unknown) for 21s"})
    later = T0 + timedelta(seconds=3)
    plan = unitplan.plan_unit(spec, raw, lost.status, [pod(0, "spare", inc=1, h=h)], later)
    assert plan.status.phase == "Running" and plan.status.nodes == ["spare"]
    cond = C.get_condition(plan.status.condition_dicts(), C.NODE_LOST)
    assert (cond["status"], cond["reason"]) == ("False", C.Reason.RUNNING_ELSEWHERE)
    assert cond["message"].startswith("running on spare (incarnation 1) after: node dead not Ready")
    assert cond["lastTransitionTime"] == C.now_iso(later)


# --- the pods' tolerations and the API -----------------------------------------------------------------------------
def _toleration_seconds(pod_spec: dict) -> dict[str, int]:
    return {t["key"]: t["tolerationSeconds"] for t in pod_spec.get("tolerations", [])
            if t.get("effect") == "NoExecute" and "tolerationSeconds" in t}


def test_learner_and_syncer_pods_tolerate_a_lost_node_for_node_lost_seconds_not_kubernetes_300():
    spec = job_spec(failurePolicy={"nodeLostSeconds": 45})
    uspec = objects.unit_spec("demo", spec, spec.units[0], 0, 0)
    lu = objects.learner_unit(JOB, uspec)
    lu["metadata"]["uid"] = "lu-1"
    want = {"node.kubernetes.io/not-ready": 45, "node.kubernetes.io/unreachable": 45}
    assert _toleration_seconds(objects.unit_pod(lu, 0, 0)["spec"]) == want
    syncer = objects.syncer_deployment(JOB, spec)
    assert _toleration_seconds(syncer["spec"]["template"]["spec"]) == want
    assert api.DilocoJobSpec.model_validate({"image": "x", "units": [{"name": "a"}]}).failurePolicy.nodeLostSeconds \
        == api.NODE_LOST_SECONDS == 20


def test_a_users_own_toleration_of_a_lost_node_taint_is_kept_as_given():
    mine = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
            "tolerationSeconds": 600}
    spec = job_spec(units=[{"name": "cpu", "tolerations": [mine]}])
    lu = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    lu["metadata"]["uid"] = "lu-1"
    assert _toleration_seconds(objects.unit_pod(lu, 0, 0)["spec"]) == {
        "node.kubernetes.io/unreachable": 600, "node.kubernetes.io/not-ready": 20}


def test_changing_node_lost_seconds_restarts_no_pod():
    spec, raw = unit(lost_s=20)
    _, raw_60 = unit(lost_s=60)
    assert raw != raw_60 and objects.pod_spec_hash(raw) == objects.pod_spec_hash(raw_60)
    plan = unitplan.plan_unit(spec, raw_60, RUNNING, [pod(0, "fine", h=objects.pod_spec_hash(raw))], T0)
    assert plan.delete == [] and plan.events == []
    before = {k: v for k, v in raw.items() if k != "failurePolicy"}
    assert objects.pod_spec_hash(raw) == objects.spec_hash(before), \
        "pods created before the field existed keep their hash (an upgrade restarts no unit)"


@pytest.mark.parametrize("seconds", [4, 86401, "soon"])
def test_node_lost_seconds_out_of_bounds_is_refused_naming_the_field(seconds):
    with pytest.raises(ValidationError) as err:
        job_spec(failurePolicy={"nodeLostSeconds": seconds})
    assert "failurePolicy.nodeLostSeconds" in str(err.value)
