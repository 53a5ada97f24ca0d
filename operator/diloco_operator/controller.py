"""The operator's I/O shell: a keyed work queue (one reconcile per object at a time, coalesced, delayed
requeues) and the reconcile functions that read the watch caches (cache.py), ask jobplan/unitplan, and write
the answer through the API (each write also goes into the cache)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit
from datetime import datetime, timezone

from diloco_trainer.protocol.tokens import learner_token
from diloco_trainer.syncer.epochs import EPOCHS_KEY, parse_epochs
from pydantic import ValidationError

from diloco_operator import api, autoscale, certs, metrics
from diloco_operator import conditions as C
from diloco_operator import jobplan
from diloco_operator import objects as O
from diloco_operator import refusal
from diloco_operator import faultwork, jobstatus, kueue, nodeloss, syncer_status, unitplan
from diloco_operator.jobstate import JobState, JobStates, SyncerTls, TlsRead
from diloco_operator.kueue_gate import KueueGate
from diloco_operator.cache import Cache
from diloco_kube.client import (CONFIGMAPS, DEPLOYMENTS, DILOCOJOBS, LEARNERUNITS, NETWORKPOLICIES, NODES, PODS,
                                  PVCS, SECRETS, SERVICES, ApiError, Kube, Resource, status_patch)
from diloco_kube.labels import POOL_LABEL
from diloco_operator.remote import ClusterUnavailable, Remote, RemoteClusters, unreachable

Key = tuple[str, str, str]  # (kind: "job" | "unit", namespace, name)
log = logging.getLogger("diloco_operator")
PARALLEL_WRITES = 16  # the client's thread pool: more in flight would only queue there
REMOTE_POLL_S = 5.0  # a unit in a remote cluster is looked at this often (its pods there are listed, not watched)
REMOTE_RETRY_S = 10.0  # after a remote cluster did not answer
NOT_CONTROLLED_RETRY_S = 10.0  # a job blocked by someone else's object looks again this often (it may be gone)
REMOTE_SWEEP_S = 15.0  # a job's objects left in a remote cluster by removed units are swept at most this often
FINALIZER = "diloco.dev/remote-cleanup"  # a job with spec.clusters: its objects there are removed before it goes


async def _bounded(coros: list) -> None:
    """Await `coros` at most PARALLEL_WRITES at a time; the first error is raised once all have ended."""
    sem = asyncio.Semaphore(PARALLEL_WRITES)

    async def one(c):
        async with sem:
            return await c
    results = await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


class NotControlled(Exception):
    """An object the job needs exists under its name and is not the job's (another job's, or the user's): never
    used, patched or adopted. The message names it."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str | None):
        by = f"controlled by uid {owner}" if owner else "controlled by nothing"
        super().__init__(f"{kind} {namespace}/{name} exists and is not this job's ({by}): rename the job, or remove "
                         "that object if it is a leftover")


def _check_controller(res: Resource, desired: dict, current: dict | None) -> None:
    if current is not None and not O.same_controller(desired, current):
        meta = desired["metadata"]
        raise NotControlled(desired.get("kind") or res.plural, meta["namespace"], meta["name"],
                            O.controller_uid(current))


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


class Controller:
    """Reconciles DilocoJobs and LearnerUnits from a queue fed by watch events and a periodic resync."""

    def __init__(self, kube: Kube, cache: Cache, workers: int = 4, resync_s: float = 30.0,
                 ensure_ttl_s: float = 300.0, first_launch_wait_s: float = 5.0, trust_syncer_url: bool = False,
                 operator_namespace: str | None = None):
        self.kube = kube
        self.operator_namespace = operator_namespace  # where the operator's pod runs (None: outside the cluster)
        self.trust_syncer_url = trust_syncer_url  # follow the diloco.dev/syncer-url annotation (syncer_address)
        self.cache = cache
        # Objects that are not watched (Secret, ConfigMap, PVCs, Services) are read back at most every
        # ensure_ttl_s: (plural, namespace, name, owner uid[, cluster]) -> (hash ensured, when). The owner's UID is
        # in the key: a job re-created under its old name owns none of what was ensured for the old one.
        self.ensured: dict[tuple[str, ...], tuple[str, float]] = {}
        self.ensure_ttl_s = ensure_ttl_s
        self.jobs = JobStates()  # what is remembered of each job, by its UID (jobstate.py)
        self.workers = workers
        self.resync_s = resync_s
        self.queue: asyncio.Queue[Key] = asyncio.Queue()
        self.queued: set[Key] = set()
        self.active: set[Key] = set()
        self.dirty: set[Key] = set()
        self.known: set[Key] = set()
        self.failures: dict[Key, int] = {}
        self.syncer_poll_s = 10.0
        # (ns, unit) -> (uid, status decided but not written yet, write it by): a launch's Pending status waits up
        # to first_launch_wait_s for its pods (unitplan.status_may_wait), so it is usually written once, as Running.
        self.unwritten: dict[tuple[str, str], tuple[str, dict, float]] = {}
        self.first_launch_wait_s = first_launch_wait_s
        self.background: set[asyncio.Task] = set()
        self.remotes = RemoteClusters(kube)
        # node -> when this operator first saw it not Ready (nodeloss.not_ready); dropped once it is Ready
        self.node_down_since: dict[str, datetime] = {}
        self.kueue = KueueGate(kube, cache, self._ensure)  # units of jobs queued in Kueue (kueue.py)

    # --- queue -------------------------------------------------------------------------------------------
    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        """Ask for a reconcile of `key` (now or after `delay` seconds); duplicates coalesce."""
        self.known.add(key)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.enqueue, key)
            return
        if key in self.active:
            self.dirty.add(key)  # re-run once the current pass ends: it may have read stale state
        elif key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)
        metrics.QUEUE_DEPTH.set(self.queue.qsize())

    def enqueue_jobs(self) -> None:
        """Re-queue every known job (a Node changed: capacity for the autoscaler)."""
        for key in [k for k in self.known if k[0] == "job"]:
            self.enqueue(key)

    def node_changed(self, node: dict) -> None:
        """A Node changed: a node not Ready has its units looked at (each then waits out nodeLostSeconds by a
        delayed requeue); a Ready one is forgotten as down."""
        name = node["metadata"]["name"]
        if nodeloss.not_ready(node, datetime.now(timezone.utc)) is None:
            self.node_down_since.pop(name, None)
            return
        for pod in self.cache.all_pods():
            if (pod.get("spec") or {}).get("nodeName") == name:
                unit = (pod["metadata"].get("labels") or {}).get(O.LABEL_UNIT)
                if unit:
                    self.enqueue(("unit", pod["metadata"]["namespace"], unit))

    def forget(self, key: Key) -> None:
        self.known.discard(key)

    async def run(self) -> None:
        """Run the workers and the resync loop until cancelled."""
        tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        tasks.append(asyncio.create_task(self._resync()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _resync(self) -> None:
        # A safety net: even if a watch went quiet, every known object is looked at every resync_s.
        while True:
            await asyncio.sleep(self.resync_s)
            metrics.RESYNCS.inc()
            now = time.monotonic()  # entries past their TTL are read back anyway: forget them (deleted owners')
            self.ensured = {k: v for k, v in self.ensured.items() if now - v[1] < self.ensure_ttl_s}
            for key in list(self.known):
                self.enqueue(key)

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            metrics.QUEUE_DEPTH.set(self.queue.qsize())  # it stayed at the last enqueue's size until the next one
            self.queued.discard(key)
            self.active.add(key)
            started = time.monotonic()
            try:
                if key[0] == "job":
                    await self.reconcile_job(key[1], key[2])
                else:
                    await self.reconcile_unit(key[1], key[2])
                self.failures.pop(key, None)
                metrics.RECONCILES.labels(key[0], "ok").inc()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed pass is retried with backoff, never fatal
                if isinstance(exc, ApiError) and exc.namespace_terminating:
                    log.debug("namespace of %s is being deleted; nothing to reconcile", key)
                    self.forget(key)
                    continue
                n = self.failures[key] = self.failures.get(key, 0) + 1
                delay = min(0.5 * 2 ** (n - 1), 30.0)
                log.warning("reconcile %s failed (%r), retry %d in %.1fs", key, exc, n, delay)
                metrics.RECONCILES.labels(key[0], "error").inc()
                self.enqueue(key, delay)
            finally:
                metrics.RECONCILE_SECONDS.labels(key[0]).observe(time.monotonic() - started)
                self.active.discard(key)
                if key in self.dirty:
                    self.dirty.discard(key)
                    self.enqueue(key)

    async def _events(self, obj: dict, events: list[tuple[str, str, str]]) -> None:
        async def post(type_: str, reason: str, message: str) -> None:
            log.info("%s/%s %s: %s", obj["kind"], obj["metadata"]["name"], reason, message)
            try:
                await self.kube.event(obj, type_, reason, message)
            except ApiError as exc:  # an Event is best effort; the status holds the truth
                log.warning("could not post event %s on %s: %s", reason, obj["metadata"]["name"], exc)
        await _bounded([post(*e) for e in events])

    async def _ensure(self, res: Resource, desired: dict, *, update: bool = True,
                      cached: dict | None | bool = False, remote: Remote | None = None) -> dict:
        """Create `desired` if missing; if it exists and its hash annotation differs, merge-patch it. `cached` is
        the watched copy (None: not there); unwatched kinds are read back only every ensure_ttl_s. With `remote`:
        in that cluster (never watched), as O.in_remote_cluster makes it."""
        kube = self.kube
        owner = O.controller_uid(desired) or ""
        if remote is not None:
            desired, kube, cached = O.in_remote_cluster(desired, remote.namespace), remote.kube, False
        want = O.spec_hash({k: v for k, v in desired.items() if k != "metadata"})
        desired["metadata"].setdefault("annotations", {})["diloco.dev/hash"] = want
        meta = desired["metadata"]
        key = (res.plural, meta["namespace"], meta["name"], owner) + ((remote.cluster,) if remote else ())
        if cached is False:
            done = self.ensured.get(key)
            # Create-only objects (update=False, e.g. the random token) are never compared, only re-created if gone.
            if done and (done[0] == want or not update) and time.monotonic() - done[1] < self.ensure_ttl_s:
                return desired
            if not update:  # create-only: one POST instead of a GET first; who holds an existing one is checked
                current = await kube.create(res, desired)
                if current is None:
                    current = await kube.get(res, meta["namespace"], meta["name"])
                    _check_controller(res, desired, current)
                self.ensured[key] = (want, time.monotonic())
                return current or desired
            current = await kube.get(res, meta["namespace"], meta["name"])
        else:
            current = cached
        written = None
        if current is None:
            written = await kube.create(res, desired)
            if written is None:  # there, but not in the watch (e.g. a Deployment without our labels)
                current = await kube.get(res, meta["namespace"], meta["name"])
            current = written or current or desired
        _check_controller(res, desired, current)
        if update and current["metadata"].get("annotations", {}).get("diloco.dev/hash") != want:
            patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
            current = written = await kube.merge_patch(res, meta["namespace"], meta["name"], patch)
        if cached is False:
            self.ensured[key] = (want, time.monotonic())
        elif written is not None:
            self.cache.wrote(res.plural, written)
        return current

    # --- DilocoJob -----------------------------------------------------------------------------------------
    async def reconcile_job(self, ns: str, name: str) -> None:
        job = self.cache.job(ns, name)
        if job is not None and job["metadata"].get("deletionTimestamp") and FINALIZER in (
                job["metadata"].get("finalizers") or []):
            await self._remote_cleanup_and_release(job)
            return
        if job is None or job["metadata"].get("deletionTimestamp"):
            self.remotes.forget(ns, name)
            metrics.forget_job(ns, name)
            self.jobs.drop(ns, name)  # everything remembered of the job
            self.forget(("job", ns, name))
            return  # the garbage collector removes everything the job owns
        now = datetime.now(timezone.utc)
        old_status = job.get("status") or {}
        try:
            spec = api.DilocoJobSpec.model_validate(job["spec"])
        except ValidationError as exc:
            msg = "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            await self._job_blocked(job, old_status, C.Reason.INVALID_SPEC, msg, now, prefix="invalid spec: ")
            return
        finished = old_status.get("phase") in jobplan.TERMINAL_JOB
        await self._remote_finalizer(job, want=bool(spec.clusters))
        shards = spec.config.syncer.shards
        try:
            await self._ensure(SECRETS, O.token_secret(job, base64.urlsafe_b64encode(os.urandom(32)).decode()),
                               update=False)
            await self._ensure(CONFIGMAPS, O.config_map(job, spec))
            await self._ensure(NETWORKPOLICIES, O.syncer_network_policy(job, spec, self.operator_namespace))
            epochs = await self._learner_epochs(job)  # before the syncer: its pods mount them
            tls = await self._syncer_tls(job, spec, now)
            refused = None if finished else self._syncer_refused(job, spec, old_status, now)
            ready = await asyncio.gather(*(self._ensure_syncer_shard(job, spec, tls, shard,
                                                                     finished or refused is not None)
                                           for shard in range(shards)))
        except NotControlled as exc:  # nothing of the job is started on top of someone else's object
            await self._job_blocked(job, old_status, C.Reason.OBJECT_NOT_OURS, str(exc), now)
            self.enqueue(("job", ns, name), NOT_CONTROLLED_RETRY_S)
            return
        if refused is not None:  # the syncer stays at zero (no crash loop) and no unit is added until a retry
            # (the periodic resync looks again; past refusal.RETRY_AFTER_S the syncer is given the spec again)
            await self._job_blocked(job, old_status, C.Reason.INVALID_SPEC, refused["message"], now,
                                    prefix="invalid spec: ", refusal=refused)
            return
        syncer_ready = all(ready)
        state = self.jobs.of(job)
        readings = {i: state.syncer_readings.get(i) for i in range(shards)}

        uid = job["metadata"].get("uid")
        lus = self._own_units(ns, name, uid)
        units = [jobplan.unit_view(lu) for lu in lus]
        events: list[tuple[str, str, str]] = []
        decision = None
        if not finished:
            if spec.autoscaling is not None:
                free = (autoscale.free_by_template(name, spec, self.cache.nodes(), self.cache.all_pods())
                        if self.cache.watches_nodes else {t.name: None for t in spec.units})  # None: unknown
                if spec.clusters:  # templates in remote clusters: the room on those clusters' nodes
                    free.update(await self._remote_free(job, spec))
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
            await _bounded([delete(u) for u in plan.delete] + [create(u) for u in plan.create.values()]
                           + [update(u, us) for u, us in plan.update.items()])
            events += jobplan.unit_events(plan, decision.park if decision else ())
            if plan.delete or plan.create:
                lus = self._own_units(ns, name, uid)
                units = [jobplan.unit_view(lu) for lu in lus if lu["metadata"]["name"] not in plan.delete]
        down: dict[str, str] = {}
        if spec.clusters and not finished:
            await self._sweep_remote_orphans(job, spec, {lu["metadata"]["name"] for lu in lus})
        if spec.clusters:
            down = {c: why for c, why in self.remotes.unreachable_clusters(ns, name).items()
                    if any(rc.name == c for rc in spec.clusters)}
        status, status_events = jobstatus.observe(jobstatus.JobObservation(
            name=name, spec=spec, generation=job["metadata"].get("generation"), units=units,
            old=api.DilocoJobStatus.read(old_status), now=now, shard_ready=list(ready), shard_readings=readings,
            desired=sum(decision.counts.values()) if decision else None,
            autoscaling=decision.status if decision else None, scaling_limited=decision.limited if decision else None,
            clusters=[c.name for c in spec.clusters], clusters_down=down,
            tls=jobstatus.TlsView(secret=tls.secret, problem=tls.problem),
            url_followed=self.trust_syncer_url and len(syncer_status.annotated_urls(job)) == shards,
            url_problem=syncer_status.annotation_problem(job, tls.secret is not None, self.trust_syncer_url)))
        metrics.export_job_status(ns, name, status)
        if status.phase not in jobplan.TERMINAL_JOB:
            events += tls.events
            tls.events = []
            if decision is not None and decision.requeue_after is not None:
                self.enqueue(("job", ns, name), decision.requeue_after)
        if (patch := status_patch(old_status, status.wire())) is not None:
            self.cache.wrote(DILOCOJOBS.plural,
                             await self.kube.merge_patch(DILOCOJOBS, ns, name, {"status": patch}, "status"))
        await self._events(job, events + status_events)
        if status.phase in jobplan.TERMINAL_JOB and not finished:
            for lu in lus:  # stop the units of a finished job
                self.enqueue(("unit", ns, lu["metadata"]["name"]))
        if (reading := jobstatus.combine([r for r in readings.values() if r is not None])) is not None:
            # units show when the syncer last heard from them
            seen = {lu["metadata"]["name"]: (lu.get("status") or {}).get("lastContribution") for lu in lus}
            for unit, last in reading.learners_seen.items():
                if unit in seen and seen[unit] != last:
                    self.enqueue(("unit", ns, unit))

    def _own_units(self, ns: str, job: str, uid: str | None) -> list[dict]:
        """The job's LearnerUnits: those naming it and controlled by it. A unit that names the job and is not its
        own is never counted, updated or deleted by the job (its own reconcile refuses it: reconcile_unit)."""
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
            await self._events(job, [("Warning", reason, msg)])

    # --- remote clusters (spec.clusters) --------------------------------------------------------------------
    async def _remote_finalizer(self, job: dict, want: bool) -> None:
        """Hold the job's deletion (a finalizer) while it may have objects in remote clusters: ownerReferences do
        not cross clusters, so the operator removes them itself (_remote_cleanup_and_release)."""
        meta = job["metadata"]
        have = FINALIZER in (meta.get("finalizers") or [])
        if have == want:
            return
        finalizers = [f for f in meta.get("finalizers") or [] if f != FINALIZER] + ([FINALIZER] if want else [])
        self.cache.wrote(DILOCOJOBS.plural, await self.kube.merge_patch(DILOCOJOBS, meta["namespace"], meta["name"], {
            "metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}))

    async def _remote_objects(self, remote: Remote, job: str) -> list[tuple[Resource, dict]]:
        out = []
        for res in (PODS, SERVICES, SECRETS, CONFIGMAPS, PVCS):
            out += [(res, o) for o in await remote.kube.list(res, remote.namespace, f"{O.LABEL_JOB}={job}")]
        return out

    async def _remote_free(self, job: dict, spec: api.DilocoJobSpec) -> dict[str, int | None]:
        """Template -> units that fit now, for the templates in remote clusters: from each cluster's Nodes and
        learner pods (listed, at most every REMOTE_POLL_S). A cluster that does not answer has no room (the
        autoscaler then grows nothing there and touches no unit running there)."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        state = self.jobs.of(job)
        out: dict[str, int | None] = {}
        for cluster in spec.clusters:
            templates = [t.name for t in spec.units if t.cluster == cluster.name]
            if not templates:
                continue
            cached = state.remote_room.get(cluster.name)
            if cached is None or time.monotonic() - cached[1] >= REMOTE_POLL_S:
                try:
                    remote = await self.remotes.get(ns, name, cluster)
                    nodes = await remote.kube.list(NODES, None)
                    pods = await remote.kube.list(PODS, None, f"{O.LABEL_COMPONENT}=learner")
                    room = autoscale.free_by_template(name, spec, nodes, pods)
                    self.remotes.answered(ns, name, cluster.name)
                except Exception as exc:
                    if not (isinstance(exc, ClusterUnavailable) or unreachable(exc)):
                        raise
                    self.remotes.failed(ns, name, cluster.name, f"cluster {cluster.name}: {exc}")
                    room = {t: 0 for t in templates}
                cached = state.remote_room[cluster.name] = ({t: room[t] for t in templates}, time.monotonic())
            out.update(cached[0])
        return out

    async def _remote_delete(self, job: dict, spec: api.DilocoJobSpec, keep: set[str] | None) -> list[str]:
        """Delete the job's objects in every remote cluster (those of units not in `keep`; everything when `keep` is
        None); returns why each cluster that could not be cleaned could not."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        failed = []
        for cluster in spec.clusters:
            try:
                remote = await self.remotes.get(ns, name, cluster)
                for res, obj in await self._remote_objects(remote, name):
                    unit = (obj["metadata"].get("labels") or {}).get(O.LABEL_UNIT)
                    if keep is None or (unit is not None and unit not in keep):
                        await remote.kube.delete(res, remote.namespace, obj["metadata"]["name"])
                self.remotes.answered(ns, name, cluster.name)
            except Exception as exc:
                if not (isinstance(exc, ClusterUnavailable) or unreachable(exc)):
                    raise
                self.remotes.failed(ns, name, cluster.name, f"cluster {cluster.name}: {exc}")
                failed.append(f"cluster {cluster.name}: {exc}")
        return failed

    async def _sweep_remote_orphans(self, job: dict, spec: api.DilocoJobSpec, units: set[str]) -> None:
        """Remove what units that no longer exist left in remote clusters (scaled down, deleted by hand): at home
        the garbage collector does that; there nobody else would. At most every REMOTE_SWEEP_S per job."""
        state = self.jobs.of(job)
        if time.monotonic() - state.swept_at < REMOTE_SWEEP_S:
            return
        state.swept_at = time.monotonic()
        await self._remote_delete(job, spec, keep=units)

    async def _remote_cleanup_and_release(self, job: dict) -> None:
        """A job being deleted: remove its objects in every remote cluster, then its finalizer. A cluster that
        cannot be reached keeps the job (Warning Event, retried); removing the finalizer by hand gives up on it."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        try:
            spec = api.DilocoJobSpec.model_validate(job["spec"])
        except ValidationError:
            spec = None
        failed = await self._remote_delete(job, spec, keep=None) if spec is not None else []
        if failed:
            await self._events(job, [("Warning", C.Reason.REMOTE_CLEANUP_FAILED,
                                      "cannot remove the job's objects in " + "; ".join(failed) + " (retrying; remove "
                                      f"the finalizer {FINALIZER} to give up on them)")])
            self.enqueue(("job", ns, name), REMOTE_RETRY_S)
            return
        if spec is not None and spec.clusters:
            await self._events(job, [("Normal", C.Reason.REMOTE_CLEANUP, "removed the job's objects in clusters "
                                      + ", ".join(c.name for c in spec.clusters))])
        await self._remote_finalizer(job, want=False)

    async def _ensure_syncer_shard(self, job: dict, spec: api.DilocoJobSpec, tls: SyncerTls, shard: int,
                                   finished: bool) -> bool:
        """One syncer shard's checkpoint volume, Deployment and Service; polls it when ready. True if it is ready."""
        ns, name, shards = job["metadata"]["namespace"], job["metadata"]["name"], spec.config.syncer.shards
        await self._ensure(PVCS, O.checkpoint_pvc(job, spec, shard), update=False)
        deployment = await self._ensure(
            DEPLOYMENTS, O.syncer_deployment(job, spec, replicas=0 if finished else 1, tls_hash=tls.cert_hash,
                                             shard=shard),
            cached=self.cache.syncer_deployment(ns, name, O.syncer_name(name, shard, shards)))
        await self._ensure(SERVICES, O.syncer_service(job, shard, shards), update=False)
        ready = (deployment.get("status") or {}).get("readyReplicas", 0) >= 1
        if ready and not finished:
            self._poll_syncer(job, tls, shard, shards)
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
        cached = job_state.tls if job_state.tls and (job_state.tls.mode, job_state.tls.secret) == (mode, secret) else None
        # A broken user Secret is looked at again soon: the user is fixing it.
        if cached and time.monotonic() - cached.at < (self.ensure_ttl_s if not cached.state.problem else 5.0):
            return cached.state
        obj = await self.kube.get(SECRETS, ns, secret)
        if spec.syncer.tls.effective_mode == "Auto":  # the operator's own Secret: never someone else's of that name
            _check_controller(SECRETS, O.auto_tls_secret(job, {}), obj)
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
            await self._ensure(CONFIGMAPS, O.ca_config_map(job, state.ca))
        job_state.tls = TlsRead(mode, secret, state, time.monotonic())  # one per job: the spec may have changed
        return state

    def _poll_syncer(self, job: dict, tls: SyncerTls, shard: int = 0, shards: int = 1) -> None:
        """Start a background poll of one syncer shard (at most one in flight, at most every syncer_poll_s);
        reconciles read the cached answer, so a slow or unreachable syncer never delays healing."""
        url = syncer_status.syncer_address(job, api.SYNCER_PORT, tls=tls.secret is not None, shard=shard,
                                           shards=shards, trust_annotation=self.trust_syncer_url)
        state = self.jobs.of(job)
        last = state.syncer_polled.get(url)
        if last is not None and time.monotonic() - last < self.syncer_poll_s:
            return
        state.syncer_polled[url] = time.monotonic()
        task = asyncio.create_task(self._fetch_syncer(state, url, tls.ca, shard, shards))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _job_token(self, state: JobState) -> str:
        """The job's token (the syncer's), read once: created once, never changed ("" while it does not exist)."""
        if (token := state.token) is None:
            secret = await self.kube.get(SECRETS, state.namespace, O.secret_name(state.name))
            token = base64.b64decode((secret or {}).get("data", {}).get(O.TOKEN_KEY, "")).decode()
            if token:
                state.token = token
        return token

    async def _learner_epochs(self, job: dict) -> dict[str, dict]:
        """The job's learner epochs document (as last written; read back from its ConfigMap once), ensured to exist."""
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        if (known := self.jobs.of(job).epochs) is None:
            cm = await self.kube.get(CONFIGMAPS, key[0], O.epochs_config_name(key[1]))
            known = {}
            if cm is not None:
                _check_controller(CONFIGMAPS, O.learner_epochs_config_map(job, {}), cm)
                try:
                    known = {lid: {"epoch": e.epoch, "live": e.live} for lid, e in
                             parse_epochs((cm.get("data") or {}).get(EPOCHS_KEY, '{"learners": {}}')).items()}
                except ValueError as exc:  # edited by hand: start over from the units (their epochs are kept)
                    log.warning("ConfigMap %s/%s: %s", key[0], O.epochs_config_name(key[1]), exc)
        await self._write_learner_epochs(job, known)
        return known

    async def _write_learner_epochs(self, job: dict, epochs: dict[str, dict]) -> None:
        await self._ensure(CONFIGMAPS, O.learner_epochs_config_map(job, epochs))
        self.jobs.of(job).epochs = epochs

    async def _ensure_unit_token(self, unit: dict, job: dict, remote: Remote | None = None) -> None:
        """The unit's own learner token Secret (created once). A Secret of that name owned by anything else is
        never used: the reconcile fails, saying so, rather than hand the unit someone else's credential. A unit
        in a remote cluster gets it there (its owner is then named by annotation: O.in_remote_cluster)."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        secret_name = O.unit_token_secret_name(name)
        key = (SECRETS.plural, ns, secret_name, unit["metadata"].get("uid", "")) + ((remote.cluster,) if remote else ())
        if (done := self.ensured.get(key)) and time.monotonic() - done[1] < self.ensure_ttl_s:
            return
        job_token = await self._job_token(self.jobs.of(job))
        if not job_token:
            raise RuntimeError(f"the token Secret of job {job['metadata']['name']} is not there yet")
        secret = O.unit_token_secret(unit, learner_token(job_token, name, O.token_epoch(unit)))
        kube, where = (remote.kube, remote.namespace) if remote else (self.kube, ns)
        if remote is not None:
            secret = O.in_remote_cluster(secret, remote.namespace)
        if await kube.create(SECRETS, secret) is None:
            current = await kube.get(SECRETS, where, secret_name) or {"metadata": {}}
            owners = {o.get("uid") for o in current["metadata"].get("ownerReferences") or []}
            home_owner = (current["metadata"].get("annotations") or {}).get(O.ANNOTATION_HOME_OWNER, "")
            if remote is not None:
                owners = {o.rsplit("/", 1)[-1] for o in home_owner.split(",") if o}
            if unit["metadata"].get("uid") not in owners:
                raise RuntimeError(f"Secret {where}/{secret_name} exists and is not unit {name}'s: not using it")
        self.ensured[key] = ("", time.monotonic())

    async def _fetch_syncer(self, state: JobState, url: str, ca: str | None = None, shard: int = 0,
                            shards: int = 1) -> None:
        ns, name = state.namespace, state.name
        try:
            token = await self._job_token(state)
            info = await syncer_status.fetch(url, token, ca_pem=ca,
                                             server_hostname=O.syncer_name(name, shard, shards))
        except ApiError as exc:
            log.warning("cannot read the token of job %s/%s: %s", ns, name, exc)
            return
        if info is None:
            return
        before = state.syncer_readings.get(shard)
        changed = before is None or before.status != info.status  # not just read again
        state.syncer_readings[shard] = info
        if changed:
            self.enqueue(("job", ns, name))
        self.enqueue(("job", ns, name), self.syncer_poll_s)  # keep the numbers fresh while it answers

    # --- LearnerUnit ---------------------------------------------------------------------------------------
    def _lost_pods(self, spec: api.LearnerUnitSpec, pods: list[unitplan.PodView],
                   now: datetime) -> tuple[dict[str, str], float | None]:
        """The unit's pods on lost nodes (name -> why) and in how many seconds the next may be: from the watched Nodes
        (not with --no-watch-nodes), and from deletions their kubelet never confirmed (needs no right on Nodes)."""
        after = spec.failurePolicy.nodeLostSeconds
        found, wait = nodeloss.overdue_pods(pods, now, after)
        if self.cache.watches_nodes:
            down = {}
            for name in {p.node for p in pods if p.node}:
                node = self.cache.node(name)
                state = nodeloss.not_ready(node, self.node_down_since.get(name, now)) if node else None
                if state is None:
                    self.node_down_since.pop(name, None)
                    continue
                self.node_down_since.setdefault(name, state.since)
                down[name] = state
            on_down, down_wait = nodeloss.lost_pods(pods, down, now, after)
            found += on_down
            wait = min((w for w in (wait, down_wait) if w is not None), default=None)
        return {p.pod: p.message for p in found}, wait

    def _pools(self, pods: list[unitplan.PodView]) -> dict[str, str]:
        return {p.node: ((self.cache.node(p.node) or {}).get("metadata", {}).get("labels") or {}).get(POOL_LABEL, "")
                for p in pods if p.node}

    def _cluster(self, job: dict, cluster: str) -> api.RemoteCluster:
        spec = api.DilocoJobSpec.model_validate(job["spec"])
        found = next((c for c in spec.clusters if c.name == cluster), None)
        if found is None:
            raise ClusterUnavailable(f"spec.clusters has no entry {cluster!r} any more")
        return found

    async def _remote_unit_pods(self, job: dict, spec: api.LearnerUnitSpec, unit: str) -> tuple[Remote, list[dict]]:
        """The remote cluster's client for a unit, and the unit's pods there (ClusterUnavailable if it cannot be
        used or does not answer: remembered for the job's ClustersReachable condition)."""
        ns = job["metadata"]["namespace"]
        try:
            remote = await self.remotes.get(ns, spec.jobName, self._cluster(job, spec.cluster))
            await self.remotes.namespace(remote)
            pods = await remote.kube.list(PODS, remote.namespace, f"{O.LABEL_UNIT}={unit}")
        except ClusterUnavailable as exc:
            self.remotes.failed(ns, spec.jobName, spec.cluster, str(exc))
            raise
        except Exception as exc:
            if not unreachable(exc):
                raise
            why = f"cluster {spec.cluster} did not answer: {exc!r}"
            self.remotes.failed(ns, spec.jobName, spec.cluster, why)
            raise ClusterUnavailable(why) from None
        self.remotes.answered(ns, spec.jobName, spec.cluster)
        return remote, [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    async def _unit_unreachable(self, unit: dict, spec: api.LearnerUnitSpec, why: str,
                                reason: str = C.Reason.CLUSTER_UNREACHABLE) -> None:
        """A remote unit whose cluster cannot be used: its status says so (its pods there are left alone, they
        may well be training), an Event on the change, the job follows, and it is looked at again soon."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        written = unit.get("status") or {}
        before = C.get_condition(written.get("conditions", []), C.CLUSTER_REACHABLE)
        conds = C.set_condition(written.get("conditions", []), C.CLUSTER_REACHABLE, False,
                                reason, why, datetime.now(timezone.utc),
                                unit["metadata"].get("generation"))
        new = {**written, "conditions": conds, "message": why}
        if (patch := status_patch(written, new)) is not None:
            self.cache.wrote(LEARNERUNITS.plural,
                             await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        if (before or {}).get("status") != "False":
            await self._events(unit, [("Warning", reason, why)])
        self.enqueue(("job", ns, spec.jobName))
        self.enqueue(("unit", ns, name), REMOTE_RETRY_S)

    async def _unit_refused(self, unit: dict, job: dict, why: str) -> None:
        """A unit the job does not control: no pod, no token, nothing deleted; its status says why, and a Warning
        Event on the unit and on the job tells it once."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        written = unit.get("status") or {}
        status, events = unitplan.refused_status(written, why, datetime.now(timezone.utc),
                                                 unit["metadata"].get("generation"))
        if (patch := status_patch(written, status)) is not None:
            self.cache.wrote(LEARNERUNITS.plural,
                             await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        await self._events(unit, events)
        await self._events(job, events)

    async def _job_ca(self, ns: str, job: str) -> str:
        """The CA learners verify the syncer against (the home ConfigMap the job's TLS set-up keeps)."""
        cm = await self.kube.get(CONFIGMAPS, ns, O.ca_config_name(job))
        if cm is None or O.CA_KEY not in (cm.get("data") or {}):
            raise RuntimeError(f"ConfigMap {O.ca_config_name(job)} with the syncer's CA is not there yet")
        return cm["data"][O.CA_KEY]

    async def reconcile_unit(self, ns: str, name: str) -> None:
        unit = self.cache.unit(ns, name)
        if unit is None or unit["metadata"].get("deletionTimestamp"):
            self.forget(("unit", ns, name))
            self.unwritten.pop((ns, name), None)
            return
        spec = api.LearnerUnitSpec.model_validate(unit["spec"])
        job = self.cache.job(ns, spec.jobName)
        if job is None or job["metadata"].get("deletionTimestamp"):
            # Being garbage-collected with its job; while a job's finalizer removes its objects in remote clusters,
            # no unit may put pods back there (they would outlive the job).
            return
        if (why := unitplan.not_controlled_by_job(unit, job)) is not None:
            await self._unit_refused(unit, job, why)
            return
        job_finished = (job.get("status") or {}).get("phase") in jobplan.TERMINAL_JOB
        remote = None
        if spec.cluster is not None:  # a unit in a remote cluster: its pods there are listed, not watched
            try:
                remote, pod_list = await self._remote_unit_pods(job, spec, name)
            except ClusterUnavailable as exc:
                await self._unit_unreachable(unit, spec, str(exc), exc.reason)
                return
            pod_objs = {p["metadata"]["name"]: p for p in pod_list}
        else:
            pod_objs = {p["metadata"]["name"]: p for p in self.cache.pods_of_unit(ns, name, O.LABEL_UNIT)}
        kube = remote.kube if remote else self.kube
        pods = [unitplan.pod_view(p) for p in pod_objs.values()]
        written = unit.get("status") or {}
        held = self.unwritten.get((ns, name))
        if held is not None and held[0] != unit["metadata"].get("uid"):
            held = None  # a new unit of the same name
        old_status = held[1] if held else written  # what this operator decided last, written or not
        now = datetime.now(timezone.utc)
        lost, lost_wait = self._lost_pods(spec, pods, now) if remote is None else ({}, None)
        # A job queued in Kueue: the unit runs only while its Workload is admitted (units in remote clusters and
        # units that ended are not gated; an ended unit's Workload is marked Finished below).
        queue = kueue.queue_name(job) if remote is None else None
        ended = job_finished or old_status.get("phase") in unitplan.TERMINAL_UNIT
        admission = await self.kueue.admission(unit, job, queue) if queue and not ended else None
        if admission is not None and admission.state != "admitted":
            plan = kueue.plan_held(spec, old_status, pods, admission, now, unit["metadata"].get("generation"))
        else:
            plan = unitplan.plan_unit(spec, unit["spec"], old_status, pods, now,
                                      generation=unit["metadata"].get("generation"), node_pools=self._pools(pods),
                                      job_finished=job_finished, lost=lost)
            if admission is not None:
                plan.status = kueue.admitted_condition(plan.status, admission, now, unit["metadata"].get("generation"))
        flavors = await self.kueue.flavors(admission) if admission is not None and plan.create else []
        job_state = self.jobs.get(job["metadata"].get("uid") or "")
        shard_readings = list(job_state.syncer_readings.values()) if job_state else []
        last_seen = max((info.learners_seen.get(name) or "" for info in shard_readings), default="") or None
        if last_seen:
            plan.status["lastContribution"] = last_seen
        if plan.status.get("lastFault") and (reading := jobstatus.combine(shard_readings)) is not None:
            # the work the restart's ended learner life took with it, once the syncer can tell (faultwork.py)
            plan.status["lastFault"] = faultwork.fault_work(
                plan.status["lastFault"], reading.status.learners.get(name), reading.status.fragments,
                unit_ended=plan.status.get("phase") in unitplan.TERMINAL_UNIT)
        if remote is not None:
            plan.status["conditions"] = C.set_condition(
                plan.status.get("conditions", []), C.CLUSTER_REACHABLE, True, C.Reason.CLUSTER_REACHABLE,
                f"cluster {spec.cluster} answers (namespace {remote.namespace})", datetime.now(timezone.utc),
                unit["metadata"].get("generation"))
            plan.requeue_after = min(plan.requeue_after or REMOTE_POLL_S, REMOTE_POLL_S)

        async def delete(pod: str, grace: int | None = None) -> None:
            answer = await kube.delete(PODS, remote.namespace if remote else ns, pod, grace_seconds=grace)
            if remote is None:
                self.cache.deleted(PODS.plural, ns, pod, answer, pod_objs.get(pod))

        async def create(rank: int) -> None:
            if (pvc := O.unit_state_pvc(unit, rank)) is not None:
                await self._ensure(PVCS, pvc, update=False, remote=remote)
            pod = O.unit_pod(unit, plan.status["incarnation"], rank)
            if admission is not None:  # on the flavor Kueue chose
                pod = kueue.place(pod, admission, flavors)
            if remote is not None:
                await kube.create(PODS, O.in_remote_cluster(pod, remote.namespace))
            else:
                self.cache.wrote(PODS.plural, await kube.create(PODS, pod))
        try:
            # A pod on a lost node goes at once (grace 0): its kubelet would never confirm a graceful delete.
            await _bounded([delete(p, 0) for p in plan.force_delete] + [delete(p) for p in plan.delete])
            if plan.create:
                if O.needs_unit_service(spec):
                    await self._ensure(SERVICES, O.unit_service(unit), update=False, remote=remote)
                if remote is None:  # remote clusters: the operator may lack the right there (docs/security.md)
                    await self._ensure(NETWORKPOLICIES, O.unit_network_policy(unit), update=False)
                await self._ensure_unit_token(unit, job, remote)
                if remote is not None and spec.syncerTls:  # the CA its pods verify the syncer against
                    await self._ensure(CONFIGMAPS, O.ca_config_map(job, await self._job_ca(ns, spec.jobName)),
                                       remote=remote)
            await _bounded([create(rank) for rank in plan.create])
        except Exception as exc:
            if remote is None or not unreachable(exc):
                raise
            self.remotes.failed(ns, spec.jobName, spec.cluster, f"cluster {spec.cluster}: {exc!r}")
            await self._unit_unreachable(unit, spec, f"cluster {spec.cluster} did not answer: {exc!r}")
            return
        if admission is not None and admission.state == "evicted" and not pods:  # its pods are gone: quota back
            await self.kueue.release(ns, name)
        if queue and plan.status.get("phase") in unitplan.TERMINAL_UNIT:
            await self.kueue.finish(ns, name, plan.status["phase"], plan.status.get("message") or "")
        patch = None
        now_s = time.monotonic()
        if (plan.create or held) and unitplan.status_may_wait(plan.status, written) and (not held or now_s < held[2]):
            write_by = held[2] if held else now_s + self.first_launch_wait_s
            self.unwritten[(ns, name)] = (unit["metadata"].get("uid"), plan.status, write_by)
            if not held:
                self.enqueue(("unit", ns, name), self.first_launch_wait_s + 0.1)  # after write_by
        else:
            self.unwritten.pop((ns, name), None)
            if (patch := status_patch(written, plan.status)) is not None:
                self.cache.wrote(LEARNERUNITS.plural,
                                 await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        if plan.status.get("restarts", 0) > old_status.get("restarts", 0):
            metrics.UNIT_RESTARTS.labels(ns, spec.jobName).inc()
        await self._events(unit, plan.events)
        if plan.force_delete:
            metrics.PODS_ON_LOST_NODES.labels(ns, spec.jobName).inc(len(plan.force_delete))
            await self._events(job, [(t, r, f"unit {name}: {m}") for t, r, m in plan.events if r == C.Reason.NODE_LOST])
        if plan.requeue_after is not None:
            self.enqueue(("unit", ns, name), plan.requeue_after)
        if lost_wait is not None:  # a node not Ready yet for nodeLostSeconds: look again when it will have been
            self.enqueue(("unit", ns, name), lost_wait + 0.1)
        if patch:  # the job's status is computed from its units': let it follow at once
            self.enqueue(("job", ns, spec.jobName))
