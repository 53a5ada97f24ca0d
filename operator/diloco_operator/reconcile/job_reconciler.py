"""The DilocoJob reconcile: reads the job and its units from the watch cache, asks jobplan, autoscale and jobstatus,
and writes the syncer's objects, the job's LearnerUnits and the job's status."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

from diloco_trainer.syncer.epochs import EPOCHS_KEY, parse_epochs
from pydantic import ValidationError

from diloco_kube.client import (CONFIGMAPS, DEPLOYMENTS, DILOCOJOBS, LEARNERUNITS, NETWORKPOLICIES, PVCS, SECRETS,
                                  SERVICES, Kube, status_patch)
from diloco_operator import metrics
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.objects import certs
from diloco_operator.plan import autoscale, jobplan, jobstatus, refusal, unitplan
from diloco_operator.reconcile import syncer_status
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.job_remote import FINALIZER, REMOTE_POLL_S, JobRemote
from diloco_operator.reconcile.jobstate import JobStates, SyncerTls, TlsRead
from diloco_operator.reconcile.spare_pods import SparePods
from diloco_operator.reconcile.syncer_poller import SyncerPoller
from diloco_operator.reconcile.writes import NotControlled, Writer, bounded, check_controller
from diloco_operator.remote.clusters import RemoteClusters

log = logging.getLogger("diloco_operator")
NOT_CONTROLLED_RETRY_S = 10.0  # a job blocked by someone else's object looks again this often (it may be gone)


@dataclass
class _NotTheJobs:
    """Unit names taken by LearnerUnits the job does not control (whatever job they name): `name in` it is what
    jobplan.plan_units asks before it creates a unit, so the job never creates over someone else's unit."""

    cache: Cache
    namespace: str
    uid: str | None

    def __contains__(self, name: object) -> bool:
        lu = self.cache.unit(self.namespace, str(name))
        return lu is not None and unitplan.job_controller_uid(lu) != self.uid


@dataclass
class _Syncer:
    """What a pass learned writing the syncer's objects: the learners' token epochs, the TLS state, shards ready."""

    epochs: dict[str, dict]
    tls: SyncerTls
    ready: list[bool]


@dataclass
class _Units:
    """The job's LearnerUnits after a pass (objects and jobplan views), its autoscaling decision and unit Events."""

    lus: list[dict]
    views: list[jobplan.UnitView]
    decision: autoscale.Decision | None
    events: list[tuple[str, str, str]]


class JobReconciler:
    """Reconciles one DilocoJob per call (`reconcile(ns, name)`); `enqueue` asks for later passes."""

    def __init__(self, kube: Kube, cache: Cache, writer: Writer, jobs: JobStates, poller: SyncerPoller,
                 remote: JobRemote, remotes: RemoteClusters, enqueue: Callable[..., None],
                 forget: Callable[..., None], operator_namespace: str | None = None, trust_syncer_url: bool = False,
                 spares: SparePods | None = None):
        self.kube = kube
        self.cache = cache
        self.writer = writer
        self.jobs = jobs  # what is remembered of each job, by its UID (jobstate.py)
        self.poller = poller
        self.remote = remote
        self.remotes = remotes
        self.enqueue = enqueue
        self.forget = forget
        self.operator_namespace = operator_namespace  # where the operator's pod runs (None: outside the cluster)
        self.trust_syncer_url = trust_syncer_url  # follow the diloco.dev/syncer-url annotation (syncer_address)
        self.spares = spares  # the templates' warm spare pods (spare_pods.py)

    async def reconcile(self, ns: str, name: str) -> None:
        """One pass over a job: its deletion, or its syncer's objects, its units and its status, in that order."""
        job = self.cache.job(ns, name)
        if await self._gone(ns, name, job):
            return
        now = datetime.now(timezone.utc)
        old_status = job.get("status") or {}
        try:
            spec = api.DilocoJobSpec.model_validate(job["spec"])
        except ValidationError as exc:
            msg = "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            await self._job_blocked(job, old_status, C.Reason.INVALID_SPEC, msg, now, prefix="invalid spec: ")
            return
        finished = old_status.get("phase") in jobplan.TERMINAL_JOB
        await self.remote.finalizer(job, want=bool(spec.clusters))
        syncer = await self._syncer(job, spec, old_status, now, finished)
        if syncer is None:
            return
        units = await self._units(job, spec, old_status, syncer.epochs, now, finished)
        spares_waiting = await self.spares.keep(job, spec, finished) if self.spares is not None else None
        readings = self.jobs.of(job).syncer_readings
        readings = {i: readings.get(i) for i in range(spec.config.syncer.shards)}
        status, status_events = await self._observe(job, spec, old_status, now, finished, syncer, units, readings)
        status.sparesWaiting = spares_waiting
        await self._publish(job, old_status, finished, status, syncer, units, status_events)
        if (reading := jobstatus.combine([r for r in readings.values() if r is not None])) is not None:
            # units show when the syncer last heard from them
            seen = {lu["metadata"]["name"]: api.LearnerUnitStatus.read(lu.get("status")).lastContribution
                    for lu in units.lus}
            for unit, last in reading.learners_seen.items():
                if unit in seen and seen[unit] != last:
                    self.enqueue(("unit", ns, unit))

    async def _gone(self, ns: str, name: str, job: dict | None) -> bool:
        """A job being deleted (its remote objects first) or gone: forget it; True when there is nothing else to do."""
        if job is not None and job["metadata"].get("deletionTimestamp") and FINALIZER in (
                job["metadata"].get("finalizers") or []):
            await self.remote.cleanup_and_release(job)
            return True
        if job is None or job["metadata"].get("deletionTimestamp"):
            self.remotes.forget(ns, name)
            metrics.forget_job(ns, name)
            self.jobs.drop(ns, name)  # everything remembered of the job
            self.forget(("job", ns, name))
            return True  # the garbage collector removes everything the job owns
        return False

    async def _syncer(self, job: dict, spec: api.DilocoJobSpec, old_status: dict, now: datetime,
                      finished: bool) -> _Syncer | None:
        """The job's token Secret, config, network policy, learner token epochs, TLS and syncer shards; None when the
        job is blocked (an object of its names that is not its own, or a spec its syncer refused): status written."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        try:
            await self.writer.ensure(SECRETS, O.token_secret(job, base64.urlsafe_b64encode(os.urandom(32)).decode()),
                                     update=False)
            await self.writer.ensure(CONFIGMAPS, O.config_map(job, spec))
            await self.writer.ensure(NETWORKPOLICIES, O.syncer_network_policy(job, spec, self.operator_namespace))
            await self.writer.ensure(NETWORKPOLICIES, O.learner_network_policy(job), update=False)
            epochs = await self._learner_epochs(job)  # before the syncer: its pods mount them
            tls = await self._syncer_tls(job, spec, now)
            refused = None if finished else self._syncer_refused(job, spec, old_status, now)
            ready = await asyncio.gather(*(self._ensure_syncer_shard(job, spec, tls, shard,
                                                                     finished or refused is not None)
                                           for shard in range(spec.config.syncer.shards)))
        except NotControlled as exc:  # nothing of the job is started on top of someone else's object
            await self._job_blocked(job, old_status, C.Reason.OBJECT_NOT_OURS, str(exc), now)
            self.enqueue(("job", ns, name), NOT_CONTROLLED_RETRY_S)
            return None
        if refused is not None:  # the syncer stays at zero (no crash loop) and no unit is added until a retry
            # (the periodic resync looks again; past refusal.RETRY_AFTER_S the syncer is given the spec again)
            await self._job_blocked(job, old_status, C.Reason.INVALID_SPEC, refused["message"], now,
                                    prefix="invalid spec: ", refusal=refused)
            return None
        return _Syncer(epochs, tls, list(ready))

    async def _units(self, job: dict, spec: api.DilocoJobSpec, old_status: dict, epochs: dict[str, dict],
                     now: datetime, finished: bool) -> _Units:
        """The job's LearnerUnits brought to what jobplan (and, when autoscaled, autoscale) decides; a finished
        job's are left as they are."""
        ns, name, uid = job["metadata"]["namespace"], job["metadata"]["name"], job["metadata"].get("uid")
        lus = self._own_units(ns, name, uid)
        units = [jobplan.unit_view(lu) for lu in lus]
        if finished:
            return _Units(lus, units, None, [])
        events: list[tuple[str, str, str]] = []
        decision = None
        if spec.autoscaling is not None:
            free = (autoscale.free_by_template(name, spec, self.cache.nodes(), self.cache.all_pods())
                    if self.cache.watches_nodes else {t.name: None for t in spec.units})  # None: unknown
            if spec.clusters:  # templates in remote clusters: the room on those clusters' nodes
                free.update(await self.remote.free(job, spec))
                self.enqueue(("job", ns, name), REMOTE_POLL_S)  # their Nodes are listed, not watched
            decision = autoscale.decide(spec, [autoscale.unit_state(lu) for lu in lus if not
                                               lu["metadata"].get("deletionTimestamp")], free,
                                        old_status.get("autoscaling"), now)
            events += decision.events
            plan = jobplan.plan_units(name, spec, units, decision.counts, decision.park, running_first=True,
                                      foreign=_NotTheJobs(self.cache, ns, uid))
        else:
            plan = jobplan.plan_units(name, spec, units, foreign=_NotTheJobs(self.cache, ns, uid))
        # Retire removed units' tokens and reserve new ones' epochs before any unit is created or deleted.
        epochs, new_epochs = jobplan.token_epochs(epochs, [u for u in units], plan)
        await self._write_learner_epochs(job, epochs)

        async def delete(unit: str) -> None:
            last = self.cache.unit(ns, unit)
            self.cache.deleted(LEARNERUNITS.plural, ns, unit, await self.kube.delete(LEARNERUNITS, ns, unit), last)

        async def create(uspec: api.LearnerUnitSpec) -> None:
            unit = O.learner_unit(job, uspec, new_epochs[O.unit_name(name, uspec.template, uspec.index)])
            self.cache.wrote(LEARNERUNITS.plural, await self.kube.create(LEARNERUNITS, unit))

        async def update(unit: str, uspec: api.LearnerUnitSpec) -> None:
            self.cache.wrote(LEARNERUNITS.plural, await self.kube.merge_patch(
                LEARNERUNITS, ns, unit, {"spec": uspec.model_dump(mode="json")}))
        # Independent writes go out together (bounded): 1,000 units are not 1,000 round trips in a row.
        await bounded([delete(u) for u in plan.delete] + [create(u) for u in plan.create.values()]
                      + [update(u, us) for u, us in plan.update.items()])
        events += jobplan.unit_events(plan, decision.park if decision else ())
        if plan.delete or plan.create:
            lus = self._own_units(ns, name, uid)
            units = [jobplan.unit_view(lu) for lu in lus if lu["metadata"]["name"] not in plan.delete]
        return _Units(lus, units, decision, events)

    async def _observe(self, job: dict, spec: api.DilocoJobSpec, old_status: dict, now: datetime, finished: bool,
                       syncer: _Syncer, units: _Units, readings: dict) -> tuple[api.DilocoJobStatus, list]:
        """The job's status (jobstatus.observe) from its units, its syncer shards' readiness and readings, its
        autoscaling decision and its remote clusters (orphans there swept first)."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        down: dict[str, str] = {}
        if spec.clusters and not finished:
            await self.remote.sweep_orphans(job, spec, {lu["metadata"]["name"] for lu in units.lus})
        if spec.clusters:
            down = {c: why for c, why in self.remotes.unreachable_clusters(ns, name).items()
                    if any(rc.name == c for rc in spec.clusters)}
        decision, tls, shards = units.decision, syncer.tls, spec.config.syncer.shards
        return jobstatus.observe(jobstatus.JobObservation(
            name=name, spec=spec, generation=job["metadata"].get("generation"), units=units.views,
            old=api.DilocoJobStatus.read(old_status), now=now, shard_ready=syncer.ready, shard_readings=readings,
            desired=sum(decision.counts.values()) if decision else None,
            autoscaling=decision.status if decision else None, scaling_limited=decision.limited if decision else None,
            clusters=[c.name for c in spec.clusters], clusters_down=down,
            tls=jobstatus.TlsView(secret=tls.secret, problem=tls.problem),
            url_followed=self.trust_syncer_url and len(syncer_status.annotated_urls(job)) == shards,
            url_problem=syncer_status.annotation_problem(job, tls.secret is not None, self.trust_syncer_url)))

    async def _publish(self, job: dict, old_status: dict, finished: bool, status: api.DilocoJobStatus,
                       syncer: _Syncer, units: _Units, status_events: list) -> None:
        """Metrics, the status patch (only what changed) and the Events; a job that just finished stops its units."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        events = list(units.events)
        metrics.export_job_status(ns, name, status)
        if status.phase not in jobplan.TERMINAL_JOB:
            events += syncer.tls.events
            syncer.tls.events = []
            if units.decision is not None and units.decision.requeue_after is not None:
                self.enqueue(("job", ns, name), units.decision.requeue_after)
        if (patch := status_patch(old_status, status.wire())) is not None:
            self.cache.wrote(DILOCOJOBS.plural,
                             await self.kube.merge_patch(DILOCOJOBS, ns, name, {"status": patch}, "status"))
        await self.writer.events(job, events + status_events)
        if status.phase in jobplan.TERMINAL_JOB and not finished:
            for lu in units.lus:  # stop the units of a finished job
                self.enqueue(("unit", ns, lu["metadata"]["name"]))

    def _own_units(self, ns: str, job: str, uid: str | None) -> list[dict]:
        """The job's LearnerUnits: those naming it and controlled by it. A unit that names the job and is not its
        own is never counted, updated or deleted by the job (its own reconcile refuses it: UnitReconciler.reconcile)."""
        return [lu for lu in self.cache.units_of_job(ns, job) if unitplan.job_controller_uid(lu) == uid]

    async def _job_blocked(self, job: dict, old_status: dict, reason: str, msg: str, now: datetime,
                           prefix: str = "", refusal: dict | None = None) -> None:
        """A job that cannot go on until its user acts: Ready=False with `reason` and `msg` (and the syncer's
        `refusal`), a Warning Event when that status is new."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        new = jobstatus.blocked(api.DilocoJobStatus.read(old_status), reason, msg, now,
                                job["metadata"].get("generation"), prefix, refusal).wire()
        if (patch := status_patch(old_status, new)) is not None:
            self.cache.wrote(DILOCOJOBS.plural,
                             await self.kube.merge_patch(DILOCOJOBS, ns, name, {"status": patch}, "status"))
            await self.writer.events(job, [("Warning", reason, msg)])

    async def _ensure_syncer_shard(self, job: dict, spec: api.DilocoJobSpec, tls: SyncerTls, shard: int,
                                   finished: bool) -> bool:
        """One syncer shard's checkpoint volume, Deployment and Service; polls it when ready. True if it is ready."""
        ns, name, shards = job["metadata"]["namespace"], job["metadata"]["name"], spec.config.syncer.shards
        await self.writer.ensure(PVCS, O.checkpoint_pvc(job, spec, shard), update=False)
        deployment = await self.writer.ensure(
            DEPLOYMENTS, O.syncer_deployment(job, spec, replicas=0 if finished else 1, tls_hash=tls.cert_hash,
                                             shard=shard),
            cached=self.cache.syncer_deployment(ns, name, O.syncer_name(name, shard, shards)))
        await self.writer.ensure(SERVICES, O.syncer_service(job, shard, shards), update=False)
        ready = (deployment.get("status") or {}).get("readyReplicas", 0) >= 1
        if ready and not finished:
            self.poller.poll(job, tls, shard, shards)
        return ready

    def _syncer_refused(self, job: dict, spec: api.DilocoJobSpec, old_status: dict, now: datetime) -> dict | None:
        """The refusal (status.syncerRefusal) that holds for this job now: one a syncer pod of this config and image
        just gave (exit 2, termination message), or the one recorded for this generation, until it is retried."""
        meta = job["metadata"]
        recorded, generation = old_status.get("syncerRefusal"), meta.get("generation")
        message = refusal.refusal_of(self.cache.syncer_pods(meta["namespace"], meta["name"]), O.config_hash(spec),
                                     spec.image)
        if message is not None:
            if recorded and recorded.get("generation") == generation and recorded.get("message") == message:
                return recorded
            return {"generation": generation, "message": message, "at": C.now_iso(now)}
        return recorded if refusal.still_refused(recorded, generation, now) else None

    async def _syncer_tls(self, job: dict, spec: api.DilocoJobSpec, now: datetime) -> SyncerTls:
        """Read (at most every ensure_ttl_s) the Secret the syncer serves; in Auto mode issue or renew it
        (certs.auto_secret_data); publish its ca.crt in the ConfigMap learners mount."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        secret = O.tls_secret_name(name, spec.syncer.tls)
        if secret is None:
            return SyncerTls()
        job_state, mode = self.jobs.of(job), spec.syncer.tls.effective_mode
        cached = job_state.tls
        cached = cached if cached and (cached.mode, cached.secret) == (mode, secret) else None
        # A broken user Secret is looked at again soon: the user is fixing it.
        if cached and time.monotonic() - cached.at < (self.writer.ensure_ttl_s if not cached.state.problem else 5.0):
            return cached.state
        obj = await self.kube.get(SECRETS, ns, secret)
        if spec.syncer.tls.effective_mode == "Auto":  # the operator's own Secret: never someone else's of that name
            check_controller(SECRETS, O.auto_tls_secret(job, {}), obj)
        data = None if obj is None else {k: base64.b64decode(v).decode(errors="replace")
                                         for k, v in (obj.get("data") or {}).items()}
        state = SyncerTls(secret=secret)
        if spec.syncer.tls.effective_mode == "Auto":
            shards = spec.config.syncer.shards
            hosts = [h for i in range(shards) for h in certs.service_hosts(O.syncer_name(name, i, shards), ns)]
            # The addresses pods in remote clusters dial (spec.clusters[].syncerUrl) must be in it too.
            hosts += sorted({urlsplit(u).hostname for c in spec.clusters for u in c.syncerUrl.split(",")} - set(hosts))
            data, why = certs.auto_secret_data(data, hosts, now, ca_name=f"diloco {ns}/{name} CA")
            if why:
                if obj is None:
                    await self.kube.create(SECRETS, O.auto_tls_secret(job, data))
                else:
                    await self.kube.merge_patch(SECRETS, ns, secret, {"stringData": data})
                state.events.append(("Normal", C.Reason.CERTIFICATE_ISSUED, f"Secret {secret}: {why}"))
        else:
            shards = spec.config.syncer.shards
            state.problem = next(filter(None, (certs.secret_problem(data, secret, O.syncer_name(name, i, shards))
                                               for i in range(shards))), None)
        if data and not state.problem:
            state.ca, state.cert_hash = data[certs.CA_CRT], O.spec_hash(data[certs.TLS_CRT])
            await self.writer.ensure(CONFIGMAPS, O.ca_config_map(job, state.ca))
        job_state.tls = TlsRead(mode, secret, state, time.monotonic())  # one per job: the spec may have changed
        return state

    async def _learner_epochs(self, job: dict) -> dict[str, dict]:
        """The job's learner epochs document (as last written; read back from its ConfigMap once), ensured to exist."""
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        if (known := self.jobs.of(job).epochs) is None:
            cm = await self.kube.get(CONFIGMAPS, key[0], O.epochs_config_name(key[1]))
            known = {}
            if cm is not None:
                check_controller(CONFIGMAPS, O.learner_epochs_config_map(job, {}), cm)
                try:
                    known = {lid: {"epoch": e.epoch, "live": e.live} for lid, e in
                             parse_epochs((cm.get("data") or {}).get(EPOCHS_KEY, '{"learners": {}}')).items()}
                except ValueError as exc:  # edited by hand: start over from the units (their epochs are kept)
                    log.warning("ConfigMap %s/%s: %s", key[0], O.epochs_config_name(key[1]), exc)
        await self._write_learner_epochs(job, known)
        return known

    async def _write_learner_epochs(self, job: dict, epochs: dict[str, dict]) -> None:
        await self.writer.ensure(CONFIGMAPS, O.learner_epochs_config_map(job, epochs))
        self.jobs.of(job).epochs = epochs
