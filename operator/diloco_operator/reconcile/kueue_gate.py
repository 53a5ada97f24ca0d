"""The Kueue side of a unit's reconcile (I/O; the decisions are kueue.py's): the unit's Workload ensured, Kueue's
answer read from the watched Workloads, ResourceFlavors and WorkloadPriorityClasses read (kept briefly), an evicted
Workload's quota handed back, a finished unit's Workload marked Finished. A unit in a remote cluster (spec.clusters)
is admitted by that cluster's Kueue: its Workload is created and read there (not watched: the unit is polled)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from diloco_kube.client import RESOURCEFLAVORS, WORKLOADPRIORITYCLASSES, WORKLOADS, ApiError, Kube
from diloco_operator.api import conditions as C
from diloco_operator.objects import builders as O
from diloco_operator.plan import kueue
from diloco_operator.reconcile.cache import Cache
from diloco_operator.remote.clusters import Remote

CLUSTER_OBJECT_TTL_S = 30.0  # flavors and priority classes change rarely: read again at most this often


class KueueGate:
    """Admission of units through Kueue, for the controller (one per operator)."""

    def __init__(self, kube: Kube, cache: Cache, ensure: Callable[..., Awaitable[dict]]):
        self.kube = kube
        self.cache = cache
        self.ensure = ensure  # Writer.ensure (writes.py): create-if-missing against the watched copy
        # (cluster or "", plural, name) -> (object, when)
        self.read: dict[tuple[str, str, str], tuple[dict | None, float]] = {}

    async def _cluster_object(self, res, name: str, remote: Remote | None = None) -> dict | None:
        key = (remote.cluster if remote else "", res.plural, name)
        cached = self.read.get(key)
        if cached is None or time.monotonic() - cached[1] >= CLUSTER_OBJECT_TTL_S:
            kube = remote.kube if remote else self.kube
            cached = self.read[key] = (await kube.get(res, None, name), time.monotonic())
        return cached[0]

    async def _workload(self, ns: str, name: str, remote: Remote | None) -> dict | None:
        """The unit's Workload: the watched copy at home, read from its remote cluster otherwise."""
        if remote is None:
            return self.cache.workload(ns, name) if self.cache.watches_workloads else None
        return await remote.kube.get(WORKLOADS, remote.namespace, name)

    async def admission(self, unit: dict, job: dict, queue: str, remote: Remote | None = None) -> kueue.Admission:
        """Kueue's answer for `unit` of a job queued in `queue` (the LocalQueue of that name in the unit's cluster),
        its Workload created first if missing."""
        if not self.cache.watches_workloads:
            return kueue.Admission("pending", f"the job is queued in Kueue ({kueue.QUEUE_LABEL}={queue}) and the "
                                   "operator runs without --kueue: its units wait", C.Reason.KUEUE_DISABLED)
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        where = f" in cluster {remote.cluster}" if remote else ""
        try:
            current = await self._workload(ns, name, remote)
            if current is None:
                priority = None
                if (pc := kueue.priority_class(job)) is not None:
                    found = await self._cluster_object(WORKLOADPRIORITYCLASSES, pc, remote)
                    if found is None:
                        return kueue.Admission("pending", f"WorkloadPriorityClass {pc} ({kueue.PRIORITY_LABEL} on "
                                               f"the job) does not exist{where}", C.Reason.QUEUED_IN_KUEUE)
                    priority = (pc, int(found.get("value", 0)))
                desired = kueue.unit_workload(unit, queue, O.unit_pod(unit, 0, 0), priority)
                current = await self._create(desired, remote)
        except ApiError as exc:
            if remote is None or exc.status != 404:
                raise
            # The kind itself is unknown there: that cluster runs no Kueue. Its quota cannot be asked for.
            return kueue.Admission("pending", f"the job is queued in Kueue ({kueue.QUEUE_LABEL}={queue}) and "
                                   f"cluster {remote.cluster} has no Kueue (no Workload API there): the unit waits",
                                   C.Reason.KUEUE_DISABLED)
        return kueue.read_admission(current, queue)

    async def _create(self, desired: dict, remote: Remote | None) -> dict:
        if remote is None:
            return await self.ensure(WORKLOADS, desired, update=False, cached=None)
        desired = O.in_remote_cluster(desired, remote.namespace)
        meta = desired["metadata"]
        current = await remote.kube.create(WORKLOADS, desired) or \
            await remote.kube.get(WORKLOADS, meta["namespace"], meta["name"]) or desired
        if not O.same_controller(desired, current):
            raise RuntimeError(f"Workload {meta['namespace']}/{meta['name']} in cluster {remote.cluster} exists "
                               "and is not this unit's: not using its admission")
        return current

    async def flavors(self, admission: kueue.Admission, remote: Remote | None = None) -> list[dict]:
        """The ResourceFlavors Kueue assigned (a flavor deleted since is left out: Kueue would not admit on it)."""
        found = [await self._cluster_object(RESOURCEFLAVORS, f, remote) for f in admission.flavors]
        return [f for f in found if f is not None]

    async def _patch_status(self, wl: dict, patch: dict, remote: Remote | None) -> None:
        ns, name = wl["metadata"]["namespace"], wl["metadata"]["name"]
        if remote is not None:
            await remote.kube.merge_patch(WORKLOADS, ns, name, patch, "status")
        else:
            self.cache.wrote(WORKLOADS.plural, await self.kube.merge_patch(WORKLOADS, ns, name, patch, "status"))

    async def release(self, ns: str, name: str, remote: Remote | None = None) -> None:
        """Hand an evicted Workload's quota back (its pods are gone), so Kueue can queue it again."""
        wl = await self._workload(ns, name, remote)
        if wl is None or not (wl.get("status") or {}).get("admission"):
            return
        await self._patch_status(wl, kueue.release_status(wl, datetime.now(timezone.utc)), remote)

    async def finish(self, ns: str, name: str, phase: str, message: str, remote: Remote | None = None) -> None:
        """Mark the Workload of a unit that ended Finished: Kueue frees its quota."""
        wl = await self._workload(ns, name, remote)
        if wl is None or (patch := kueue.finished_status(wl, phase, message, datetime.now(timezone.utc))) is None:
            return
        await self._patch_status(wl, patch, remote)
