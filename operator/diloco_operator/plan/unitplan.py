"""Pure decisions for one LearnerUnit: from its spec, last status and observed pods to the pods to create or
delete, the new status and the Events to post. A unit restarts as a whole (all its pods), with backoff."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from diloco_kube.pod_phase import effective_phase
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
    disruption: str | None = None  # who is deleting it: the reason of its DisruptionTarget condition, if any

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def pod_view(pod: dict) -> PodView:
    """Read a Pod manifest into a PodView (its phase as `effective_phase` says)."""
    meta, status = pod["metadata"], pod.get("status", {})
    labels = meta.get("labels", {})
    conds = status.get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    sched = next((c for c in conds if c.get("type") == "PodScheduled"), None)
    unschedulable = sched.get("message", "unschedulable") if sched and sched.get("status") == "False" \
        and sched.get("reason") == "Unschedulable" else None
    disrupted = next((c for c in conds if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    failure = None
    for cs in status.get("containerStatuses", []):
        term = cs.get("state", {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            failure = f"{cs.get('name')}: {term.get('reason', 'Error')} (exit code {term.get('exitCode')})"
    return PodView(
        name=meta["name"], incarnation=int(labels.get(O.LABEL_INCARNATION, -1)), rank=int(labels.get(O.LABEL_RANK, -1)),
        phase=effective_phase(pod), ready=ready, deleting=bool(meta.get("deletionTimestamp")),
        node=pod.get("spec", {}).get("nodeName"), unschedulable=unschedulable,
        failure=failure or (status.get("reason") if status.get("phase") == "Failed" else None),
        spec_hash=meta.get("annotations", {}).get(O.ANNOTATION_SPEC_HASH),
        deletion_deadline=C.parse_time(meta.get("deletionTimestamp")),
        disruption=disrupted.get("reason") if disrupted else None,
    )


@dataclass
class UnitPlan:
    """What to do for a unit, in order: delete pods (force_delete: at once, grace 0), create ranks (of
    status.incarnation), write status."""

    status: api.LearnerUnitStatus
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    force_delete: list[str] = field(default_factory=list)  # pods on lost nodes: they cannot run their shutdown
    take_spare: bool = False  # a warm spare pod becomes rank 0 of status.incarnation (else: create it at once)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def backoff_seconds(policy: api.RestartPolicy, consecutive_failures: int) -> float:
    """Exponential backoff before restart number `consecutive_failures` (1-based), capped."""
    if consecutive_failures <= 0:
        return 0.0
    return min(policy.backoffSeconds * 2 ** (consecutive_failures - 1), policy.maxBackoffSeconds)


# Deletions Kubernetes makes and marks with a DisruptionTarget condition (its reason) that are not the unit's failure:
# a restart counted in status (lastFault), without backoff and not towards restartPolicy.maxRestarts. Not the
# kubelet's node-pressure eviction (TerminationByKubelet): a learner over its requests is evicted first, so that one
# stays the unit's failure (PodFailed), with backoff.
DISRUPTIONS = {
    "DeletionByTaintManager": (C.Reason.EVICTED_BY_TAINT, "evicted from node {node} by a NoExecute taint it does not "
                               "tolerate (a node not Ready or unreachable for failurePolicy.nodeLostSeconds has one)"),
    "EvictionByEvictionAPI": (C.Reason.EVICTED, "evicted from node {node} (the Eviction API: a drain, a scale-down)"),
    "PreemptionByScheduler": (C.Reason.PREEMPTED, "preempted on node {node} by a pod of higher priority"),
}


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
    disrupted = [p for p in current if p.deleting and p.disruption in DISRUPTIONS]
    if disrupted:  # before "failed" and "deleted": Kubernetes' doing, not the unit's
        p = disrupted[0]
        reason, what = DISRUPTIONS[p.disruption]
        return Cause(reason, f"pod {p.name} {what.format(node=p.node or '-')}", True, False)
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


def carried_status(spec: api.LearnerUnitSpec, status: api.LearnerUnitStatus | dict | None,
                   generation: int | None) -> tuple[api.LearnerUnitStatus, api.LearnerUnitStatus]:
    """The unit's status as it was, and the copy a reconcile decides on: counters defaulted, the desired pod count
    and the observed generation set."""
    old = api.LearnerUnitStatus.read(status)
    st = old.model_copy(deep=True)
    st.restarts = st.restarts or 0
    st.consecutiveFailures = st.consecutiveFailures or 0
    st.incarnation = st.incarnation or 0
    st.podsDesired = spec.podsPerUnit
    st.observedGeneration = generation
    return old, st


@dataclass
class _Pass:
    """One reconcile of a unit while plan_unit decides it: the status being built, its conditions (as dicts, the
    form conditions.py edits), the pods of the current incarnation and of older ones."""

    spec: api.LearnerUnitSpec
    plan: UnitPlan
    conds: list[dict]
    now: datetime
    lost: Mapping[str, str]
    pods: list[PodView]
    current: list[PodView]
    stale: list[PodView]

    @property
    def st(self) -> api.LearnerUnitStatus:
        return self.plan.status


def plan_unit(spec: api.LearnerUnitSpec, unit_spec_raw: dict, status: api.LearnerUnitStatus | dict | None,
              pods: list[PodView], now: datetime, *, generation: int | None = None,
              node_pools: dict[str, str] | None = None, job_finished: bool = False,
              lost: Mapping[str, str] | None = None, spare: bool = False) -> UnitPlan:
    """Decide one reconcile of a unit. Terminal phases (Succeeded, Failed) stick. `lost`: pods on lost nodes (name ->
    why, nodeloss.lost_pods): force-deleted, and a launched unit with one restarts without backoff. `spare`: a warm
    spare pod of the unit's template is up (spare_takeover says when one replaces a dead pod)."""
    lost = lost or {}
    old, st = carried_status(spec, status, generation)
    inc = st.incarnation
    u = _Pass(spec, UnitPlan(status=st, force_delete=[p.name for p in pods if p.name in lost]),
              old.condition_dicts(), now, lost, pods, current=[p for p in pods if p.incarnation == inc],
              stale=[p for p in pods if p.incarnation != inc])
    _tell_stale_on_lost_nodes(u)
    told = len(u.plan.events)  # Events before any of the restart's own
    u.plan.delete += [p.name for p in u.stale if not p.deleting and p.name not in lost]

    if old.phase in TERMINAL_UNIT or job_finished:
        _stop(u, old.phase)
        return _finish(u, u.current, node_pools)
    launched = st.launchedIncarnation == inc
    cause = _failure_cause(spec, u.current, O.pod_spec_hash(unit_spec_raw), lost) if launched else None
    if launched and not cause and len(u.current) == spec.podsPerUnit and all(p.phase == "Succeeded" for p in u.current):
        st.phase, st.message = "Succeeded", "all pods completed"
        u.plan.events.append(("Normal", C.Reason.COMPLETED, f"unit completed (incarnation {inc})"))
        return _finish(u, u.current, node_pools)
    if cause:
        if not _restart(u, cause, spare):
            return _finish(u, [], node_pools)
        # No backoff and no pod left: the new incarnation starts in this same pass (one status write, not two).
        launched, u.current, u.stale = False, [], []
    if not launched:
        if (waiting := _launch(u, told)) is not None:
            return _finish(u, u.current, node_pools, backoff=waiting)
    elif spare and _spare_takes_the_place(u):
        return _finish(u, [], node_pools)
    _running_or_pending(u)
    return _finish(u, u.current, node_pools)


def _tell_stale_on_lost_nodes(u: _Pass) -> None:
    """An old incarnation's pod left on a lost node (e.g. evicted gracefully there) is told here; a current one is
    the restart's cause, told by its Event."""
    for p in u.stale:
        if p.name in u.lost:
            why = f"{u.lost[p.name]}: pod {p.name} force-deleted"
            u.plan.events.append(("Warning", C.Reason.NODE_LOST, why))
            u.conds = C.set_condition(u.conds, C.NODE_LOST, True, C.Reason.NODE_LOST, why, u.now,
                                      u.st.observedGeneration)


def _stop(u: _Pass, phase: str | None) -> None:
    """A unit that ended, or any unit of a finished job: a failed one holds no accelerators."""
    if phase != "Succeeded":
        u.plan.delete += [p.name for p in u.current if not p.deleting and not p.terminal and p.name not in u.lost]
    if phase not in TERMINAL_UNIT:
        u.st.phase, u.st.message = "Failed", "the job finished; unit stopped"
        u.plan.events.append(("Normal", C.Reason.JOB_FINISHED, u.st.message))


SPARE_CAUSES = (C.Reason.POD_DELETED, C.Reason.POD_FAILED, C.Reason.NODE_LOST, C.Reason.EVICTED_BY_TAINT,
                C.Reason.EVICTED, C.Reason.PREEMPTED)


def spare_takeover(spec: api.LearnerUnitSpec, st: api.LearnerUnitStatus, cause: Cause, spare: bool) -> bool:
    """Whether a warm spare pod replaces the unit's dead pod at once (no backoff, no wait for the old pod to go): a
    unit of one pod that was running (no failure since it was last ready), whose pod died, was deleted or lost its
    node. A unit whose pods fail before they are ready backs off as before, so a pod that cannot start does not eat
    the spares (one that fails later, after its in-place restarts, takes one per failure, as it would restart)."""
    return spare and spec.podsPerUnit == 1 and cause.reason in SPARE_CAUSES and st.consecutiveFailures == 0


def _restart(u: _Pass, cause: Cause, spare: bool = False) -> bool:
    """The launched pod group cannot run on (`cause`): its pods go, and the unit fails at its restart limit or
    restarts as the next incarnation. True when that incarnation may start in this same pass (no backoff, and no
    pod left to see gone first)."""
    spec, st, plan = u.spec, u.st, u.plan
    inc = st.incarnation
    plan.delete += [p.name for p in u.current if not p.deleting and p.name not in u.lost]
    if cause.counted:  # status.lastFault: what the job's status reports, with the time to recover
        st.lastFault = api.UnitFault(time=C.now_iso(u.now), reason=cause.reason, message=cause.message[:1000],
                                     incarnation=inc + 1)
    if cause.failure and st.restarts >= spec.restartPolicy.maxRestarts:
        if cause.counted:  # no new incarnation: the unit stops here
            st.lastFault.incarnation = inc
        st.phase = "Failed"
        st.message = f"{cause.message}; restart limit {spec.restartPolicy.maxRestarts} reached"
        plan.events.append(("Warning", C.Reason.BACKOFF_LIMIT_EXCEEDED, st.message))
        return False
    delay = 0.0
    takes_spare = spare_takeover(spec, st, cause, spare)
    if cause.counted:
        st.restarts += 1
    if cause.failure:
        st.consecutiveFailures += 1
        delay = 0.0 if takes_spare else backoff_seconds(spec.restartPolicy, st.consecutiveFailures)
    st.incarnation = inc = inc + 1
    st.restartAfter = C.now_iso(u.now + timedelta(seconds=delay))
    st.phase, st.message = "Restarting", cause.message
    detail = ""
    if cause.failure:
        detail = f" (restart {st.restarts}/{spec.restartPolicy.maxRestarts}, backoff {delay:g}s)"
    elif cause.counted:
        detail = f" (restart {st.restarts}, no backoff: not the unit's failure)"
    plan.events.append(("Warning" if cause.counted else "Normal", cause.reason,
                        f"{cause.message}; restarting the whole unit as incarnation {inc}{detail}"))
    if cause.reason == C.Reason.NODE_LOST:
        u.conds = C.set_condition(u.conds, C.NODE_LOST, True, C.Reason.NODE_LOST, cause.message, u.now,
                                  st.observedGeneration)
    if takes_spare:  # launched now: the old pod drains (or is gone) while the spare trains
        plan.take_spare = True
        st.launchedIncarnation, st.restartAfter = inc, None
        st.message = f"{cause.message}; a warm spare pod takes over"
        plan.events[-1] = (plan.events[-1][0], cause.reason,
                           f"{cause.message}; a warm spare pod takes over as incarnation {inc} (restart "
                           f"{st.restarts}/{spec.restartPolicy.maxRestarts}, no backoff)")
        return False
    # A backoff to wait, or old pods to see gone first (a clean slate; force-deleted ones are gone at once).
    if delay > 0 or any(p.name not in u.lost for p in u.pods):
        plan.requeue_after = max(delay, 0.2)
        return False
    return True


def _spare_takes_the_place(u: _Pass) -> bool:
    """A launched unit of one pod that the scheduler cannot place while a warm spare of its template runs: the spare
    was placed first and holds what the unit needs (on a full node, or a pool without room for both), so it becomes
    the unit, as the next incarnation, and the pod that waits goes. Nothing failed: no restart is counted, no
    backoff. True when that is what happens (the plan takes the spare)."""
    st, plan = u.st, u.plan
    if u.spec.podsPerUnit != 1 or len(u.current) != 1:
        return False
    (pod,) = u.current
    if not pod.unschedulable or pod.node or pod.deleting or pod.phase != "Pending":
        return False
    plan.delete.append(pod.name)
    st.incarnation = st.launchedIncarnation = st.incarnation + 1
    st.restartAfter = None
    plan.take_spare = True
    st.phase = "Pending"
    st.message = f"pod {pod.name} could not be placed ({pod.unschedulable}): a warm spare pod takes its place"
    plan.events.append(("Normal", C.Reason.SPARE_TOOK_PLACE,
                        f"{st.message} as incarnation {st.incarnation} (no restart counted)"))
    return True


def _launch(u: _Pass, told: int) -> bool | None:
    """Create the current incarnation's missing pods, once its backoff is over and older pods are gone. None when
    it launched; otherwise whether it waits for its backoff (True) or for old pods to go (False)."""
    st, plan = u.st, u.plan
    restart_after = C.parse_time(st.restartAfter)
    if restart_after and u.now < restart_after:
        st.phase = "Restarting"
        st.message = f"backing off until {st.restartAfter}"
        plan.requeue_after = (restart_after - u.now).total_seconds()
        return True
    going = [p for p in u.stale if p.name not in u.lost]  # force-deleted ones are gone at once
    if going:  # a unit restarts on a clean slate: old pods release their accelerators and DNS names first
        st.phase, st.message = "Restarting", f"waiting for {len(going)} old pod(s) to go"
        plan.requeue_after = 0.5
        return False
    have = {p.rank for p in u.current}
    plan.create = [r for r in range(u.spec.podsPerUnit) if r not in have]
    st.launchedIncarnation = st.incarnation
    st.restartAfter = None
    # The first launch is told by the job's UnitCreated Event, a restart by its own Event: only pods created in a
    # later pass of a restart (after a backoff or old pods going) get an Event of their own.
    if plan.create and st.incarnation > 0 and len(plan.events) == told:
        plan.events.append(("Normal", C.Reason.PODS_CREATED, f"created {len(plan.create)} pod(s) of incarnation "
                                                             f"{st.incarnation} on {u.spec.accelerator.type}"))
    return None


def _running_or_pending(u: _Pass) -> None:
    """Running once every pod of the current incarnation is ready (the last fault's recovery and a lost node's
    move told then), Pending before."""
    st, inc = u.st, u.st.incarnation
    ready = sum(1 for p in u.current if p.phase == "Running" and p.ready and not p.deleting)
    if ready != u.spec.podsPerUnit:
        st.phase = "Pending"
        st.message = f"{ready}/{u.spec.podsPerUnit} pods ready"
        return
    st.phase, st.message, st.consecutiveFailures = "Running", "all pods ready", 0
    fault = st.lastFault
    if fault and fault.incarnation == inc and not fault.recoveredAt:
        at = C.now_iso(u.now)  # whole seconds, as the job's lastFault computes it from the same two times
        recovery = (C.parse_time(at) - C.parse_time(fault.time)).total_seconds()
        st.lastFault = fault.model_copy(update={"recoveredAt": at, "recoverySeconds": recovery})
    if C.is_true(u.conds, C.NODE_LOST):  # moved off the lost node: say where it runs now, keep what happened
        was = C.get_condition(u.conds, C.NODE_LOST)["message"]
        nodes = ", ".join(sorted({p.node for p in u.current if p.node}))
        u.conds = C.set_condition(u.conds, C.NODE_LOST, False, C.Reason.RUNNING_ELSEWHERE,
                                  f"running on {nodes} (incarnation {inc}) after: {was}", u.now, st.observedGeneration)


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


def refused_status(status: api.LearnerUnitStatus | dict | None, why: str, now: datetime,
                   generation: int | None) -> tuple[api.LearnerUnitStatus, list[Event]]:
    """The status of a unit refused for `why` (not_controlled_by_job): Ready=False / NotControlledByJob, and a
    Warning Event only when that refusal is new (not on every look)."""
    new = api.LearnerUnitStatus.read(status).model_copy(deep=True)
    conds = new.condition_dicts()
    before = C.get_condition(conds, C.READY) or {}
    new.set_conditions(C.set_condition(conds, C.READY, False, C.Reason.NOT_CONTROLLED_BY_JOB, why, now, generation))
    new.message = why
    fresh = before.get("reason") != C.Reason.NOT_CONTROLLED_BY_JOB or before.get("message") != why
    return new, [("Warning", C.Reason.NOT_CONTROLLED_BY_JOB, why)] if fresh else []


def status_may_wait(status: api.LearnerUnitStatus, written: api.LearnerUnitStatus | dict | None = None) -> bool:
    """A launch whose pods are there but not yet ready (nor refused by the scheduler), and whose restart, if any, is
    already on record in the `written` status: nothing in `status` needs writing at once, so its write may wait a
    moment and usually become the Running one (one write, not two)."""
    written = api.LearnerUnitStatus.read(written)
    conds = status.condition_dicts()
    refused = C.get_condition(conds, C.PODS_SCHEDULED) and not C.is_true(conds, C.PODS_SCHEDULED)
    return (status.phase == "Pending" and not refused
            and status.incarnation == status.launchedIncarnation == (written.incarnation or 0)
            and (status.restarts or 0) == (written.restarts or 0))


def _finish(u: _Pass, current: list[PodView], node_pools: dict[str, str] | None, backoff: bool = False) -> UnitPlan:
    """The pods and nodes of what runs on, and the Ready and PodsScheduled conditions, into the status."""
    plan, st, conds, now = u.plan, u.st, u.conds, u.now
    live = [p for p in current if not p.deleting and p.name not in plan.delete and p.name not in plan.force_delete]
    st.podsReady = sum(1 for p in live if p.phase == "Running" and p.ready)
    st.nodes = sorted({p.node for p in live if p.node})
    pools = sorted({(node_pools or {}).get(n, "") for n in st.nodes} - {""})
    if pools:
        st.nodePool = ",".join(pools)
    gen = st.observedGeneration
    if st.phase == "Succeeded":
        conds = C.set_condition(conds, C.READY, False, C.Reason.COMPLETED, "unit completed", now, gen)
    elif st.phase == "Running":
        conds = C.set_condition(conds, C.READY, True, C.Reason.PODS_READY, st.message, now, gen)
    else:
        reason = C.Reason.BACKOFF if backoff else C.Reason.PODS_NOT_READY
        conds = C.set_condition(conds, C.READY, False, reason, st.message or "", now, gen)
    unsched = next((p for p in live if p.unschedulable), None)
    was_unschedulable = C.get_condition(conds, C.PODS_SCHEDULED) and not C.is_true(conds, C.PODS_SCHEDULED)
    if unsched:
        conds = C.set_condition(conds, C.PODS_SCHEDULED, False, C.Reason.UNSCHEDULABLE,
                                f"{unsched.name}: {unsched.unschedulable}", now, gen)
        st.message = f"unschedulable: {unsched.unschedulable}"
        if not was_unschedulable:
            plan.events.append(("Warning", C.Reason.UNSCHEDULABLE, f"pod {unsched.name} cannot be placed: "
                                                                  f"{unsched.unschedulable}"))
    elif live and all(p.node for p in live):
        conds = C.set_condition(conds, C.PODS_SCHEDULED, True, C.Reason.SCHEDULED, "all pods placed", now, gen)
    st.set_conditions(conds)
    return plan
