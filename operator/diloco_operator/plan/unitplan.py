"""Pure decisions for one LearnerUnit: from its spec, last status and observed pods to the pods to create or
delete, the new status and the Events to post. A unit restarts as a whole (all its pods), with backoff."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O

Event = tuple[str, str, str]  # (Normal|Warning, reason, message)
TERMINAL_UNIT = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodView:
    """What the unit logic needs to know about one pod."""

    name: str
    incarnation: int
    rank: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    deleting: bool = False
    node: str | None = None
    unschedulable: str | None = None  # the scheduler's message while it cannot place the pod
    failure: str | None = None  # why the container ended (reason, exit code)
    spec_hash: str | None = None
    deletion_deadline: datetime | None = None  # being deleted: when its grace period ends (deletionTimestamp)

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def pod_view(pod: dict) -> PodView:
    """Read a Pod manifest into a PodView."""
    meta, status = pod["metadata"], pod.get("status", {})
    labels = meta.get("labels", {})
    conds = status.get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    sched = next((c for c in conds if c.get("type") == "PodScheduled"), None)
    unschedulable = sched.get("message", "unschedulable") if sched and sched.get("status") == "False" \
        and sched.get("reason") == "Unschedulable" else None
    failure = None
    for cs in status.get("containerStatuses", []):
        term = cs.get("state", {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            failure = f"{cs.get('name')}: {term.get('reason', 'Error')} (exit code {term.get('exitCode')})"
    return PodView(
        name=meta["name"], incarnation=int(labels.get(O.LABEL_INCARNATION, -1)), rank=int(labels.get(O.LABEL_RANK, -1)),
        phase=status.get("phase", "Pending"), ready=ready, deleting=bool(meta.get("deletionTimestamp")),
        node=pod.get("spec", {}).get("nodeName"), unschedulable=unschedulable,
        failure=failure or (status.get("reason") if status.get("phase") == "Failed" else None),
        spec_hash=meta.get("annotations", {}).get(O.ANNOTATION_SPEC_HASH),
        deletion_deadline=C.parse_time(meta.get("deletionTimestamp")),
    )


@dataclass
class UnitPlan:
    """What to do for a unit, in order: delete pods (force_delete: at once, grace 0), create ranks (of
    status['incarnation']), write status."""

    status: dict
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    force_delete: list[str] = field(default_factory=list)  # pods on lost nodes: they cannot run their shutdown
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def backoff_seconds(policy: api.RestartPolicy, consecutive_failures: int) -> float:
    """Exponential backoff before restart number `consecutive_failures` (1-based), capped."""
    if consecutive_failures <= 0:
        return 0.0
    return min(policy.backoffSeconds * 2 ** (consecutive_failures - 1), policy.maxBackoffSeconds)


@dataclass(frozen=True)
class Cause:
    """Why the launched pod group can no longer run as a whole. `counted`: a restart in status.restarts; `failure`:
    the unit's own (backs off, counts towards maxRestarts)."""

    reason: str
    message: str
    counted: bool
    failure: bool


def _failure_cause(spec: api.LearnerUnitSpec, current: list[PodView], want_hash: str,
                   lost: Mapping[str, str]) -> Cause | None:
    on_lost = [p for p in current if p.name in lost]
    if on_lost:  # before "deleted": a pod evicted from a lost node is that node's doing, not the unit's
        p = on_lost[0]
        return Cause(C.Reason.NODE_LOST, f"{lost[p.name]}: pod {p.name} force-deleted", True, False)
    by_rank = {p.rank: p for p in current if not p.deleting}
    failed = [p for p in current if p.phase == "Failed"]
    if failed:
        p = failed[0]
        return Cause(C.Reason.POD_FAILED, f"pod {p.name} failed" + (f": {p.failure}" if p.failure else ""), True, True)
    gone = [r for r in range(spec.podsPerUnit) if r not in by_rank]
    if gone:
        return Cause(C.Reason.POD_DELETED, f"pod(s) of rank {', '.join(map(str, gone))} deleted", True, True)
    if any(p.spec_hash and p.spec_hash != want_hash for p in current if not p.terminal):
        return Cause(C.Reason.SPEC_CHANGED, "unit spec changed; recreating its pods", False, False)
    return None


def carried_status(spec: api.LearnerUnitSpec, status: dict | None, generation: int | None) -> tuple[dict, dict]:
    """The unit's status as it was, and the copy a reconcile decides on: counters defaulted, the desired pod count
    and the observed generation set."""
    old = dict(status or {})
    st = {**old}
    st.setdefault("restarts", 0)
    st.setdefault("consecutiveFailures", 0)
    st.setdefault("incarnation", 0)
    st["podsDesired"] = spec.podsPerUnit
    st["observedGeneration"] = generation
    return old, st


def plan_unit(spec: api.LearnerUnitSpec, unit_spec_raw: dict, status: dict | None, pods: list[PodView],
              now: datetime, *, generation: int | None = None, node_pools: dict[str, str] | None = None,
              job_finished: bool = False, lost: Mapping[str, str] | None = None) -> UnitPlan:
    """Decide one reconcile of a unit. Terminal phases (Succeeded, Failed) stick. `lost`: pods on lost nodes (name ->
    why, nodeloss.lost_pods): force-deleted, and a launched unit with one restarts without backoff."""
    lost = lost or {}
    old, st = carried_status(spec, status, generation)
    conds = list(old.get("conditions", []))
    plan = UnitPlan(status=st, force_delete=[p.name for p in pods if p.name in lost])
    inc = st["incarnation"]
    launched = st.get("launchedIncarnation") == inc
    current = [p for p in pods if p.incarnation == inc]
    stale = [p for p in pods if p.incarnation != inc]
    for p in stale:  # an old incarnation's pod left on a lost node (e.g. evicted gracefully there): told here
        if p.name in lost:  # (a current one is the restart's cause, told by its Event below)
            plan.events.append(("Warning", C.Reason.NODE_LOST, f"{lost[p.name]}: pod {p.name} force-deleted"))
            conds = C.set_condition(conds, C.NODE_LOST, True, C.Reason.NODE_LOST, f"{lost[p.name]}: pod {p.name} "
                                    "force-deleted", now, generation)
    told = len(plan.events)  # Events before any of the restart's own
    plan.delete += [p.name for p in stale if not p.deleting and p.name not in lost]

    if old.get("phase") in TERMINAL_UNIT or job_finished:
        if old.get("phase") != "Succeeded":  # a failed unit, or any unit of a finished job, holds no accelerators
            plan.delete += [p.name for p in current if not p.deleting and not p.terminal and p.name not in lost]
        if old.get("phase") not in TERMINAL_UNIT:
            st["phase"], st["message"] = "Failed", "the job finished; unit stopped"
            plan.events.append(("Normal", C.Reason.JOB_FINISHED, st["message"]))
        return _finish(plan, st, conds, current, now, node_pools)

    want_hash = O.pod_spec_hash(unit_spec_raw)
    cause = _failure_cause(spec, current, want_hash, lost) if launched else None
    if launched and not cause and len(current) == spec.podsPerUnit and all(p.phase == "Succeeded" for p in current):
        st["phase"], st["message"] = "Succeeded", "all pods completed"
        plan.events.append(("Normal", C.Reason.COMPLETED, f"unit completed (incarnation {inc})"))
        return _finish(plan, st, conds, current, now, node_pools)
    if cause:
        plan.delete += [p.name for p in current if not p.deleting and p.name not in lost]
        if cause.counted:  # status.lastFault: what the job's status reports, with the time to recover
            st["lastFault"] = {"time": C.now_iso(now), "reason": cause.reason, "message": cause.message[:1000],
                               "incarnation": inc + 1}
        if cause.failure and st["restarts"] >= spec.restartPolicy.maxRestarts:
            if cause.counted:  # no new incarnation: the unit stops here
                st["lastFault"]["incarnation"] = inc
            st["phase"] = "Failed"
            st["message"] = f"{cause.message}; restart limit {spec.restartPolicy.maxRestarts} reached"
            plan.events.append(("Warning", C.Reason.BACKOFF_LIMIT_EXCEEDED, st["message"]))
            return _finish(plan, st, conds, [], now, node_pools)
        delay = 0.0
        if cause.counted:
            st["restarts"] += 1
        if cause.failure:
            st["consecutiveFailures"] += 1
            delay = backoff_seconds(spec.restartPolicy, st["consecutiveFailures"])
        st["incarnation"] = inc = inc + 1
        st["restartAfter"] = C.now_iso(now + timedelta(seconds=delay))
        st["phase"], st["message"] = "Restarting", cause.message
        detail = ""
        if cause.failure:
            detail = f" (restart {st['restarts']}/{spec.restartPolicy.maxRestarts}, backoff {delay:g}s)"
        elif cause.counted:
            detail = f" (restart {st['restarts']}, no backoff: not the unit's failure)"
        plan.events.append(("Warning" if cause.counted else "Normal", cause.reason,
                            f"{cause.message}; restarting the whole unit as incarnation {inc}{detail}"))
        if cause.reason == C.Reason.NODE_LOST:
            conds = C.set_condition(conds, C.NODE_LOST, True, C.Reason.NODE_LOST, cause.message, now,
                                    st["observedGeneration"])
        # A backoff to wait, or old pods to see gone first (a clean slate; force-deleted ones are gone at once).
        if delay > 0 or any(p.name not in lost for p in pods):
            plan.requeue_after = max(delay, 0.2)
            return _finish(plan, st, conds, [], now, node_pools)
        # No backoff and no pod left: the new incarnation starts in this same pass (one status write, not two).
        launched, current, stale = False, [], []

    if not launched:
        restart_after = C.parse_time(st.get("restartAfter"))
        if restart_after and now < restart_after:
            st["phase"] = "Restarting"
            st["message"] = f"backing off until {st['restartAfter']}"
            plan.requeue_after = (restart_after - now).total_seconds()
            return _finish(plan, st, conds, current, now, node_pools, backoff=True)
        going = [p for p in stale if p.name not in lost]  # force-deleted ones are gone at once
        if going:  # a unit restarts on a clean slate: old pods release their accelerators and DNS names first
            st["phase"], st["message"] = "Restarting", f"waiting for {len(going)} old pod(s) to go"
            plan.requeue_after = 0.5
            return _finish(plan, st, conds, current, now, node_pools)
        have = {p.rank for p in current}
        plan.create = [r for r in range(spec.podsPerUnit) if r not in have]
        st["launchedIncarnation"] = inc
        st.pop("restartAfter", None)
        # The first launch is told by the job's UnitCreated Event, a restart by its own Event: only pods created
        # in a later pass of a restart (after a backoff or old pods going) get an Event of their own.
        if plan.create and inc > 0 and len(plan.events) == told:
            plan.events.append(("Normal", C.Reason.PODS_CREATED,
                                f"created {len(plan.create)} pod(s) of incarnation {inc} on {spec.accelerator.type}"))
    ready = sum(1 for p in current if p.phase == "Running" and p.ready and not p.deleting)
    if ready == spec.podsPerUnit:
        st["phase"], st["message"], st["consecutiveFailures"] = "Running", "all pods ready", 0
        fault = st.get("lastFault")
        if fault and fault.get("incarnation") == inc and not fault.get("recoveredAt"):
            at = C.now_iso(now)  # whole seconds, as the job's lastFault computes it from the same two times
            recovery = (C.parse_time(at) - C.parse_time(fault["time"])).total_seconds()
            st["lastFault"] = {**fault, "recoveredAt": at, "recoverySeconds": recovery}
        if C.is_true(conds, C.NODE_LOST):  # moved off the lost node: say where it runs now, keep what happened
            was = C.get_condition(conds, C.NODE_LOST)["message"]
            nodes = ", ".join(sorted({p.node for p in current if p.node}))
            conds = C.set_condition(conds, C.NODE_LOST, False, C.Reason.RUNNING_ELSEWHERE,
                                    f"running on {nodes} (incarnation {inc}) after: {was}", now, st["observedGeneration"])
    else:
        st["phase"] = "Pending"
        st["message"] = f"{ready}/{spec.podsPerUnit} pods ready"
    return _finish(plan, st, conds, current, now, node_pools)


def _controller_ref(unit: dict) -> dict | None:
    return next((r for r in (unit.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def job_controller_uid(unit: dict) -> str | None:
    """The UID in a LearnerUnit's controller ownerReference when that controller is a DilocoJob (None otherwise).
    Only the reference counts, never the home-owner annotation objects in remote clusters carry."""
    ref = _controller_ref(unit)
    return ref.get("uid") if ref is not None and ref.get("kind") == "DilocoJob" else None


def not_controlled_by_job(unit: dict, job: dict) -> str | None:
    """Why the operator must not run `unit` for `job` (None: the job controls it). Only a unit whose controller
    ownerReference is the job's UID is the job's: another unit naming the job in spec.jobName gets no pods and no
    token (it would run with a learner token of the job, on an image its author chose)."""
    uid = job["metadata"].get("uid")
    if uid is not None and job_controller_uid(unit) == uid:
        return None
    meta, ref = unit["metadata"], _controller_ref(unit)
    by = (f"its controller is {ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})" if ref is not None
          else "it has no controller reference")
    return (f"LearnerUnit {meta['namespace']}/{meta['name']} names job {job['metadata']['name']} but is not "
            f"controlled by it ({by}; the job's uid is {job['metadata'].get('uid')}): the operator runs no pods and "
            "makes no token for it. Units are created by their DilocoJob; scale the job instead")


def refused_status(status: dict | None, why: str, now: datetime, generation: int | None) -> tuple[dict, list[Event]]:
    """The status of a unit refused for `why` (not_controlled_by_job): Ready=False / NotControlledByJob, and a
    Warning Event only when that refusal is new (not on every look)."""
    old = dict(status or {})
    before = C.get_condition(old.get("conditions"), C.READY) or {}
    conds = C.set_condition(old.get("conditions", []), C.READY, False, C.Reason.NOT_CONTROLLED_BY_JOB, why, now,
                            generation)
    new = {**old, "conditions": conds, "message": why}
    fresh = before.get("reason") != C.Reason.NOT_CONTROLLED_BY_JOB or before.get("message") != why
    return new, [("Warning", C.Reason.NOT_CONTROLLED_BY_JOB, why)] if fresh else []


def status_may_wait(status: dict, written: dict | None = None) -> bool:
    """A launch whose pods are there but not yet ready (nor refused by the scheduler), and whose restart, if any, is
    already on record in the `written` status: nothing in `status` needs writing at once, so its write may wait a
    moment and usually become the Running one (one write, not two)."""
    written = written or {}
    conds = status.get("conditions", [])
    refused = C.get_condition(conds, C.PODS_SCHEDULED) and not C.is_true(conds, C.PODS_SCHEDULED)
    return (status.get("phase") == "Pending" and not refused
            and status.get("incarnation") == status.get("launchedIncarnation") == written.get("incarnation", 0)
            and status.get("restarts", 0) == written.get("restarts", 0))


def _finish(plan: UnitPlan, st: dict, conds: list[dict], current: list[PodView], now: datetime,
            node_pools: dict[str, str] | None, backoff: bool = False) -> UnitPlan:
    live = [p for p in current if not p.deleting and p.name not in plan.delete and p.name not in plan.force_delete]
    ready = sum(1 for p in live if p.phase == "Running" and p.ready)
    st["podsReady"] = ready
    st["nodes"] = sorted({p.node for p in live if p.node})
    pools = sorted({(node_pools or {}).get(n, "") for n in st["nodes"]} - {""})
    if pools:
        st["nodePool"] = ",".join(pools)
    gen = st.get("observedGeneration")
    all_ready = st["phase"] == "Running"
    if st["phase"] == "Succeeded":
        conds = C.set_condition(conds, C.READY, False, C.Reason.COMPLETED, "unit completed", now, gen)
    elif all_ready:
        conds = C.set_condition(conds, C.READY, True, C.Reason.PODS_READY, st["message"], now, gen)
    else:
        reason = C.Reason.BACKOFF if backoff else C.Reason.PODS_NOT_READY
        conds = C.set_condition(conds, C.READY, False, reason, st.get("message") or "", now, gen)
    unsched = next((p for p in live if p.unschedulable), None)
    was_unschedulable = C.get_condition(conds, C.PODS_SCHEDULED) and not C.is_true(conds, C.PODS_SCHEDULED)
    if unsched:
        conds = C.set_condition(conds, C.PODS_SCHEDULED, False, C.Reason.UNSCHEDULABLE,
                                f"{unsched.name}: {unsched.unschedulable}", now, gen)
        st["message"] = f"unschedulable: {unsched.unschedulable}"
        if not was_unschedulable:
            plan.events.append(("Warning", C.Reason.UNSCHEDULABLE, f"pod {unsched.name} cannot be placed: "
                                                                  f"{unsched.unschedulable}"))
    elif live and all(p.node for p in live):
        conds = C.set_condition(conds, C.PODS_SCHEDULED, True, C.Reason.SCHEDULED, "all pods placed", now, gen)
    st["conditions"] = conds
    return plan
