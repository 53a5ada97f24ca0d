"""The DilocoJob's status, typed and built in one place from what one reconcile saw (units, syncer shards, the
autoscaler, TLS, remote clusters); the controller only writes its wire() form. Pure: no I/O, no kopf."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.plan import jobplan
from diloco_operator.plan.jobplan import Event, UnitView
from diloco_trainer.goodput import Slot, goodput
from diloco_trainer.protocol.messages import SyncerStatus
from diloco_trainer.runtime.shards import merge_statuses


@dataclass(frozen=True)
class SyncerReading:
    """One syncer shard's /v1/status (typed, as the syncer sent it) and when the operator read it (unix seconds)."""

    status: SyncerStatus
    at: float

    @property
    def learners_seen(self) -> dict[str, str]:
        """Learner id -> when the syncer last heard from it (RFC 3339), for those it heard from."""
        return {lid: C.now_iso(datetime.fromtimestamp(info.last_seen, timezone.utc))
                for lid, info in self.status.learners.items() if info.last_seen}

    @property
    def last_checkpoint(self) -> str | None:
        """When the syncer last wrote a checkpoint (RFC 3339), when it reports one."""
        at = self.status.last_checkpoint
        return C.now_iso(datetime.fromtimestamp(at, timezone.utc)) if at else None


def combine(readings: list[SyncerReading]) -> SyncerReading | None:
    """The job's view over its shards' readings (runtime.shards.merge_statuses: merges and merged work add up,
    each shard merging only its own fragments; a learner live if any shard sees it), read when the oldest was;
    its last checkpoint is the oldest shard's, and none until every shard has one (what a restart of every
    shard would resume from at least). None if no shard answered yet."""
    if not readings:
        return None
    merged = merge_statuses([r.status for r in readings])
    checkpoints = [r.status.last_checkpoint for r in readings]
    merged = merged.model_copy(update={"last_checkpoint": min(checkpoints) if all(checkpoints) else None})
    return SyncerReading(status=merged, at=min(r.at for r in readings))


@dataclass(frozen=True)
class TlsView:
    """spec.syncer.tls as the reconcile found it: the Secret serving the certificate, or what is wrong with it."""

    secret: str | None = None
    problem: str | None = None


@dataclass(frozen=True)
class JobObservation:
    """What one reconcile of a job saw, all the status is made of."""

    name: str
    spec: api.DilocoJobSpec
    generation: int | None
    units: list[UnitView]
    old: api.DilocoJobStatus
    now: datetime
    shard_ready: list[bool]
    shard_readings: dict[int, SyncerReading | None]  # shard -> its last /v1/status (None: not answered yet)
    desired: int | None = None  # the autoscaler's units, when it decides
    autoscaling: dict | None = None  # the autoscaler's status (spec.autoscaling)
    scaling_limited: tuple[bool, str, str] | None = None  # its ScalingLimited condition: status, reason, message
    clusters: list[str] = field(default_factory=list)  # spec.clusters' names
    clusters_down: dict[str, str] = field(default_factory=dict)  # cluster -> why its last use failed
    tls: TlsView = TlsView()
    url_followed: bool = False  # a trusted diloco.dev/syncer-url annotation is followed
    url_problem: str | None = None  # ... or refused, and why


def observe(obs: JobObservation) -> tuple[api.DilocoJobStatus, list[Event]]:
    """The job's full status and the Events its changes deserve. A refusal of the syncer is dropped (it was given
    this spec again); a finished job keeps what it last showed."""
    spec, now, g = obs.spec, obs.now, obs.generation
    shards = spec.config.syncer.shards
    reading = combine([r for r in obs.shard_readings.values() if r is not None])
    status, events = jobplan.job_status(
        obs.name, spec, g, obs.units, all(obs.shard_ready), obs.old, now, reading.status if reading else None,
        desired=obs.desired,
        shards_down=[O.syncer_name(obs.name, i, shards) for i, ok in enumerate(obs.shard_ready) if not ok])
    status = status.model_copy(update={"syncerRefusal": None})
    if status.phase in jobplan.TERMINAL_JOB:
        return status, events
    status.syncerShards = jobplan.shard_statuses(
        obs.name, spec, obs.shard_ready, {i: r.status if r else None for i, r in obs.shard_readings.items()})
    if reading is not None:
        status = status.model_copy(update=progress(reading, obs.units, spec.config.outer.fragments))
    if (fault := last_fault(obs.units)) is not None:
        status.lastFault = fault
    conds, cluster_events = status.condition_dicts(), []
    if spec.clusters:
        conds, cluster_events = jobplan.clusters_reachable(conds, obs.clusters, obs.clusters_down, now, g)
    if obs.autoscaling is not None:
        status.autoscaling = api.AutoscalingStatus.model_validate(obs.autoscaling)
        limited, reason, message = obs.scaling_limited or (False, C.Reason.TARGET_MET, "")
        conds = C.set_condition(conds, C.SCALING_LIMITED, limited, reason, message, now, g)
    conds, tls_events = jobplan.link_encrypted(conds, spec.syncer.tls, obs.tls.secret, obs.tls.problem, now, g)
    conds, url_events = jobplan.syncer_url_annotation(conds, obs.url_followed, obs.url_problem, now, g)
    status.conditions = [api.Condition.model_validate(c) for c in conds]
    return status, cluster_events + tls_events + url_events + events


def blocked(old: api.DilocoJobStatus, reason: str, msg: str, now: datetime, generation: int | None,
            prefix: str = "", refusal: dict | None = None) -> api.DilocoJobStatus:
    """The status of a job that cannot go on until its user acts: Ready=False with `reason` and `msg` (and the
    syncer's refusal, when it is the syncer that refused the spec); the rest as it was."""
    conds = C.set_condition(old.condition_dicts(), C.READY, False, reason, msg, now, generation)
    update: dict = {"conditions": [api.Condition.model_validate(c) for c in conds], "message": prefix + msg}
    if refusal is not None:
        update["syncerRefusal"] = api.SyncerRefusal.model_validate(refusal)
    return old.model_copy(update=update)


def progress(reading: SyncerReading, units: list[UnitView], fragments: int) -> dict:
    """The progress fields of the job's status from what its syncer reported (`reading`, over every shard):

    - goodput (goodput.py's definition) over the job's units: each allocated from its creation to the reading,
      busy for the steps its learner reports × its last step time, useful for the merged share of those steps
      (a unit the syncer never heard from is allocated and not busy); absent without a unit to divide by;
    - mergedFraction: Σ steps merged / (P · Σ steps trained) over those units, absent before any step;
    - tokensTrained: the tokens the learners last reported; tokensMergedPerFragment: the syncer's merged tokens
      over the P fragments (every fragment merge counts its tokens: the sum over fragments is P times what
      compares with the tokens trained, runtime/progress.merged_per_fragment);
    - learnersAlive: learners the syncer hears from."""
    status = reading.status
    fragments = status.fragments or fragments
    slots = []
    for unit in units:
        if unit.deleting or not unit.created:
            continue
        allocated = max(0.0, reading.at - C.parse_time(unit.created).timestamp())
        learner = status.learners.get(unit.name)
        if learner is None:
            slots.append(Slot(allocated_s=allocated, busy_s=0.0, steps=0, useful_steps=0.0))
        else:
            slots.append(Slot(allocated_s=allocated, busy_s=learner.step * (learner.step_time_s or 0.0),
                              steps=learner.step, useful_steps=learner.steps_merged / fragments))
    measured = goodput(slots)
    out: dict = {"tokensTrained": sum(ls.tokens for ls in status.learners.values()),
                 "tokensMergedPerFragment": round(status.tokens_merged / fragments),
                 "learnersAlive": status.live_learners}
    for field_, key in (("goodput", "goodput"), ("mergedFraction", "merged_fraction")):
        if measured[key] is not None:
            out[field_] = round(min(1.0, measured[key]), 3)  # 0.1%: a stalled job is not rewritten every poll
    return out


def last_fault(units: list[UnitView]) -> api.JobFault | None:
    """The latest whole-unit restart among the job's units, with its recovery time once the unit runs again."""
    faults = [(u.last_fault, u.name) for u in units if u.last_fault is not None]
    if not faults:
        return None
    fault, unit = max(faults, key=lambda f: (f[0].time, f[1]))  # RFC 3339 in UTC: text order is time order
    recovery = None
    if fault.recoveredAt:
        recovery = round((C.parse_time(fault.recoveredAt) - C.parse_time(fault.time)).total_seconds(), 3)
    return api.JobFault(unit=unit, **(fault.model_dump() | {"recoverySeconds": recovery}))
