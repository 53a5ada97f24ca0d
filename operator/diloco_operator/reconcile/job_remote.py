"""A job's objects in remote clusters (spec.clusters): ownerReferences do not cross clusters, so the operator removes
them itself: those of removed units (a sweep), all of them before the job goes (a finalizer); and the room there."""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import ValidationError

from diloco_kube.client import (CONFIGMAPS, DILOCOJOBS, NODES, PODS, PVCS, SECRETS, SERVICES, WORKLOADS, ApiError,
                                  Kube, Resource)
from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.plan import autoscale
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.jobstate import JobStates
from diloco_operator.reconcile.writes import Writer
from diloco_operator.remote.clusters import ClusterUnavailable, Remote, RemoteClusters, unreachable, why_failed

REMOTE_POLL_S = 5.0  # a unit in a remote cluster is looked at this often (its pods there are listed, not watched)
REMOTE_RETRY_S = 10.0  # after a remote cluster did not answer
REMOTE_SWEEP_S = 15.0  # a job's objects left in a remote cluster by removed units are swept at most this often
FINALIZER = "diloco.dev/remote-cleanup"  # a job with spec.clusters: its objects there are removed before it goes


class JobRemote:
    """The remote-cluster side of a job reconcile (clients from `remotes`, remembered per job in `jobs`)."""

    def __init__(self, kube: Kube, cache: Cache, remotes: RemoteClusters, jobs: JobStates, writer: Writer,
                 enqueue: Callable[..., None]):
        self.kube = kube
        self.cache = cache
        self.remotes = remotes
        self.jobs = jobs
        self.writer = writer
        self.enqueue = enqueue

    async def finalizer(self, job: dict, want: bool) -> None:
        """Hold the job's deletion (a finalizer) while it may have objects in remote clusters: ownerReferences do
        not cross clusters, so the operator removes them itself (cleanup_and_release)."""
        meta = job["metadata"]
        have = FINALIZER in (meta.get("finalizers") or [])
        if have == want:
            return
        finalizers = [f for f in meta.get("finalizers") or [] if f != FINALIZER] + ([FINALIZER] if want else [])
        self.cache.wrote(DILOCOJOBS.plural, await self.kube.merge_patch(DILOCOJOBS, meta["namespace"], meta["name"], {
            "metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}))

    async def _objects(self, remote: Remote, job: str) -> list[tuple[Resource, dict]]:
        out = []
        for res in (PODS, SERVICES, SECRETS, CONFIGMAPS, PVCS, WORKLOADS):
            try:
                out += [(res, o) for o in await remote.kube.list(res, remote.namespace, f"{O.LABEL_JOB}={job}")]
            except ApiError as exc:
                if not (res is WORKLOADS and exc.status == 404):  # a cluster without Kueue has no Workloads
                    raise
        return out

    async def free(self, job: dict, spec: api.DilocoJobSpec) -> dict[str, int | None]:
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

    async def _delete(self, job: dict, spec: api.DilocoJobSpec, keep: set[str] | None) -> list[str]:
        """Delete the job's objects in every remote cluster (those of units not in `keep`; everything when `keep` is
        None); returns why each cluster that could not be cleaned could not."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        failed = []
        for cluster in spec.clusters:
            try:
                remote = await self.remotes.get(ns, name, cluster)
                for res, obj in await self._objects(remote, name):
                    unit = (obj["metadata"].get("labels") or {}).get(O.LABEL_UNIT)
                    if keep is None or (unit is not None and unit not in keep):
                        await remote.kube.delete(res, remote.namespace, obj["metadata"]["name"])
                self.remotes.answered(ns, name, cluster.name)
            except Exception as exc:
                if not (isinstance(exc, ClusterUnavailable) or unreachable(exc)):
                    raise
                self.remotes.failed(ns, name, cluster.name, f"cluster {cluster.name}: {exc}")
                failed.append(why_failed(f"cluster {cluster.name}: {exc}"))
        return failed

    async def sweep_orphans(self, job: dict, spec: api.DilocoJobSpec, units: set[str]) -> None:
        """Remove what units that no longer exist left in remote clusters (scaled down, deleted by hand): at home
        the garbage collector does that; there nobody else would. At most every REMOTE_SWEEP_S per job."""
        state = self.jobs.of(job)
        if time.monotonic() - state.swept_at < REMOTE_SWEEP_S:
            return
        state.swept_at = time.monotonic()
        await self._delete(job, spec, keep=units)

    async def cleanup_and_release(self, job: dict) -> None:
        """A job being deleted: remove its objects in every remote cluster, then its finalizer. A cluster that
        cannot be reached keeps the job (Warning Event, retried); removing the finalizer by hand gives up on it."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        try:
            spec = api.DilocoJobSpec.model_validate(job["spec"])
        except ValidationError:
            spec = None
        failed = await self._delete(job, spec, keep=None) if spec is not None else []
        if failed:
            await self.writer.events(job, [("Warning", C.Reason.REMOTE_CLEANUP_FAILED,
                                            "cannot remove the job's objects in " + "; ".join(failed)
                                            + f" (retrying; remove the finalizer {FINALIZER} to give up on them)")])
            self.enqueue(("job", ns, name), REMOTE_RETRY_S)
            return
        if spec is not None and spec.clusters:
            await self.writer.events(job, [("Normal", C.Reason.REMOTE_CLEANUP, "removed the job's objects in clusters "
                                            + ", ".join(c.name for c in spec.clusters))])
        await self.finalizer(job, want=False)
