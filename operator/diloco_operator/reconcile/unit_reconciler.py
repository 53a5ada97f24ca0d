"""The LearnerUnit reconcile: reads the unit and its pods (watched at home, listed in a remote cluster), asks unitplan,
nodeloss and kueue, and writes the unit's pods, its token Secret and its status."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from diloco_trainer.protocol.tokens import learner_token

from diloco_kube.client import (CONFIGMAPS, LEARNERUNITS, NETWORKPOLICIES, PODS, PVCS, SECRETS, SERVICES, Kube,
                                  status_patch)
from diloco_kube.labels import POOL_LABEL
from diloco_operator import metrics
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.plan import faultwork, jobplan, jobstatus, kueue, nodeloss, unitplan
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.job_remote import REMOTE_POLL_S, REMOTE_RETRY_S
from diloco_operator.reconcile.jobstate import JobStates
from diloco_operator.reconcile.kueue_gate import KueueGate
from diloco_operator.reconcile.spare_pods import SparePods
from diloco_operator.reconcile.syncer_poller import SyncerPoller
from diloco_operator.reconcile.writes import Writer, bounded
from diloco_operator.remote.clusters import ClusterUnavailable, Remote, RemoteClusters, unreachable, why_failed


@dataclass
class _Decided:
    """A unit pass's decision: the plan, the pods it saw, its Kueue queue and admission, and when a node not Ready
    yet will have been lost for nodeLostSeconds."""

    plan: unitplan.UnitPlan
    pods: list[unitplan.PodView]
    queue: str | None
    admission: kueue.Admission | None
    lost_wait: float | None


class UnitReconciler:
    """Reconciles one LearnerUnit per call (`reconcile(ns, name)`); `enqueue` asks for later passes."""

    def __init__(self, kube: Kube, cache: Cache, writer: Writer, jobs: JobStates, poller: SyncerPoller,
                 remotes: RemoteClusters, kueue_gate: KueueGate, enqueue: Callable[..., None],
                 forget: Callable[..., None], first_launch_wait_s: float = 5.0, spares: SparePods | None = None):
        self.kube = kube
        self.cache = cache
        self.writer = writer
        self.jobs = jobs
        self.poller = poller
        self.remotes = remotes
        self.kueue = kueue_gate  # units of jobs queued in Kueue (kueue.py)
        self.enqueue = enqueue
        self.forget = forget
        # (ns, unit) -> (uid, status decided but not written yet, write it by): a launch's Pending status waits up
        # to first_launch_wait_s for its pods (unitplan.status_may_wait), so it is usually written once, as Running.
        self.unwritten: dict[tuple[str, str], tuple[str, api.LearnerUnitStatus, float]] = {}
        self.first_launch_wait_s = first_launch_wait_s
        self.spares = spares  # warm spare pods a unit whose pod died takes over (spare_pods.py)
        # node -> when this operator first saw it not Ready (nodeloss.not_ready); dropped once it is Ready
        self.node_down_since: dict[str, datetime] = {}

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

    async def _cluster_failed(self, unit: dict, spec: api.LearnerUnitSpec, exc: BaseException) -> None:
        """A call in the unit's remote cluster got no answer: the cluster is marked failed and the unit says so."""
        ns = unit["metadata"]["namespace"]
        self.remotes.failed(ns, spec.jobName, spec.cluster, f"cluster {spec.cluster}: {exc!r}")
        await self._unit_unreachable(unit, spec, f"cluster {spec.cluster} did not answer: {exc!r}")

    async def _unit_unreachable(self, unit: dict, spec: api.LearnerUnitSpec, why: str,
                                reason: str = C.Reason.CLUSTER_UNREACHABLE) -> None:
        """A remote unit whose cluster cannot be used: its status says so (its pods there are left alone, they
        may well be training), an Event on the change, the job follows, and it is looked at again soon."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        why = why_failed(why)
        written = unit.get("status") or {}
        new = api.LearnerUnitStatus.read(written).model_copy(deep=True)
        before = C.get_condition(new.condition_dicts(), C.CLUSTER_REACHABLE)
        new.set_conditions(C.set_condition(new.condition_dicts(), C.CLUSTER_REACHABLE, False, reason, why,
                                           datetime.now(timezone.utc), unit["metadata"].get("generation")))
        new.message = why
        if (patch := status_patch(written, new.wire())) is not None:
            self.cache.wrote(LEARNERUNITS.plural,
                             await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        if (before or {}).get("status") != "False":
            await self.writer.events(unit, [("Warning", reason, why)])
        self.enqueue(("job", ns, spec.jobName))
        self.enqueue(("unit", ns, name), REMOTE_RETRY_S)

    async def _unit_refused(self, unit: dict, job: dict, why: str) -> None:
        """A unit the job does not control: no pod, no token, nothing deleted; its status says why, and a Warning
        Event on the unit and on the job tells it once."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        written = unit.get("status") or {}
        status, events = unitplan.refused_status(written, why, datetime.now(timezone.utc),
                                                 unit["metadata"].get("generation"))
        if (patch := status_patch(written, status.wire())) is not None:
            self.cache.wrote(LEARNERUNITS.plural,
                             await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        await self.writer.events(unit, events)
        await self.writer.events(job, events)

    async def _job_ca(self, ns: str, job: str) -> str:
        """The CA learners verify the syncer against (the home ConfigMap the job's TLS set-up keeps)."""
        cm = await self.kube.get(CONFIGMAPS, ns, O.ca_config_name(job))
        if cm is None or O.CA_KEY not in (cm.get("data") or {}):
            raise RuntimeError(f"ConfigMap {O.ca_config_name(job)} with the syncer's CA is not there yet")
        return cm["data"][O.CA_KEY]

    async def reconcile(self, ns: str, name: str) -> None:
        """One pass over a unit: read its pods (watched, or listed in its remote cluster), decide (unitplan, or
        kueue while its Workload is not admitted), write pods and objects, then its status and Events."""
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
        remote, uid = None, unit["metadata"].get("uid")
        if spec.cluster is not None:  # a unit in a remote cluster: its pods there are listed, not watched
            try:
                remote, pod_list = await self._remote_unit_pods(job, spec, name)
            except ClusterUnavailable as exc:
                await self._unit_unreachable(unit, spec, str(exc), exc.reason)
                return
            pod_objs = {p["metadata"]["name"]: p for p in pod_list if O.controlled_by(p, uid, remote=True)}
        else:  # a pod that only carries the unit's label is not the unit's: never deleted, counted or replaced
            pod_objs = {p["metadata"]["name"]: p for p in self.cache.pods_of_unit(ns, name, O.LABEL_UNIT)
                        if O.controlled_by(p, uid)}
        written = unit.get("status") or {}
        held = self.unwritten.get((ns, name))
        if held is not None and held[0] != unit["metadata"].get("uid"):
            held = None  # a new unit of the same name
        # what this operator decided last, written or not
        old_status = held[1] if held else api.LearnerUnitStatus.read(written)
        try:
            decided = await self._decide(unit, spec, job, old_status, pod_objs, remote)
        except Exception as exc:  # its Workload there (Kueue) could not be read or written
            if remote is None or not unreachable(exc):
                raise
            await self._cluster_failed(unit, spec, exc)
            return
        if not await self._apply(unit, spec, job, decided, pod_objs, remote):
            return
        await self._record(unit, spec, job, decided, written, held, old_status, remote)

    async def _decide(self, unit: dict, spec: api.LearnerUnitSpec, job: dict, old_status: api.LearnerUnitStatus,
                      pod_objs: dict[str, dict], remote: Remote | None) -> _Decided:
        """The unit's plan (pods to delete and create, its status and Events): unitplan's, or kueue's while its
        Workload waits; with what the syncer says of it (last contribution, the work its last fault lost)."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        job_finished = (job.get("status") or {}).get("phase") in jobplan.TERMINAL_JOB
        pods = [unitplan.pod_view(p) for p in pod_objs.values()]
        now = datetime.now(timezone.utc)
        lost, lost_wait = self._lost_pods(spec, pods, now) if remote is None else ({}, None)
        # A job queued in Kueue: the unit runs only while its Workload is admitted, by its own cluster's Kueue (units
        # that ended are not gated; an ended unit's Workload is marked Finished below).
        queue = kueue.queue_name(job)
        ended = job_finished or old_status.phase in unitplan.TERMINAL_UNIT
        admission = await self.kueue.admission(unit, job, queue, remote) if queue and not ended else None
        if admission is not None and admission.state != "admitted":
            plan = kueue.plan_held(spec, old_status, pods, admission, now, unit["metadata"].get("generation"))
        else:
            spare = (self.spares is not None and remote is None and queue is None
                     and self.spares.usable(unit, job) > 0)
            plan = unitplan.plan_unit(spec, unit["spec"], old_status, pods, now,
                                      generation=unit["metadata"].get("generation"), node_pools=self._pools(pods),
                                      job_finished=job_finished, lost=lost, spare=spare)
            if admission is not None:
                plan.status = kueue.admitted_condition(plan.status, admission, now, unit["metadata"].get("generation"))
        job_state = self.jobs.get(job["metadata"].get("uid") or "")
        shard_readings = list(job_state.syncer_readings.values()) if job_state else []
        last_seen = max((info.learners_seen.get(name) or "" for info in shard_readings), default="") or None
        status = plan.status
        if last_seen:
            status.lastContribution = last_seen
        if status.lastFault and (reading := jobstatus.combine(shard_readings)) is not None:
            # the work the restart's ended learner life took with it, once the syncer can tell (faultwork.py)
            status.lastFault = faultwork.fault_work(status.lastFault, reading.status.learners.get(name),
                                                    reading.status.fragments,
                                                    unit_ended=status.phase in unitplan.TERMINAL_UNIT)
        if remote is not None:
            status.set_conditions(C.set_condition(
                status.condition_dicts(), C.CLUSTER_REACHABLE, True, C.Reason.CLUSTER_REACHABLE,
                f"cluster {spec.cluster} answers (namespace {remote.namespace})", datetime.now(timezone.utc),
                unit["metadata"].get("generation")))
            plan.requeue_after = min(plan.requeue_after or REMOTE_POLL_S, REMOTE_POLL_S)
        return _Decided(plan, pods, queue, admission, lost_wait)

    async def _apply(self, unit: dict, spec: api.LearnerUnitSpec, job: dict, decided: _Decided,
                     pod_objs: dict[str, dict], remote: Remote | None) -> bool:
        """Delete and create the plan's pods (with the objects new pods need: state claims, the unit's Service,
        network policy, token, CA); False when the unit's remote cluster did not answer (its status says so)."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        plan, admission = decided.plan, decided.admission
        kube = remote.kube if remote else self.kube
        flavors: list[dict] = []

        async def delete(pod: str, grace: int | None = None) -> None:
            answer = await kube.delete(PODS, remote.namespace if remote else ns, pod, grace_seconds=grace)
            if remote is None:
                self.cache.deleted(PODS.plural, ns, pod, answer, pod_objs.get(pod))

        async def create(rank: int) -> None:
            if (pvc := O.unit_state_pvc(unit, rank)) is not None:
                await self.writer.ensure(PVCS, pvc, update=False, remote=remote)
            pod = O.unit_pod(unit, plan.status.incarnation, rank)
            if admission is not None:  # on the flavor Kueue chose
                pod = kueue.place(pod, admission, flavors)
            if remote is not None:
                await kube.create(PODS, O.in_remote_cluster(pod, remote.namespace))
            else:
                self.cache.wrote(PODS.plural, await kube.create(PODS, pod))
        try:
            if admission is not None and plan.create:  # read in the unit's cluster: it may not answer
                flavors[:] = await self.kueue.flavors(admission, remote)
            # A pod on a lost node goes at once (grace 0): its kubelet would never confirm a graceful delete.
            await bounded([delete(p, 0) for p in plan.force_delete] + [delete(p) for p in plan.delete])
            if plan.take_spare and await self.spares.take(unit, job, plan.status.incarnation) is None:
                plan.create = [0]  # every spare went to other units meanwhile: a new pod, at once (one pod, no backoff)
                plan.events.append(("Normal", C.Reason.PODS_CREATED, "no warm spare pod was free after all: created "
                                                                     f"pod(s) of incarnation {plan.status.incarnation}"))
            if plan.create:
                if O.needs_unit_service(spec):
                    await self.writer.ensure(SERVICES, O.unit_service(unit), update=False, remote=remote)
                    if remote is None:  # remote clusters: the operator may lack the right there (docs/security.md)
                        await self.writer.ensure(NETWORKPOLICIES, O.unit_network_policy(unit), update=False)
                await self._ensure_unit_token(unit, job, remote)
                if remote is not None and spec.syncerTls:  # the CA its pods verify the syncer against
                    await self.writer.ensure(CONFIGMAPS, O.ca_config_map(job, await self._job_ca(ns, spec.jobName)),
                                             remote=remote)
            await bounded([create(rank) for rank in plan.create])
        except Exception as exc:
            if remote is None or not unreachable(exc):
                raise
            await self._cluster_failed(unit, spec, exc)
            return False
        return True

    async def _record(self, unit: dict, spec: api.LearnerUnitSpec, job: dict, decided: _Decided, written: dict,
                      held: tuple | None, old_status: api.LearnerUnitStatus, remote: Remote | None = None) -> None:
        """Kueue's Workload told (quota back, finished), the status written (a launch's may wait a moment, so one
        write carries both the launch and the pods running), metrics, Events and the next looks."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        plan, admission = decided.plan, decided.admission
        try:
            if admission is not None and admission.state == "evicted" and not decided.pods:  # pods gone: quota back
                await self.kueue.release(ns, name, remote)
            if decided.queue and plan.status.phase in unitplan.TERMINAL_UNIT:
                await self.kueue.finish(ns, name, plan.status.phase, plan.status.message or "", remote)
        except Exception as exc:  # told on a later pass: the status below is still written
            if remote is None or not unreachable(exc):
                raise
            self.remotes.failed(ns, spec.jobName, spec.cluster, f"cluster {spec.cluster}: {exc!r}")
            self.enqueue(("unit", ns, name), REMOTE_RETRY_S)
        patch = None
        now_s = time.monotonic()
        if (plan.create or held) and unitplan.status_may_wait(plan.status, written) and (not held or now_s < held[2]):
            write_by = held[2] if held else now_s + self.first_launch_wait_s
            self.unwritten[(ns, name)] = (unit["metadata"].get("uid"), plan.status, write_by)
            if not held:
                self.enqueue(("unit", ns, name), self.first_launch_wait_s + 0.1)  # after write_by
        else:
            self.unwritten.pop((ns, name), None)
            if (patch := status_patch(written, plan.status.wire())) is not None:
                self.cache.wrote(LEARNERUNITS.plural,
                                 await self.kube.merge_patch(LEARNERUNITS, ns, name, {"status": patch}, "status"))
        if (plan.status.restarts or 0) > (old_status.restarts or 0):
            metrics.UNIT_RESTARTS.labels(ns, spec.jobName).inc()
        await self.writer.events(unit, plan.events)
        if plan.force_delete:
            metrics.PODS_ON_LOST_NODES.labels(ns, spec.jobName).inc(len(plan.force_delete))
            await self.writer.events(job, [(t, r, f"unit {name}: {m}") for t, r, m in plan.events
                                           if r == C.Reason.NODE_LOST])
        if plan.requeue_after is not None:
            self.enqueue(("unit", ns, name), plan.requeue_after)
        if decided.lost_wait is not None:  # a node not Ready for nodeLostSeconds yet: look again once it will have been
            self.enqueue(("unit", ns, name), decided.lost_wait + 0.1)
        if patch:  # the job's status is computed from its units': let it follow at once
            self.enqueue(("job", ns, spec.jobName))

    async def _ensure_unit_token(self, unit: dict, job: dict, remote: Remote | None = None) -> None:
        """The unit's own learner token Secret (created once). A Secret of that name owned by anything else is
        never used: the reconcile fails, saying so, rather than hand the unit someone else's credential. A unit
        in a remote cluster gets it there (its owner is then named by annotation: O.in_remote_cluster)."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        secret_name = O.unit_token_secret_name(name)
        key = (SECRETS.plural, ns, secret_name, unit["metadata"].get("uid", "")) + ((remote.cluster,) if remote else ())
        if (done := self.writer.ensured.get(key)) and time.monotonic() - done[1] < self.writer.ensure_ttl_s:
            return
        job_token = await self.poller.job_token(self.jobs.of(job))
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
        self.writer.ensured[key] = ("", time.monotonic())
