"""Prometheus metrics of the operator (served by `diloco operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("diloco_operator_reconciles_total", "Reconcile passes", ["kind", "result"])
RECONCILE_SECONDS = Histogram("diloco_operator_reconcile_seconds", "Duration of one reconcile pass", ["kind"],
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
QUEUE_DEPTH = Gauge("diloco_operator_queue_depth", "Objects waiting for a reconcile")
UNIT_RESTARTS = Counter("diloco_operator_unit_restarts_total", "Whole-unit restarts decided", ["namespace", "job"])
RESYNCS = Counter("diloco_operator_resyncs_total", "Periodic resyncs (every known object re-queued)")
PODS_ON_LOST_NODES = Counter("diloco_operator_lost_node_pods_deleted_total",
                             "Learner pods force-deleted because their node was lost (failurePolicy.nodeLostSeconds)",
                             ["namespace", "job"])
