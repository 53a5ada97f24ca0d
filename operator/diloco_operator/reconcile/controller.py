"""The operator's I/O shell, assembled: the work queue (workqueue.py) fed by kopf's watch events and a resync, and
the reconcilers it runs: jobs (job_reconciler.py), units (unit_reconciler.py), beside the syncer poller
(syncer_poller.py). Each job's memory is one JobState keyed by its UID (jobstate.py)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from diloco_kube.client import ApiError, Kube
from diloco_operator.objects import builders as O
from diloco_operator.plan import nodeloss
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.job_reconciler import JobReconciler
from diloco_operator.reconcile.job_remote import JobRemote
from diloco_operator.reconcile.jobstate import JobStates
from diloco_operator.reconcile.kueue_gate import KueueGate
from diloco_operator.reconcile.syncer_poller import SyncerPoller
from diloco_operator.reconcile.spare_pods import SparePods
from diloco_operator.reconcile.unit_reconciler import UnitReconciler
from diloco_operator.reconcile.workqueue import Key, WorkQueue
from diloco_operator.reconcile.writes import Writer
from diloco_operator.remote.clusters import RemoteClusters

log = logging.getLogger("diloco_operator")


class Controller:
    """Reconciles DilocoJobs and LearnerUnits from a queue fed by watch events and a periodic resync."""

    def __init__(self, kube: Kube, cache: Cache, workers: int = 4, resync_s: float = 30.0,
                 ensure_ttl_s: float = 300.0, first_launch_wait_s: float = 5.0, trust_syncer_url: bool = False,
                 operator_namespace: str | None = None):
        self.kube = kube
        self.cache = cache
        self.workers, self.resync_s = workers, resync_s
        self.writer = Writer(kube, cache, ensure_ttl_s)
        self.queue = WorkQueue(self._reconcile, workers, resync_s, gives_up=self._gives_up,
                               on_resync=self.writer.prune)
        self.jobs = JobStates()  # what is remembered of each job, by its UID
        self.remotes = RemoteClusters(kube)
        self.poller = SyncerPoller(kube, self.jobs, self.enqueue, trust_syncer_url)
        remote = JobRemote(kube, cache, self.remotes, self.jobs, self.writer, self.enqueue)
        spares = SparePods(kube, cache, self.writer, self.jobs, self.poller, self.enqueue)  # spec.units[].spares
        self.job_reconciler = JobReconciler(kube, cache, self.writer, self.jobs, self.poller, remote, self.remotes,
                                            self.enqueue, self.forget, operator_namespace, trust_syncer_url, spares)
        self.kueue = KueueGate(kube, cache, self.writer.ensure)  # units of jobs queued in Kueue (kueue.py)
        self.units = UnitReconciler(kube, cache, self.writer, self.jobs, self.poller, self.remotes, self.kueue,
                                    self.enqueue, self.forget, first_launch_wait_s, spares)

    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        """Ask for a reconcile of `key` (now or after `delay` seconds); duplicates coalesce."""
        self.queue.add(key, delay)

    def forget(self, key: Key) -> None:
        self.queue.forget(key)

    def enqueue_jobs(self) -> None:
        """Re-queue every known job (a Node changed: capacity for the autoscaler)."""
        for key in self.queue.known_of("job"):
            self.enqueue(key)

    def node_changed(self, node: dict) -> None:
        """A Node changed: a node not Ready has its units looked at (each then waits out nodeLostSeconds by a
        delayed requeue); a Ready one is forgotten as down."""
        name = node["metadata"]["name"]
        if nodeloss.not_ready(node, datetime.now(timezone.utc)) is None:
            self.units.node_down_since.pop(name, None)
            return
        for pod in self.cache.all_pods():
            if (pod.get("spec") or {}).get("nodeName") == name:
                unit = (pod["metadata"].get("labels") or {}).get(O.LABEL_UNIT)
                if unit:
                    self.enqueue(("unit", pod["metadata"]["namespace"], unit))

    async def run(self) -> None:
        """Run the queue's workers and its resync loop until cancelled."""
        await self.queue.run()

    async def _reconcile(self, key: Key) -> None:
        if key[0] == "job":
            await self.job_reconciler.reconcile(key[1], key[2])
        else:
            await self.units.reconcile(key[1], key[2])

    @staticmethod
    def _gives_up(key: Key, exc: Exception) -> bool:
        if isinstance(exc, ApiError) and exc.namespace_terminating:
            log.debug("namespace of %s is being deleted; nothing to reconcile", key)
            return True
        return False
