"""The learner's Prometheus exporter: /metrics on its own thread, read from the latest metrics record."""

from __future__ import annotations

import logging

from diloco_trainer.protocol.messages import LearnerRecord, prometheus_fields

log = logging.getLogger(__name__)

# The metrics record's fields marked counter or gauge (protocol/messages.py), exported as diloco_learner_<name>.
_GAUGES = prometheus_fields(LearnerRecord, "gauge")
_COUNTERS = prometheus_fields(LearnerRecord, "counter")


def serve_metrics(port: int, snapshot, process_restarts: int = 0):
    """Serve Prometheus /metrics on `port` (its own thread) from `snapshot()`, the latest metrics record, and
    how often the pod's supervisor restarted this learner's process in place (runtime/podsup.py)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            rec = snapshot()
            labels = [str(rec.get("learner_id", ""))]
            for key, doc in _GAUGES.items():
                g = GaugeMetricFamily(f"diloco_learner_{key}", doc, labels=["learner_id"])
                g.add_metric(labels, float(rec.get(key) or 0))
                yield g
            for key, doc in _COUNTERS.items():
                c = CounterMetricFamily(f"diloco_learner_{key}", doc, labels=["learner_id"])
                c.add_metric(labels, float(rec.get(key) or 0))
                yield c
            v = GaugeMetricFamily("diloco_learner_fragment_version", "adopted version per fragment",
                                  labels=["learner_id", "fragment"])
            for p, version in (rec.get("versions") or {}).items():
                v.add_metric(labels + [str(p)], float(version))
            yield v
            r = CounterMetricFamily("diloco_learner_process_restarts",
                                    "learner process restarts in place by the pod's supervisor (diloco pod-learner)",
                                    labels=["learner_id"])
            r.add_metric(labels, float(process_restarts))
            yield r

    registry = CollectorRegistry()
    registry.register(Collector())
    server, _thread = start_http_server(port, registry=registry)
    log.info("serving Prometheus metrics on :%d/metrics", server.server_port)
    return server
