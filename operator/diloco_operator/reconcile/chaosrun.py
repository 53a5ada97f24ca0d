"""A DilocoJob's `spec.chaos`, run by the operator: one chaos experiment per job (diloco_chaos's runner against
the job's own pods), resumed from its persisted start time after an operator restart."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Callable

from prometheus_client import REGISTRY

from diloco_chaos.inject.experiment import JobChaos
from diloco_chaos.inject.metrics import ChaosMetrics
from diloco_chaos.inject.record import Record
from diloco_chaos.inject.runner import run_experiment
from diloco_chaos.inject.targets.kubernetes import KubernetesTarget
from diloco_kube.client import DILOCOJOBS, Kube
from diloco_operator.api import conditions as C

# {"startedAt": unix, "spec": hash of the spec.chaos it runs, "faults": injected so far, "ended": true once done}
ANNOTATION_STARTED = "diloco.dev/chaos-started-at"
log = logging.getLogger("diloco_operator")  # kopf's per-object loggers are quietened (handlers.startup)
_metrics: ChaosMetrics | None = None


def chaos_metrics() -> ChaosMetrics:
    """The operator's one set of chaos counters, on the default registry its /metrics serves."""
    global _metrics
    if _metrics is None:
        _metrics = ChaosMetrics(REGISTRY)
    return _metrics


def spec_hash(chaos: dict) -> str:
    """A short, stable digest of a spec.chaos (its start time belongs to exactly this spec)."""
    return hashlib.sha256(json.dumps(chaos, sort_keys=True).encode()).hexdigest()[:12]


def persisted(annotations: dict, digest: str) -> dict | None:
    """What the job's annotation says about the experiment for spec `digest` ({"startedAt", "faults", "ended"}),
    or None (never started, or started for another spec)."""
    try:
        saved = json.loads(annotations.get(ANNOTATION_STARTED) or "{}")
        if saved.get("spec") != digest:
            return None
        return {"startedAt": float(saved["startedAt"]), "faults": int(saved.get("faults") or 0),
                "ended": bool(saved.get("ended"))}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable (edited by hand): start afresh rather than guess


async def _persist(kube: Kube, ns: str, name: str, digest: str, started: float, faults: int = 0,
                   ended: bool = False) -> None:
    value = json.dumps({"startedAt": started, "spec": digest, "faults": faults, **({"ended": True} if ended else {})})
    await kube.merge_patch(DILOCOJOBS, ns, name, {"metadata": {"annotations": {ANNOTATION_STARTED: value}}})


async def run_job_chaos(kube: Kube, job: dict, chaos: dict, should_stop: Callable[[], bool],
                        poll_s: float = 0.5) -> dict | None:
    """Run `chaos` (the job's spec.chaos) until it ends or `should_stop()` turns true; returns the summary, or
    None when stopped early. A spec the chaos module refuses becomes a Warning Event on the job, not a crash."""
    meta = job["metadata"]
    name, ns = meta["name"], meta["namespace"]
    digest = spec_hash(chaos)
    try:
        exp = JobChaos.model_validate(chaos).to_experiment(name, ns)
    except ValueError as exc:
        await kube.event(job, "Warning", C.Reason.CHAOS_REJECTED, f"spec.chaos: {exc}")
        return None
    saved = persisted(meta.get("annotations") or {}, digest)
    if saved and saved["ended"]:
        return None  # this very spec already ran to its end (before an operator restart): not again
    done = saved["faults"] if saved else 0
    if exp.safety.max_faults is not None and done:  # the fault budget spans operator restarts
        if done >= exp.safety.max_faults:
            return None
        left = exp.safety.max_faults - done
        exp = exp.model_copy(update={"safety": exp.safety.model_copy(update={"max_faults": left})})
    if saved is None:
        started = time.time()
        await _persist(kube, ns, name, digest, started)
        await kube.event(job, "Normal", C.Reason.CHAOS_STARTED, f"chaos experiment {exp.name} started: "
                         f"schedule {exp.schedule.model_dump(by_alias=True, exclude_defaults=True)}, "
                         f"{exp.action.type} a {exp.target.kind}, at most {exp.safety.max_faults or 'unbounded'} "
                         f"faults within {exp.safety.max_duration}")
    else:
        started = saved["startedAt"]
        log.info("chaos experiment %s resumed (started %.0fs ago, %d faults so far)", exp.name,
                 time.time() - started, done)
    injected = {"faults": done}

    async def on_fault(fault, details) -> None:
        injected["faults"] += 1
        log.info("chaos experiment %s: fault #%d %s %s", exp.name, injected["faults"], fault.action,
                 ", ".join(details.get("pods") or fault.members))
        await _persist(kube, ns, name, digest, started, injected["faults"])

    stop = asyncio.Event()
    task = asyncio.create_task(run_experiment(
        exp, KubernetesTarget(name, ns, kube=kube), Record(None), stop=stop, on_fault=on_fault,
        started_at=started, metrics=chaos_metrics()), name=f"chaos-{ns}/{name}")
    try:
        while not task.done():
            if should_stop():
                # Kubernetes faults hold nothing (no pause, no downtime): stopping at once leaves nothing behind.
                stop.set()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            await asyncio.wait([task], timeout=poll_s)
        try:
            summary = task.result()
        except ValueError as exc:  # refused by the target's preflight (e.g. pause on Kubernetes)
            await kube.event(job, "Warning", C.Reason.CHAOS_REJECTED, f"spec.chaos: {exc}")
            return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    await _persist(kube, ns, name, digest, started, injected["faults"], ended=True)
    dry = f" ({summary['dry_run_faults']} dry-run)" if summary["dry_run_faults"] else ""
    await kube.event(job, "Normal", C.Reason.CHAOS_ENDED, f"chaos experiment {exp.name} ended: {injected['faults']} faults"
                     f"{dry}, {summary['skipped']} skipped, {summary['recovered']} recovered, "
                     f"{summary['not_recovered']} not recovered")
    return summary
