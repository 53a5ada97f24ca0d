"""The learner's Prometheus exporter: /metrics on its own thread, read from the latest metrics record."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_GAUGES = {"step": "inner steps since (re)start", "loss": "training loss (mean over the last log window)",
           "tokens_per_s": "tokens per second (last log window)", "step_time_s": "seconds per inner step",
           "syncer_up": "1 if the last request to the syncer succeeded", "pending": "submissions awaiting an answer",
           "epoch": "epoch of the data shard"}
_COUNTERS = {"tokens": "tokens trained since (re)start", "queued": "outer gradients built and queued",
             "sent": "outer gradients delivered (answered by the syncer)",
             "acked": "outer gradients acknowledged", "acked_tokens": "tokens covered by acknowledged submissions",
             "acked_steps": "steps covered by acknowledged submissions", "rejected": "submissions rejected (4xx)",
             "adoptions": "fragment versions adopted", "bytes_up": "outer-gradient bytes sent",
             "bytes_down": "fragment/state bytes received",
             "bytes_down_full": "of bytes_down: whole fragments and the start-up state",
             "versions_rebuilt": "fragment versions rebuilt from down-link updates",
             "versions_full": "fragment versions fetched whole",
             "digest_mismatches": "rebuilt versions whose digest differed from the syncer's",
             "xla_compiles": "XLA graphs compiled (torch_xla's CompileTime count; 0 off XLA)"}


def serve_metrics(port: int, snapshot):
    """Serve Prometheus /metrics on `port` (its own thread) from `snapshot()`, the latest metrics record."""
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

    registry = CollectorRegistry()
    registry.register(Collector())
    server, _thread = start_http_server(port, registry=registry)
    log.info("serving Prometheus metrics on :%d/metrics", server.server_port)
    return server
