"""The kopf side of the operator: watch DilocoJobs, LearnerUnits, learner and syncer pods, syncer Deployments and Nodes,
keep them in kopf indexes (the controller's cache) and feed the controller's queue. Run as
`kopf run -m diloco_operator.handlers` (what `diloco operator` does)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os

import kopf
from prometheus_client import start_http_server

from diloco_kube.client import Kube
from diloco_kube.labels import LABEL_SPARE
from diloco_operator.api import models as api
from diloco_operator.kopf_bodies import SlimDiffBaseStorage, tree_copy
from diloco_operator.objects import builders as O
from diloco_operator.reconcile.cache import Cache
from diloco_operator.reconcile.chaosrun import run_job_chaos
from diloco_operator.reconcile.controller import Controller


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                  diloco_jobs: kopf.Index, diloco_units: kopf.Index, diloco_pods: kopf.Index,
                  diloco_deployments: kopf.Index, **indexes) -> None:
    # Watches end and restart on their own: a silently stalled stream can never hide changes for long.
    settings.watching.server_timeout = int(_env_float("DILOCO_WATCH_SERVER_TIMEOUT", 120))  # sent as ?timeoutSeconds=
    settings.watching.client_timeout = _env_float("DILOCO_WATCH_CLIENT_TIMEOUT", 150)
    settings.watching.connect_timeout = 10
    settings.watching.inactivity_timeout = 70
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    # Server-side filtering: the operator never streams pods or Deployments that are not its own.
    # Learner pods (healing) and syncer pods (a syncer that refuses its run says why in its termination message).
    settings.watching.label_selectors["", "v1", "pods"] = f"{O.LABEL_COMPONENT} in (learner,syncer)"
    settings.watching.label_selectors["apps", "v1", "deployments"] = f"{O.LABEL_COMPONENT}=syncer"
    settings.watching.label_selectors["kueue.x-k8s.io", "v1beta2", "workloads"] = O.LABEL_UNIT  # only units' (--kueue)
    # kopf's diff base is built on every event of every watched kind; ours skips its deep copy of whole bodies.
    settings.persistence.diffbase_storage = SlimDiffBaseStorage()
    settings.posting.level = logging.WARNING  # our own Events carry the decisions; kopf posts only its errors
    settings.peering.standalone = True  # one replica (Deployment with Recreate); no peering objects needed
    # The CRDs are installed before the operator starts and the namespaces are given by name (or all): no
    # cluster-wide list/watch of CRDs or namespaces, so a namespaced install needs no cluster-scoped rights.
    settings.scanning.disabled = True
    # Every API call and every watch event would otherwise be an INFO line; decisions are logged by the controller.
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = await Kube.connect()
    cache = Cache({"jobs": diloco_jobs, "units": diloco_units, "pods": diloco_pods,
                   "deployments": diloco_deployments,
                   **({"nodes": indexes["diloco_nodes"]} if "diloco_nodes" in indexes else {}),
                   **({"workloads": indexes["diloco_workloads"]} if "diloco_workloads" in indexes else {})})
    controller = Controller(kube, cache, workers=int(_env_float("DILOCO_OPERATOR_WORKERS", 16)),
                            resync_s=_env_float("DILOCO_OPERATOR_RESYNC_SECONDS", 30),
                            trust_syncer_url=os.environ.get("DILOCO_OPERATOR_TRUST_SYNCER_URL") == "1",
                            operator_namespace=os.environ.get("POD_NAMESPACE") or None)
    memo["controller"] = controller
    memo["task"] = asyncio.create_task(controller.run(), name="diloco-controller")
    port = int(_env_float("DILOCO_OPERATOR_METRICS_PORT", 0))
    if port:
        start_http_server(port)
    logger.info("diloco operator started (workers=%d, resync=%.0fs, metrics port %s)",
                controller.workers, controller.resync_s, port or "off")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    task = memo.get("task")
    if task:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if "controller" in memo:
        memo["controller"].kube.close()


# --- the cache: kopf indexes (kopf lists and indexes every kind before it runs any event handler) ---------------
def _snapshot(body: kopf.Body) -> dict:
    return tree_copy(body)


@kopf.index(api.GROUP, api.VERSION, "dilocojobs")
def diloco_jobs(body: kopf.Body, namespace: str, name: str, **_) -> dict:
    return {(namespace, name): _snapshot(body)}


@kopf.index(api.GROUP, api.VERSION, "learnerunits")
def diloco_units(body: kopf.Body, namespace: str, name: str, **_) -> dict:
    obj = _snapshot(body)
    return {("name", namespace, name): obj, ("job", namespace, obj.get("spec", {}).get("jobName")): obj}


def _ours(value: str | None, **_) -> bool:
    return value in ("learner", "syncer")


@kopf.index("", "v1", "pods", labels={O.LABEL_COMPONENT: _ours})
def diloco_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_) -> dict:
    """Learner pods by (namespace, unit); syncer pods by ("syncer", namespace, job); spare pods (not a unit's yet) by
    ("spare", namespace, job)."""
    if labels.get(O.LABEL_COMPONENT) == "syncer":
        return {("syncer", namespace, labels.get(O.LABEL_JOB)): _snapshot(body)}
    if labels.get(LABEL_SPARE):
        return {("spare", namespace, labels.get(O.LABEL_JOB)): _snapshot(body)}
    return {(namespace, labels.get(O.LABEL_UNIT)): _snapshot(body)}


@kopf.index("apps", "v1", "deployments", labels={O.LABEL_COMPONENT: "syncer"})
def diloco_deployments(body: kopf.Body, namespace: str, labels: kopf.Labels, **_) -> dict:
    return {(namespace, labels.get(O.LABEL_JOB)): _snapshot(body)}


def diloco_nodes(body: kopf.Body, name: str, **_) -> dict:
    return {name: {"metadata": {"name": name, "labels": dict(body.get("metadata", {}).get("labels") or {}),
                                "resourceVersion": body.get("metadata", {}).get("resourceVersion")},
                   "spec": tree_copy(body.get("spec") or {}),
                   "status": {k: tree_copy(body.get("status", {}).get(k))
                              for k in ("allocatable", "capacity", "conditions")}}}


def _key(kind: str, body: kopf.Body) -> tuple[str, str, str]:
    return kind, body["metadata"]["namespace"], body["metadata"]["name"]


def _observed(memo: kopf.Memo, plural: str, event: dict, body: kopf.Body) -> None:
    """The cache's own writes stop shadowing what the watch has now delivered (kopf indexes before it runs these)."""
    memo["controller"].cache.observed(plural, event.get("type"), body)


@kopf.on.event(api.GROUP, api.VERSION, "dilocojobs")
async def job_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _observed(memo, "dilocojobs", event, body)
    if event.get("type") != "DELETED":
        memo["controller"].enqueue(_key("job", body))


@kopf.on.event(api.GROUP, api.VERSION, "learnerunits")
async def unit_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    controller: Controller = memo["controller"]
    _observed(memo, "learnerunits", event, body)
    ns = body["metadata"]["namespace"]
    job = body.get("spec", {}).get("jobName")
    if event.get("type") != "DELETED":
        controller.enqueue(_key("unit", body))
    if job:  # unit added, changed or gone: the job's counts and conditions follow
        controller.enqueue(("job", ns, job))


@kopf.on.event("", "v1", "pods", labels={O.LABEL_COMPONENT: _ours})
async def pod_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _observed(memo, "pods", event, body)
    labels = body["metadata"].get("labels", {})
    if labels.get(O.LABEL_COMPONENT) == "syncer" or labels.get(LABEL_SPARE):  # the job keeps its spares
        if labels.get(O.LABEL_JOB):
            memo["controller"].enqueue(("job", body["metadata"]["namespace"], labels[O.LABEL_JOB]))
    elif labels.get(O.LABEL_UNIT):
        memo["controller"].enqueue(("unit", body["metadata"]["namespace"], labels[O.LABEL_UNIT]))


async def node_event(body: kopf.Body, event: dict, memo: kopf.Memo, **_) -> None:
    """Capacity may have appeared or gone: autoscaled jobs look again (reads only, from the caches); a node not
    Ready has the units with pods on it looked at (failurePolicy.nodeLostSeconds)."""
    memo["controller"].enqueue_jobs()
    if event.get("type") != "DELETED":
        memo["controller"].node_changed(body)


# Nodes are cluster-scoped: watched unless `diloco operator --no-watch-nodes` (a namespaced install without any
# cluster-wide right); then unit pools are not shown and accelerator capacity is unknown to the autoscaler.
WATCH_NODES = os.environ.get("DILOCO_OPERATOR_WATCH_NODES", "1") != "0"
if WATCH_NODES:
    kopf.index("", "v1", "nodes")(diloco_nodes)
    kopf.on.event("", "v1", "nodes")(node_event)


def diloco_workloads(body: kopf.Body, namespace: str, name: str, **_) -> dict:
    return {(namespace, name): _snapshot(body)}


async def workload_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """Kueue admitted, evicted or requeued a unit's Workload: the unit follows at once."""
    _observed(memo, "workloads", event, body)
    unit = body["metadata"].get("labels", {}).get(O.LABEL_UNIT)
    if unit:
        memo["controller"].enqueue(("unit", body["metadata"]["namespace"], unit))


# Kueue's Workloads of the operator's units: watched with `diloco operator --kueue` (Kueue's CRDs installed).
WATCH_WORKLOADS = os.environ.get("DILOCO_OPERATOR_KUEUE", "0") == "1"
if WATCH_WORKLOADS:
    kopf.index("kueue.x-k8s.io", "v1beta2", "workloads", labels={O.LABEL_UNIT: kopf.PRESENT})(diloco_workloads)
    kopf.on.event("kueue.x-k8s.io", "v1beta2", "workloads", labels={O.LABEL_UNIT: kopf.PRESENT})(workload_event)


@kopf.on.event("apps", "v1", "deployments", labels={O.LABEL_COMPONENT: "syncer"})
async def syncer_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _observed(memo, "deployments", event, body)
    job = body["metadata"].get("labels", {}).get(O.LABEL_JOB)
    if job:
        memo["controller"].enqueue(("job", body["metadata"]["namespace"], job))


@kopf.daemon(api.GROUP, api.VERSION, "dilocojobs", when=lambda spec, **_: bool(spec.get("chaos")),
             cancellation_timeout=30, backoff=10)
async def job_chaos(body: kopf.Body, spec: kopf.Spec, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_) -> None:
    """Runs the job's spec.chaos; a changed spec.chaos stops the running experiment and starts the new one."""
    while not stopped:
        chaos = copy.deepcopy(dict(spec.get("chaos") or {}))  # body and spec are kopf's live views
        if not chaos:
            return

        def changed() -> bool:
            return bool(stopped) or dict(spec.get("chaos") or {}) != chaos

        job = {"apiVersion": body["apiVersion"], "kind": body["kind"],
               "metadata": copy.deepcopy(dict(body["metadata"]))}
        await run_job_chaos(memo["controller"].kube, job, chaos, changed)
        while not changed():  # ended (or refused): nothing to do until the spec changes
            await asyncio.sleep(1)
