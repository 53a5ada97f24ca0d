"""The Kueue side of a unit's reconcile (I/O; the decisions are kueue.py's): the unit's Workload ensured, Kueue's
answer read from the watched Workloads, ResourceFlavors and WorkloadPriorityClasses read (kept briefly), an evicted
Workload's quota handed back, a finished unit's Workload marked Finished."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from diloco_kube.client import RESOURCEFLAVORS, WORKLOADPRIORITYCLASSES, WORKLOADS, Kube
from diloco_operator.api import conditions as C
from diloco_operator.objects import builders as O
from diloco_operator.plan import kueue
from diloco_operator.reconcile.cache import Cache

CLUSTER_OBJECT_TTL_S = 30.0  # flavors and priority classes change rarely: read again at most this often


class KueueGate:
    """Admission of units through Kueue, for the controller (one per operator)."""

    def __init__(self, kube: Kube, cache: Cache, ensure: Callable[..., Awaitable[dict]]):
        self.kube = kube
        self.cache = cache
        self.ensure = ensure  # Writer.ensure (writes.py): create-if-missing against the watched copy
        self.read: dict[tuple[str, str], tuple[dict | None, float]] = {}  # (plural, name) -> (object, when)

    async def _cluster_object(self, res, name: str) -> dict | None:
        key = (res.plural, name)
        cached = self.read.get(key)
        if cached is None or time.monotonic() - cached[1] >= CLUSTER_OBJECT_TTL_S:
            cached = self.read[key] = (await self.kube.get(res, None, name), time.monotonic())
        return cached[0]

    async def admission(self, unit: dict, job: dict, queue: str) -> kueue.Admission:
        """Kueue's answer for `unit` of a job queued in `queue`, its Workload created first if missing."""
        if not self.cache.watches_workloads:
            return kueue.Admission("pending", f"the job is queued in Kueue ({kueue.QUEUE_LABEL}={queue}) and the "
                                   "operator runs without --kueue: its units wait", C.Reason.KUEUE_DISABLED)
        ns, name = unit["metadata"]["namespace"], unit["metadata"]["name"]
        current = self.cache.workload(ns, name)
        if current is None:
            priority = None
            if (pc := kueue.priority_class(job)) is not None:
                found = await self._cluster_object(WORKLOADPRIORITYCLASSES, pc)
                if found is None:
                    return kueue.Admission("pending", f"WorkloadPriorityClass {pc} ({kueue.PRIORITY_LABEL} on the "
                                           "job) does not exist", C.Reason.QUEUED_IN_KUEUE)
                priority = (pc, int(found.get("value", 0)))
            desired = kueue.unit_workload(unit, queue, O.unit_pod(unit, 0, 0), priority)
            current = await self.ensure(WORKLOADS, desired, update=False, cached=None)
        return kueue.read_admission(current, queue)

    async def flavors(self, admission: kueue.Admission) -> list[dict]:
        """The ResourceFlavors Kueue assigned (a flavor deleted since is left out: Kueue would not admit on it)."""
        found = [await self._cluster_object(RESOURCEFLAVORS, f) for f in admission.flavors]
        return [f for f in found if f is not None]

    async def release(self, ns: str, name: str) -> None:
        """Hand an evicted Workload's quota back (its pods are gone), so Kueue can queue it again."""
        wl = self.cache.workload(ns, name)
        if wl is None or not (wl.get("status") or {}).get("admission"):
            return
        patch = kueue.release_status(wl, datetime.now(timezone.utc))
        self.cache.wrote(WORKLOADS.plural, await self.kube.merge_patch(WORKLOADS, ns, name, patch, "status"))

    async def finish(self, ns: str, name: str, phase: str, message: str) -> None:
        """Mark the Workload of a unit that ended Finished: Kueue frees its quota."""
        wl = self.cache.workload(ns, name) if self.cache.watches_workloads else None
        if wl is None or (patch := kueue.finished_status(wl, phase, message, datetime.now(timezone.utc))) is None:
            return
        self.cache.wrote(WORKLOADS.plural, await self.kube.merge_patch(WORKLOADS, ns, name, patch, "status"))
