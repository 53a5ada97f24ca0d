"""Warm spare pods at run time (objects/spares.py builds them): the job's pass keeps each template's count, and a
unit whose pod died takes one over instead of creating a pod that must start Python and import torch first."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco_trainer.protocol.assignment import Assignment, encode_key, seal, spare_key
from diloco_trainer.protocol.tokens import learner_token

from diloco_kube.client import PODS, SECRETS, ApiError, Kube
from diloco_kube.pod_phase import effective_phase
from diloco_operator import metrics
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.objects import spares as S
from diloco_operator.plan import kueue, unitplan
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.jobstate import JobStates
from diloco_operator.reconcile.syncer_poller import SyncerPoller
from diloco_operator.reconcile.writes import Writer, bounded

log = logging.getLogger("diloco_operator")
FAILED_SPARE_RETRY_S = 30.0  # a template whose spare failed gets a new one only this long after (no hot loop)


class SparePods:
    """`keep(job, spec, finished)`: each template's spares, no more, none stale; `take(unit, job, incarnation)`: a
    spare becomes the unit's pod, or None when none could."""

    def __init__(self, kube: Kube, cache: Cache, writer: Writer, jobs: JobStates, poller: SyncerPoller,
                 enqueue: Callable[..., None]):
        self.kube, self.cache, self.writer, self.jobs, self.poller, self.enqueue = \
            kube, cache, writer, jobs, poller, enqueue
        self.failed_at: dict[tuple[str, str, str], float] = {}  # (ns, job, template) -> when a spare last failed

    async def keep(self, job: dict, spec: api.DilocoJobSpec, finished: bool) -> int | None:
        """Create and delete spare pods; the spares running and free now (the job's status.sparesWaiting), None when
        no template keeps any."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        wanted = S.spares_wanted(spec, kueue.queue_name(job) is not None, finished)
        want_hash = {t.name: S.spare_hash(S.spare_template_spec(name, spec, t)) for t in spec.units if t.name in wanted}
        have = {t: 0 for t in wanted}
        running = {True: 0, False: 0}  # kept spares, running or not yet
        delete: list[tuple[str, dict]] = []
        now = time.monotonic()
        for pod in self._spares(job):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            template = (meta.get("labels") or {}).get(O.LABEL_TEMPLATE, "")
            phase = effective_phase(pod)
            if phase in ("Failed", "Succeeded"):
                self.failed_at[(ns, name, template)] = now
                log.warning("spare pod %s/%s ended (%s): replacing it in %gs", ns, meta["name"], phase,
                            FAILED_SPARE_RETRY_S)
            if (template not in wanted or phase in ("Failed", "Succeeded") or have[template] >= wanted[template]
                    or (meta.get("annotations") or {}).get(S.ANNOTATION_SPARE_HASH) != want_hash[template]):
                delete.append((meta["name"], pod))
            else:
                have[template] += 1
                running[phase == "Running"] += 1
        if running[True]:  # a unit whose pod cannot be placed takes a spare that runs (unitplan: its place)
            self._wake_unplaceable_units(ns, name)
        metrics.SPARE_PODS.labels(ns, name, "waiting").set(running[True])
        metrics.SPARE_PODS.labels(ns, name, "starting").set(running[False])
        create: list[api.UnitTemplate] = []
        for t in spec.units:
            if t.name not in wanted:
                continue
            wait = self.failed_at.get((ns, name, t.name), -FAILED_SPARE_RETRY_S) + FAILED_SPARE_RETRY_S - now
            if wait > 0 and wanted[t.name] > have[t.name]:
                self.enqueue(("job", ns, name), wait + 0.1)
                continue
            create += [t] * (wanted[t.name] - have[t.name])
        if create:
            job_token = await self.poller.job_token(self.jobs.of(job))
            if not job_token:
                raise RuntimeError(f"the token Secret of job {name} is not there yet")
            await self.writer.ensure(SECRETS, S.spare_key_secret(job, encode_key(spare_key(job_token, name))),
                                     update=False)

        async def remove(pod_name: str, last: dict) -> None:
            self.cache.deleted(PODS.plural, ns, pod_name, await self.kube.delete(PODS, ns, pod_name), last)

        async def add(template: api.UnitTemplate) -> None:
            pod = S.spare_pod(job, S.spare_template_spec(name, spec, template))
            self.cache.wrote(PODS.plural, await self.kube.create(PODS, pod))
        await bounded([remove(n, p) for n, p in delete] + [add(t) for t in create])
        return running[True] if wanted else None

    def _spares(self, job: dict) -> list[dict]:
        """The job's spare pods: those its ownerReference makes the job's, not any pod with a spare's labels (a pod
        author's pod is never counted, deleted or handed a unit's assignment)."""
        ns, uid = job["metadata"]["namespace"], job["metadata"].get("uid")
        return [p for p in self.cache.spare_pods(ns, job["metadata"]["name"]) if O.controlled_by(p, uid)]

    def _wake_unplaceable_units(self, ns: str, job_name: str) -> None:
        """Look again at the job's units whose pod the scheduler refused: a spare that runs now may take its place."""
        for lu in self.cache.units_of_job(ns, job_name):
            unit = lu["metadata"]["name"]
            if any(unitplan.pod_view(p).unschedulable for p in self.cache.pods_of_unit(ns, unit, O.LABEL_UNIT)):
                self.enqueue(("unit", ns, unit))

    def _usable(self, unit: dict, job: dict) -> list[dict]:
        """The spares that can become `unit`'s pod now (spares.usable_spares), none on a node that is not Ready."""
        ns = unit["metadata"]["namespace"]
        pods = self._spares(job)
        if not pods:  # most jobs keep none: no spec hash computed on every unit pass
            return []
        found = S.usable_spares(pods, unit["spec"])
        return [p for p in found if self._node_ready((p.get("spec") or {}).get("nodeName"))]

    def _node_ready(self, name: str | None) -> bool:
        node = self.cache.node(name) if name and self.cache.watches_nodes else None
        if node is None:
            return True  # not watched (a namespaced install): the kubelet answers for it
        return C.is_true((node.get("status") or {}).get("conditions"), C.READY)

    def usable(self, unit: dict, job: dict) -> int:
        return len(self._usable(unit, job))

    async def take(self, unit: dict, job: dict, incarnation: int) -> str | None:
        """Make a usable spare pod rank 0 of `unit`'s incarnation `incarnation` (one patch: labels, owner, the
        sealed assignment); its name, or None when no spare was free (another unit took the last, or none is up)."""
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        job_name = job["metadata"]["name"]
        candidates = self._usable(unit, job)
        if not candidates:
            return None
        spec = api.LearnerUnitSpec.model_validate(unit["spec"])
        job_token = await self.poller.job_token(self.jobs.of(job))
        if not job_token:
            return None
        key = spare_key(job_token, job_name)
        assignment = Assignment(name, spec.unitIndex, spec.shards or spec.unitIndex + 1,
                                learner_token(job_token, name, O.token_epoch(unit)))
        for pod in candidates:
            pod_name = pod["metadata"]["name"]
            patch = S.takeover_patch(pod, unit, incarnation, seal(key, pod_name, assignment))
            try:
                answer = await self.kube.merge_patch(PODS, ns, pod_name, patch)
            except ApiError as exc:
                if exc.status in (404, 409):  # gone, or taken by another unit first: the next one
                    continue
                raise
            self.cache.wrote(PODS.plural, answer)
            metrics.SPARE_TAKEOVERS.labels(ns, job_name).inc()
            self.enqueue(("job", ns, job_name))  # a new spare behind it
            return pod_name
        return None
