"""Pure decisions for a DilocoJob: how many units of each template, which LearnerUnits to create, update or
delete, and the job's status and conditions from what its units and syncer report."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from datetime import datetime, timezone

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_kube.labels import LABEL_SPARE
from diloco_operator.objects import builders as O
from diloco_trainer.protocol.messages import SyncerStatus
from diloco_trainer.protocol.shardmap import owned_fragments

Event = tuple[str, str, str]
TERMINAL_JOB = ("Succeeded", "Failed")


@dataclass(frozen=True)
class UnitView:
    """What the job logic needs to know about one LearnerUnit."""

    name: str
    template: str
    index: int
    unit_index: int
    phase: str | None
    pods_ready: int
    pods_desired: int
    restarts: int
    unschedulable: bool
    deleting: bool
    spec: dict
    token_epoch: int = 0
    created: str | None = None  # metadata.creationTimestamp: the unit's learner time is allocated since
    last_fault: api.UnitFault | None = None


def unit_view(lu: dict) -> UnitView:
    spec, status = lu.get("spec", {}), api.LearnerUnitStatus.read(lu.get("status"))
    conds = status.condition_dicts()
    return UnitView(
        name=lu["metadata"]["name"], template=spec.get("template", ""), index=int(spec.get("index", -1)),
        unit_index=int(spec.get("unitIndex", -1)), phase=status.phase, pods_ready=status.podsReady or 0,
        pods_desired=status.podsDesired if status.podsDesired is not None else spec.get("podsPerUnit", 1),
        restarts=status.restarts or 0,
        unschedulable=not C.is_true(conds, C.PODS_SCHEDULED) and C.get_condition(conds, C.PODS_SCHEDULED) is not None,
        deleting=bool(lu["metadata"].get("deletionTimestamp")), spec=spec, token_epoch=O.token_epoch(lu),
        created=lu["metadata"].get("creationTimestamp"), last_fault=status.lastFault,
    )


def distribute(templates: list[api.UnitTemplate], total: int) -> dict[str, int]:
    """Units per template for a wanted total: start from each count, grow round-robin in template order up to
    maxCount, shrink from the last template down to minCount. The result may miss `total` only at the bounds."""
    counts = {t.name: t.count for t in templates}
    diff = total - sum(counts.values())
    while diff > 0:
        grown = False
        for t in templates:
            if diff and (t.maxCount is None or counts[t.name] < t.maxCount):
                counts[t.name] += 1
                diff -= 1
                grown = True
        if not grown:
            break
    while diff < 0:
        shrunk = False
        for t in reversed(templates):
            if diff and counts[t.name] > t.minCount:
                counts[t.name] -= 1
                diff += 1
                shrunk = True
        if not shrunk:
            break
    return counts


@dataclass
class UnitsPlan:
    """LearnerUnits to create and update (name -> spec) and to delete (names)."""

    create: dict[str, api.LearnerUnitSpec] = field(default_factory=dict)
    update: dict[str, api.LearnerUnitSpec] = field(default_factory=dict)
    delete: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def plan_units(job_name: str, spec: api.DilocoJobSpec, units: list[UnitView], counts: dict[str, int] | None = None,
               park: list[str] | tuple = (), running_first: bool = False,
               foreign: Container[str] = ()) -> UnitsPlan:
    """Which units to keep, add and remove so each template has its share (`counts`, else `distribute`); kept
    units are never touched except to update a changed spec. `park` units are removed whatever their index.
    Removal takes the highest indices first (with `running_first`, units that do not run go before those that
    do); new units take the lowest free indices. `units` must be the job's own (controlled by it); `foreign`
    names LearnerUnits that exist and are not: never created over, so an index they hold is skipped."""
    plan = UnitsPlan(counts=counts if counts is not None else distribute(spec.units, spec.total_units()))
    templates = {t.name: t for t in spec.units}
    live = [u for u in units if not u.deleting]
    kept = []
    for t in spec.units:
        mine = [u for u in live if u.template == t.name and u.name not in park and u.index >= 0]
        mine.sort(key=lambda u: ((u.phase != "Running") if running_first else False, u.index))
        kept += mine[:plan.counts.get(t.name, 0)]
    # By name: `u not in kept` compared whole views (their spec dicts) against every kept one, O(units²): at 5,000
    # units that was 90% of the operator's CPU (py-spy), every job pass.
    kept_names = {u.name for u in kept}
    plan.delete = sorted((u.name for u in live if u.name not in kept_names), reverse=True)
    used = {u.unit_index for u in kept} | {u.unit_index for u in units if u.deleting}
    have = {(u.template, u.index) for u in kept}
    taken = have | {(u.template, u.index) for u in units if u.deleting}
    for u in kept:
        want = O.unit_spec(job_name, spec, templates[u.template], u.index, u.unit_index)
        if want.model_dump(mode="json", exclude_none=True) != u.spec:
            plan.update[u.name] = want
    next_index = 0
    for t in spec.units:
        missing = plan.counts.get(t.name, 0) - sum(1 for u in kept if u.template == t.name)
        i = 0
        while missing > 0:
            if (t.name, i) not in taken and O.unit_name(job_name, t.name, i) not in foreign:
                while next_index in used:
                    next_index += 1
                used.add(next_index)
                plan.create[O.unit_name(job_name, t.name, i)] = O.unit_spec(job_name, spec, t, i, next_index)
                missing -= 1
            i += 1
    return plan


def token_epochs(known: dict[str, dict], units: list[UnitView], plan: UnitsPlan) -> tuple[dict[str, dict],
                                                                                         dict[str, int]]:
    """The learner epochs document after `plan` (objects.learner_epochs_config_map), and the epoch of each unit it
    creates. A new unit takes one more than any epoch its name had, so its token is new and the old ones stay
    refused; a unit removed (by the plan, by hand, or being deleted) is marked not live: its token is retired.
    Written before the units are created or deleted, so an epoch is never handed out twice."""
    out = {lid: {"epoch": e["epoch"], "live": False} for lid, e in known.items()}
    for u in units:
        if not u.deleting and u.name not in plan.delete:
            out[u.name] = {"epoch": u.token_epoch, "live": True}  # the unit's own: its token must keep working
        elif u.name not in out:  # removed before it was ever written down
            out[u.name] = {"epoch": u.token_epoch, "live": False}
    new = {name: out.get(name, {}).get("epoch", 0) + 1 for name in plan.create}
    for name, epoch in new.items():
        out[name] = {"epoch": epoch, "live": True}
    return out, new


def shard_statuses(name: str, spec: api.DilocoJobSpec, ready: list[bool],
                   statuses: dict[int, SyncerStatus | None]) -> list[api.SyncerShardStatus]:
    """status.syncerShards: each shard's Deployment, readiness, merges and fragments (its own /v1/status when it
    answered, else the fragments the map gives it)."""
    shards, fragments = spec.config.syncer.shards, spec.config.outer.fragments
    out = []
    for shard, is_ready in enumerate(ready):
        status = statuses.get(shard)
        owned = (list(status.owned) or sorted(int(p) for p in status.versions)) if status else []
        out.append(api.SyncerShardStatus(
            shard=shard, name=O.syncer_name(name, shard, shards), ready=is_ready,
            outerSteps=status.outer_steps if status else None,
            fragments=owned or owned_fragments(shard, fragments, shards)))
    return out


@dataclass(frozen=True)
class _Units:
    """The job's units that exist (not being deleted), grouped as its conditions count them."""

    live: list[UnitView]
    ready: list[UnitView]
    failed: list[UnitView]
    succeeded: list[UnitView]
    restarting: list[UnitView]
    unschedulable: list[UnitView]

    @classmethod
    def of(cls, units: list[UnitView]) -> _Units:
        live = [u for u in units if not u.deleting]
        return cls(live, [u for u in live if u.phase == "Running"], [u for u in live if u.phase == "Failed"],
                   [u for u in live if u.phase == "Succeeded"], [u for u in live if u.phase == "Restarting"],
                   [u for u in live if u.unschedulable])


def job_status(name: str, spec: api.DilocoJobSpec, generation: int | None, units: list[UnitView],
               syncer_ready: bool, old: api.DilocoJobStatus | dict | None, now: datetime,
               syncer: SyncerStatus | None = None, desired: int | None = None,
               shards_down: list[str] = ()) -> tuple[api.DilocoJobStatus, list[Event]]:
    """The job's phase, unit counts and conditions from its units and syncer, and the Events its changes deserve
    (jobstatus.observe adds the rest); `syncer`: what the syncer shards reported, combined (its merges, versions
    and last checkpoint are shown; kept from `old` while it does not answer). `units` are the units that exist
    after this reconcile's changes; `desired` the units wanted (default: the templates' distribution; the
    autoscaler's when it decides); `shards_down` the syncer shards not ready (by name). Succeeded and Failed stick."""
    old = api.DilocoJobStatus.read(old)
    if old.phase in TERMINAL_JOB:
        return old, []
    if desired is None:
        desired = sum(distribute(spec.units, spec.total_units()).values())
    u = _Units.of(units)
    st = old.model_copy(update=dict(
        observedGeneration=generation, replicas=len(u.live), unitsReady=len(u.ready), unitsDesired=desired,
        selector=f"{O.LABEL_JOB}={name},{O.LABEL_COMPONENT}=learner,!{LABEL_SPARE}", syncerReady=syncer_ready,
        restarts=sum(x.restarts for x in u.live)))
    if syncer is not None:
        st.outerSteps, st.version = syncer.outer_steps, sum(syncer.versions.values())
        if syncer.last_checkpoint:
            st.lastCheckpoint = C.now_iso(datetime.fromtimestamp(syncer.last_checkpoint, timezone.utc))
    conds, events = _phase(st, old, u, desired, spec.config.outer.quorum, now, generation)
    conds = _health(conds, st, u, desired, spec.config.outer.quorum, syncer_ready, shards_down, now, generation)
    events += _flip_events(old.condition_dicts(), conds)
    order = [C.READY, C.PROGRESSING, C.DEGRADED, C.QUORUM_AVAILABLE, C.SUCCEEDED, C.FAILED]
    conds = sorted(conds, key=lambda c: order.index(c["type"]) if c["type"] in order else len(order))
    st.set_conditions(conds)
    st.message = _summary(st, conds)
    return st, events


def _phase(st: api.DilocoJobStatus, old: api.DilocoJobStatus, u: _Units, desired: int, quorum: int, now: datetime,
           g: int | None) -> tuple[list[dict], list[Event]]:
    """The job's phase (into `st`, with its start and completion times), its Succeeded and Failed conditions, and
    the Event of a job that just finished."""
    conds = old.condition_dicts()
    events: list[Event] = []
    if desired and desired - len(u.failed) < quorum:
        st.phase = "Failed"
        msg = f"only {desired - len(u.failed)} of {desired} units can still run, fewer than the quorum K={quorum}"
        conds = C.set_condition(conds, C.FAILED, True, C.Reason.TOO_FEW_UNITS, msg, now, g)
    elif desired and len(u.succeeded) == desired:
        st.phase = "Succeeded"
        conds = C.set_condition(conds, C.SUCCEEDED, True, C.Reason.ALL_UNITS_SUCCEEDED, "all units completed", now, g)
    else:
        conds = C.set_condition(conds, C.SUCCEEDED, False, C.Reason.NOT_FINISHED, "", now, g)
        conds = C.set_condition(conds, C.FAILED, False, C.Reason.NOT_FINISHED, "", now, g)
        st.phase = "Running" if u.ready or old.phase == "Running" else "Pending"
    if st.phase in TERMINAL_JOB:
        st.completionTime = C.now_iso(now)
        events.append(("Normal" if st.phase == "Succeeded" else "Warning",
                       C.Reason.JOB_SUCCEEDED if st.phase == "Succeeded" else C.Reason.JOB_FAILED,
                       C.get_condition(conds, st.phase)["message"]))
    if st.phase == "Running" and not st.startTime:
        st.startTime = C.now_iso(now)
    return conds, events


def _health(conds: list[dict], st: api.DilocoJobStatus, u: _Units, desired: int, quorum: int, syncer_ready: bool,
            shards_down: list[str], now: datetime, g: int | None) -> list[dict]:
    """The Ready, Progressing, Degraded and QuorumAvailable conditions."""
    all_ready = syncer_ready and len(u.ready) == desired and len(u.live) == desired
    if all_ready:
        conds = C.set_condition(conds, C.READY, True, C.Reason.ALL_UNITS_READY, f"{desired} units ready", now, g)
    elif not syncer_ready:
        conds = C.set_condition(conds, C.READY, False, C.Reason.SYNCER_NOT_READY,
                                f"syncer not ready: {', '.join(shards_down)}" if shards_down else "syncer not ready",
                                now, g)
    else:
        conds = C.set_condition(conds, C.READY, False, C.Reason.UNITS_NOT_READY,
                                f"{len(u.ready)}/{desired} units ready", now, g)
    restarting = ", ".join(x.name for x in u.restarting)
    if len(u.live) != desired:
        conds = C.set_condition(conds, C.PROGRESSING, True, C.Reason.SCALING, f"{len(u.live)} -> {desired} units",
                                now, g)
    elif u.restarting:
        conds = C.set_condition(conds, C.PROGRESSING, True, C.Reason.RESTARTING_UNITS, "restarting: " + restarting,
                                now, g)
    elif not all_ready and st.phase not in TERMINAL_JOB:
        conds = C.set_condition(conds, C.PROGRESSING, True, C.Reason.CREATING, "waiting for units and syncer", now, g)
    else:
        conds = C.set_condition(conds, C.PROGRESSING, False, C.Reason.STABLE, "", now, g)
    if u.unschedulable:
        conds = C.set_condition(conds, C.DEGRADED, True, C.Reason.UNITS_UNSCHEDULABLE,
                                "cannot place: " + ", ".join(x.name for x in u.unschedulable), now, g)
    elif u.failed:
        conds = C.set_condition(conds, C.DEGRADED, True, C.Reason.UNITS_FAILED,
                                "failed for good: " + ", ".join(x.name for x in u.failed), now, g)
    elif u.restarting:
        conds = C.set_condition(conds, C.DEGRADED, True, C.Reason.RESTARTING_UNITS, "restarting: " + restarting,
                                now, g)
    else:
        conds = C.set_condition(conds, C.DEGRADED, False, C.Reason.HEALTHY, "", now, g)
    if syncer_ready and len(u.ready) >= quorum:
        return C.set_condition(conds, C.QUORUM_AVAILABLE, True, C.Reason.QUORUM_MET,
                               f"{len(u.ready)} ready units >= K={quorum}", now, g)
    return C.set_condition(conds, C.QUORUM_AVAILABLE, False, C.Reason.QUORUM_LOST,
                           f"{len(u.ready)} ready units, K={quorum}" + ("" if syncer_ready else ", syncer down"), now, g)


def _flip_events(before_conds: list[dict], conds: list[dict]) -> list[Event]:
    """On the first reconcile only a Degraded job is news; afterwards every flip of Degraded, QuorumAvailable and
    Ready is."""
    events: list[Event] = []
    for ctype in (C.DEGRADED, C.QUORUM_AVAILABLE, C.READY):
        before, after = C.get_condition(before_conds, ctype), C.get_condition(conds, ctype)
        bad = (ctype == C.DEGRADED) == (after["status"] == "True")
        if (before is None and ctype == C.DEGRADED and bad) or (before and before["status"] != after["status"]):
            events.append(("Warning" if bad else "Normal", after["reason"], after["message"] or ctype))
    return events


def _summary(st: api.DilocoJobStatus, conds: list[dict]) -> str:
    for ctype in (C.FAILED, C.DEGRADED):
        if C.is_true(conds, ctype):
            return C.get_condition(conds, ctype)["message"]
    return f"{st.unitsReady or 0}/{st.unitsDesired or 0} units ready"


def link_encrypted(conds: list[dict], tls: api.SyncerTls, secret: str | None, problem: str | None, now: datetime,
                   generation: int | None) -> tuple[list[dict], list[Event]]:
    """The LinkEncrypted condition for spec.syncer.tls (`problem`: what is wrong with the Secret) and the Warning
    Event it deserves when it turns (or first is) False."""
    mode = tls.effective_mode
    if mode == "Disabled":
        status, reason = False, C.Reason.TLS_DISABLED
        message = ("spec.syncer.tls.mode is Disabled: learners reach the syncer over plain HTTP; the token and the "
                   "model travel unencrypted")
    elif problem:
        status, reason, message = False, C.Reason.TLS_SECRET_INVALID, problem
    else:
        status = True
        reason = C.Reason.AUTO_CERTIFICATE if mode == "Auto" else C.Reason.SECRET_CERTIFICATE
        message = f"learners reach the syncer over HTTPS with the certificate of Secret {secret}"
    before = C.get_condition(conds, C.LINK_ENCRYPTED)
    conds = C.set_condition(conds, C.LINK_ENCRYPTED, status, reason, message, now, generation)
    events: list[Event] = []
    if not status and (before is None or before.get("reason") != reason or before.get("message") != message):
        events.append(("Warning", reason, message))
    return conds, events


def syncer_url_annotation(conds: list[dict], followed: bool, problem: str | None, now: datetime,
                          generation: int | None) -> tuple[list[dict], list[Event]]:
    """The SyncerUrlAnnotation condition while a trusted diloco.dev/syncer-url annotation is there (`followed`) or
    refused (`problem`), with a Warning Event when it turns False; without either, the condition is dropped."""
    if problem is None and not followed:
        return [c for c in conds if c.get("type") != C.SYNCER_URL_ANNOTATION], []
    before = C.get_condition(conds, C.SYNCER_URL_ANNOTATION)
    if problem is not None:
        conds = C.set_condition(conds, C.SYNCER_URL_ANNOTATION, False, C.Reason.PLAIN_HTTP_REFUSED, problem, now,
                                generation)
        fresh = before is None or before.get("status") != "False" or before.get("message") != problem
        return conds, [("Warning", C.Reason.PLAIN_HTTP_REFUSED, problem)] if fresh else []
    return C.set_condition(conds, C.SYNCER_URL_ANNOTATION, True, C.Reason.ANNOTATION_FOLLOWED,
                           "the operator reads the syncer's status at the annotated address", now, generation), []


EVENT_MESSAGE_MAX = 1000  # the API keeps 1,024 characters of a message


def _listing(head: str, items: list[str]) -> str:
    """`head` and as many of `items` as fit in one Event message, then how many more there were."""
    text, shown = head, 0
    for item in items:
        more = f"{', ' if shown else ': '}{item}"
        if len(text) + len(more) > EVENT_MESSAGE_MAX - 20:
            return f"{text} and {len(items) - shown} more"
        text, shown = text + more, shown + 1
    return text


def unit_events(plan: UnitsPlan, parked: list[str] | tuple = ()) -> list[Event]:
    """The Events of one reconcile's unit changes: one per kind of change (created, updated, removed and why),
    each naming its units, rather than one per unit (1,000 units created are one Event, not 1,000 requests)."""
    events: list[Event] = []
    if plan.create:
        by_shape: dict[tuple[str, int], list[str]] = {}
        for unit, uspec in plan.create.items():
            by_shape.setdefault((uspec.template, uspec.podsPerUnit), []).append(f"{unit} (unit index {uspec.unitIndex})")
        for (template, pods), units in by_shape.items():
            events.append(("Normal", C.Reason.UNIT_CREATED,
                           _listing(f"created {len(units)} learner unit(s) of {template}, {pods} pod(s) each", units)))
    if plan.update:
        events.append(("Normal", C.Reason.UNIT_UPDATED,
                       _listing(f"updated the spec of {len(plan.update)} learner unit(s)", list(plan.update))))
    for why, units in (("parked: their pods could not be placed", [u for u in plan.delete if u in parked]),
                       ("scaled down", [u for u in plan.delete if u not in parked])):
        if units:
            events.append(("Normal", C.Reason.UNIT_REMOVED,
                           _listing(f"removed {len(units)} learner unit(s) ({why})", units)))
    return events


def clusters_reachable(conds: list[dict], clusters: list[str], down: dict[str, str], now: datetime,
                       generation: int | None) -> tuple[list[dict], list[Event]]:
    """The ClustersReachable condition of a job with spec.clusters (`down`: cluster -> why its last use failed),
    and an Event when it flips. Only the units of an unreachable cluster are affected; the rest trains on."""
    before = C.get_condition(conds, C.CLUSTERS_REACHABLE)
    if down:
        message = "; ".join(f"{c}: {why}" for c, why in sorted(down.items()))
        conds = C.set_condition(conds, C.CLUSTERS_REACHABLE, False, C.Reason.CLUSTER_UNREACHABLE,
                                f"{len(down)} of {len(clusters)} remote cluster(s) unreachable: {message}", now,
                                generation)
    else:
        conds = C.set_condition(conds, C.CLUSTERS_REACHABLE, True, C.Reason.CLUSTERS_REACHABLE,
                                f"remote clusters {', '.join(clusters)} answer", now, generation)
    after = C.get_condition(conds, C.CLUSTERS_REACHABLE)
    events: list[Event] = []
    if (before or {}).get("status") != after["status"] and (before is not None or down):
        events.append(("Warning" if down else "Normal",
                       C.Reason.CLUSTER_UNREACHABLE if down else C.Reason.CLUSTERS_REACHABLE, after["message"]))
    return conds, events
