"""Kueue admission per LearnerUnit (pure): the Workload a queued job's unit asks Kueue for, what Kueue answered
(pending, admitted on a flavor, evicted), where the admitted pods go, a held unit's plan, and the status write that
hands an evicted unit's quota back to Kueue (what Kueue's external-framework contract asks of the job's controller)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.plan.unitplan import PodView, UnitPlan, carried_status

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # on a DilocoJob: its units queue in this LocalQueue
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # on a DilocoJob: the WorkloadPriorityClass of its units
POD_SET = "learners"
# Kueue's Workload conditions
QUOTA_RESERVED, ADMITTED, EVICTED, REQUEUED, FINISHED = "QuotaReserved", "Admitted", "Evicted", "Requeued", "Finished"
REQUEUED_REASONS = ("Preempted", "NodeFailures")  # evictions after which Kueue queues the Workload again at once


def queue_name(job: dict) -> str | None:
    """The LocalQueue a job's units are admitted through (None: not queued in Kueue)."""
    return ((job.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def priority_class(job: dict) -> str | None:
    return ((job.get("metadata") or {}).get("labels") or {}).get(PRIORITY_LABEL) or None


def unit_workload(unit: dict, queue: str, pod: dict, priority: tuple[str, int] | None = None) -> dict:
    """The Workload of one unit (named as the unit, owned by it): one pod set of podsPerUnit pods with the resources,
    node selector, tolerations and affinity of `pod` (the unit's pod as objects.unit_pod builds it)."""
    spec = api.LearnerUnitSpec.model_validate(unit["spec"])
    pod_spec = pod["spec"]
    template = {"containers": [{"name": c["name"], "image": c["image"], "resources": c.get("resources") or {}}
                               for c in pod_spec["containers"]], "restartPolicy": "Never"}
    template.update({k: pod_spec[k] for k in ("nodeSelector", "tolerations", "affinity") if pod_spec.get(k)})
    wl_spec: dict = {"queueName": queue, "podSets": [{"name": POD_SET, "count": spec.podsPerUnit,
                                                      "template": {"spec": template}}]}
    if priority is not None:
        wl_spec["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": priority[0]}
        wl_spec["priority"] = priority[1]
    name = unit["metadata"]["name"]
    meta = {"name": name, "namespace": unit["metadata"]["namespace"],
            "labels": {**O.MANAGED_BY, O.LABEL_JOB: spec.jobName, O.LABEL_UNIT: name},
            "ownerReferences": [O.owner_ref(unit)]}
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": meta, "spec": wl_spec}


@dataclass(frozen=True)
class Admission:
    """What Kueue answered for a unit's Workload. `state`: pending (no quota: no pods), admitted (pods may run on
    `flavors`), evicted (Kueue wants the quota back: pods go, then the quota is released)."""

    state: str
    message: str
    reason: str = ""
    cluster_queue: str = ""
    flavors: tuple[str, ...] = ()
    node_selector: dict[str, str] = field(default_factory=dict)  # from admission checks' podSetUpdates
    tolerations: tuple[dict, ...] = ()


def _cond(wl: dict, type_: str) -> dict | None:
    return C.get_condition((wl.get("status") or {}).get("conditions"), type_)


def read_admission(wl: dict | None, queue: str) -> Admission:
    """Kueue's answer as recorded in the Workload's status (None: the Workload is not there yet)."""
    if wl is None:
        return Admission("pending", f"creating its Workload in queue {queue}")
    status = wl.get("status") or {}
    admission = status.get("admission")
    evicted = _cond(wl, EVICTED)
    if admission and evicted and evicted.get("status") == "True":
        return Admission("evicted", evicted.get("message") or "evicted by Kueue", evicted.get("reason") or "Evicted",
                         admission.get("clusterQueue", ""))
    if admission and C.is_true(status.get("conditions", []), ADMITTED):
        flavors = tuple(sorted({f for a in admission.get("podSetAssignments") or [] if a.get("name") == POD_SET
                                for f in (a.get("flavors") or {}).values()}))
        selector: dict[str, str] = {}
        tolerations: list[dict] = []
        for check in status.get("admissionChecks") or []:
            for update in check.get("podSetUpdates") or []:
                if update.get("name") == POD_SET:
                    selector.update(update.get("nodeSelector") or {})
                    tolerations += update.get("tolerations") or []
        return Admission("admitted", f"admitted by ClusterQueue {admission.get('clusterQueue')} on flavor(s) "
                         f"{', '.join(flavors) or '-'}", "Admitted", admission.get("clusterQueue", ""), flavors,
                         selector, tuple(tolerations))
    reserved = _cond(wl, QUOTA_RESERVED) or {}
    why = reserved.get("message") if reserved.get("status") == "False" else None
    return Admission("pending", f"waiting for quota in queue {queue}" + (f": {why}" if why else ""))


def place(pod: dict, admission: Admission, flavors: list[dict]) -> dict:
    """`pod` on the flavor(s) Kueue assigned: their nodeLabels join its nodeSelector and their tolerations its
    tolerations (as Kueue's job integrations do), with any admission check's podSetUpdates on top."""
    spec = dict(pod["spec"])
    selector = dict(spec.get("nodeSelector") or {})
    tolerations = list(spec.get("tolerations") or [])
    for flavor in flavors:
        selector.update((flavor.get("spec") or {}).get("nodeLabels") or {})
        tolerations += (flavor.get("spec") or {}).get("tolerations") or []
    selector.update(admission.node_selector)
    tolerations += admission.tolerations
    if selector:
        spec["nodeSelector"] = selector
    unique: list[dict] = []
    for t in tolerations:
        if t not in unique:
            unique.append(t)
    spec["tolerations"] = unique
    return {**pod, "spec": spec}


def admitted_condition(status: api.LearnerUnitStatus, admission: Admission, now: datetime,
                       generation: int | None) -> api.LearnerUnitStatus:
    """The unit's status with Admitted=True (Kueue admitted its Workload)."""
    out = status.model_copy(deep=True)
    out.set_conditions(C.set_condition(status.condition_dicts(), C.ADMITTED, True, C.Reason.ADMITTED_BY_KUEUE,
                                       admission.message, now, generation))
    return out


def plan_held(spec: api.LearnerUnitSpec, status: api.LearnerUnitStatus | dict | None, pods: list[PodView],
              admission: Admission, now: datetime, generation: int | None = None) -> UnitPlan:
    """A unit Kueue has not admitted, or is evicting: no pod is created, every pod goes. A unit that was running
    starts its next admission as a new incarnation (not a restart: preemption is not the unit's failure, so
    restarts and backoff stay as they were). Events tell an eviction once."""
    old, st = carried_status(spec, status, generation)
    plan = UnitPlan(status=st, delete=[p.name for p in pods if not p.deleting])
    if st.launchedIncarnation == st.incarnation:
        st.incarnation += 1
    evicted = admission.state == "evicted"
    old_conds = old.condition_dicts()
    before = C.get_condition(old_conds, C.ADMITTED) or {}
    reason = C.Reason.EVICTED_BY_KUEUE if evicted else (admission.reason or C.Reason.QUEUED_IN_KUEUE)
    if evicted:
        message = f"evicted by Kueue ({admission.reason}): {admission.message}; its pods are removed"
        if before.get("reason") != C.Reason.EVICTED_BY_KUEUE:
            plan.events.append(("Warning", C.Reason.EVICTED_BY_KUEUE, message))
    else:
        message = admission.message
    st.phase, st.message = "Pending", message
    st.podsReady, st.nodes, st.nodePool = 0, [], None
    # No pod to place: a PodsScheduled=False from before would read as a unit stuck for want of room (and the
    # autoscaler would park it); Kueue, not the nodes, decides when it runs.
    conds = [c for c in old_conds if c.get("type") != C.PODS_SCHEDULED]
    conds = C.set_condition(conds, C.ADMITTED, False, reason, message, now, generation)
    st.set_conditions(C.set_condition(conds, C.READY, False, reason, message, now, generation))
    return plan


def release_status(wl: dict, now: datetime) -> dict:
    """The status patch that hands an evicted Workload's quota back (its pods are gone): admission cleared,
    QuotaReserved and Admitted False, Requeued as Kueue's own job integrations set it. Carries the resourceVersion
    it was computed from, so a write by Kueue in between makes it fail (and it is computed again)."""
    evicted = _cond(wl, EVICTED) or {}
    reason, message = evicted.get("reason") or "Evicted", evicted.get("message") or "evicted"
    gen = (wl.get("metadata") or {}).get("generation")
    conds = (wl.get("status") or {}).get("conditions") or []
    conds = C.set_condition(conds, REQUEUED, reason in REQUEUED_REASONS, reason, message, now, gen)
    conds = C.set_condition(conds, QUOTA_RESERVED, False, "Pending", message, now, gen)
    conds = C.set_condition(conds, ADMITTED, False, "NoReservation", "The workload has no reservation", now, gen)
    return {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
            "status": {"admission": None, "conditions": conds}}


def finished_status(wl: dict, phase: str, message: str, now: datetime) -> dict | None:
    """The status patch that marks the Workload of a unit that ended (Succeeded/Failed) Finished, so Kueue frees its
    quota; None when it already is."""
    if C.is_true((wl.get("status") or {}).get("conditions") or [], FINISHED):
        return None
    gen = (wl.get("metadata") or {}).get("generation")
    conds = C.set_condition((wl.get("status") or {}).get("conditions") or [], FINISHED, True, phase, message or phase,
                            now, gen)
    return {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": {"conditions": conds}}
