"""The operator's per-job memory is one JobState keyed by the job's UID: handling a job's deletion forgets all of it
in one place, and a job re-created under an old name never starts from what was read for the old one."""

from __future__ import annotations

import asyncio

from kubernetes import client as k8s

from diloco_kube.client import Kube
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.controller import Controller
from diloco_operator.reconcile.jobstate import JobStates, SyncerTls, TlsRead


def job(name: str, uid: str, **meta) -> dict:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoJob",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "1", **meta}, "spec": {}}


def remember_everything(states: JobStates, obj: dict) -> None:
    """What reconciles and polls leave behind for a running job."""
    state = states.of(obj)
    state.token, state.epochs = "secret-token", {"demo-cpu-0": {"epoch": 1, "live": True}}
    state.tls = TlsRead("Auto", "demo-syncer-tls", SyncerTls(secret="demo-syncer-tls"), 1.0)
    state.syncer_polled["https://demo-syncer.ns.svc:8080"] = 1.0
    state.swept_at, state.remote_room["far"] = 1.0, ({"gpu": 2}, 1.0)


def reconcile_with(jobs_index: dict, setup) -> Controller:
    async def go() -> Controller:
        kube = Kube(k8s.ApiClient())
        try:
            controller = Controller(kube, Cache({"jobs": jobs_index}))
            setup(controller)
            await controller.job_reconciler.reconcile("ns", "demo")
            return controller
        finally:
            kube.close()
    return asyncio.run(go())


def test_handling_a_deleted_jobs_removal_leaves_no_state_of_it():
    def setup(controller: Controller) -> None:
        remember_everything(controller.jobs, job("demo", "uid-1"))
        remember_everything(controller.jobs, job("other", "uid-2"))
        controller.queue.known.add(("job", "ns", "demo"))
    controller = reconcile_with({}, setup)  # gone from the watch cache
    assert list(controller.jobs.by_uid) == ["uid-2"]  # only the other job's
    assert ("job", "ns", "demo") not in controller.queue.known


def test_a_job_being_deleted_without_finalizer_is_forgotten_before_it_is_gone():
    deleting = job("demo", "uid-1", deletionTimestamp="2026-01-01T00:00:00Z")
    controller = reconcile_with({("ns", "demo"): [deleting]},
                                lambda c: remember_everything(c.jobs, deleting))
    assert len(controller.jobs) == 0


def test_a_job_recreated_under_its_old_name_starts_from_nothing():
    states = JobStates()
    remember_everything(states, job("demo", "uid-old"))
    fresh = states.of(job("demo", "uid-new"))
    assert fresh.token is None and fresh.epochs is None and fresh.tls is None and not fresh.syncer_readings
    assert list(states.by_uid) == ["uid-new"]  # the old job's state went with it
    assert states.get("uid-old") is None and states.of(job("demo", "uid-new")) is fresh
