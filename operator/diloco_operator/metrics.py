"""Prometheus metrics of the operator (served by `diloco operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from diloco_operator.api import models as api

RECONCILES = Counter("diloco_operator_reconciles_total", "Reconcile passes", ["kind", "result"])
RECONCILE_SECONDS = Histogram("diloco_operator_reconcile_seconds", "Duration of one reconcile pass", ["kind"],
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
QUEUE_DEPTH = Gauge("diloco_operator_queue_depth", "Objects waiting for a reconcile")
UNIT_RESTARTS = Counter("diloco_operator_unit_restarts_total", "Whole-unit restarts decided", ["namespace", "job"])
SPARE_TAKEOVERS = Counter("diloco_operator_spare_takeovers_total",
                          "Units whose dead pod a warm spare pod replaced (spec.units[].spares)", ["namespace", "job"])
SPARE_PODS = Gauge("diloco_operator_spare_pods", "Warm spare pods kept for a job's templates, by state (waiting: "
                   "running and free; starting: not running yet)", ["namespace", "job", "state"])
RESYNCS = Counter("diloco_operator_resyncs_total", "Periodic resyncs (every known object re-queued)")
PODS_ON_LOST_NODES = Counter("diloco_operator_lost_node_pods_deleted_total",
                             "Learner pods force-deleted because their node was lost (failurePolicy.nodeLostSeconds)",
                             ["namespace", "job"])
# What a job's status says about its progress and its faults, per job (the dashboard's goodput and recovery panels).
JOB_GOODPUT = Gauge("diloco_operator_job_goodput", "Useful / allocated learner time of the job (.status.goodput, "
                    "goodput.py's definition)", ["namespace", "job"])
JOB_MERGED_FRACTION = Gauge("diloco_operator_job_merged_fraction", "Share of the trained steps whose work reached "
                            "the global model (.status.mergedFraction)", ["namespace", "job"])
JOB_LAST_RECOVERY_SECONDS = Gauge("diloco_operator_job_last_recovery_seconds", "Seconds from the job's latest unit "
                                  "fault to the unit running again (.status.lastFault.recoverySeconds)",
                                  ["namespace", "job"])
JOB_LAST_FAULT_LOST_STEPS = Gauge("diloco_operator_job_last_fault_lost_steps", "Inner steps the learner life ended by "
                                  "the job's latest unit fault trained that no merge covers "
                                  "(.status.lastFault.lostSteps)", ["namespace", "job"])
JOB_LAST_FAULT_LOST_TOKENS = Gauge("diloco_operator_job_last_fault_lost_tokens", "Their tokens "
                                   "(.status.lastFault.lostTokens)", ["namespace", "job"])
_JOB_GAUGES = (JOB_GOODPUT, JOB_MERGED_FRACTION, JOB_LAST_RECOVERY_SECONDS, JOB_LAST_FAULT_LOST_STEPS,
               JOB_LAST_FAULT_LOST_TOKENS)


def export_job_status(namespace: str, job: str, status: api.DilocoJobStatus) -> None:
    """Set the job's gauges from the status just decided; a figure the status lacks is not exported (no false 0)."""
    fault = status.lastFault
    figures = (status.goodput, status.mergedFraction, *(
        (fault.recoverySeconds, fault.lostSteps, fault.lostTokens) if fault is not None else (None, None, None)))
    for gauge, value in zip(_JOB_GAUGES, figures):
        if value is None:
            _remove(gauge, namespace, job)
        else:
            gauge.labels(namespace, job).set(value)


def forget_job(namespace: str, job: str) -> None:
    """Drop a deleted job's series (its gauges and its unit-restart count)."""
    for metric in (*_JOB_GAUGES, UNIT_RESTARTS, PODS_ON_LOST_NODES, SPARE_TAKEOVERS):
        _remove(metric, namespace, job)
    for state in ("waiting", "starting"):
        try:
            SPARE_PODS.remove(namespace, job, state)
        except KeyError:
            pass


def _remove(metric, namespace: str, job: str) -> None:
    try:
        metric.remove(namespace, job)
    except KeyError:  # never exported
        pass
