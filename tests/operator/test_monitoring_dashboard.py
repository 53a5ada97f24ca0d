"""The Grafana dashboard reads only series that the syncer, the learners and the operator really export: each
query's diloco_* names are looked up in the three /metrics texts (a typo or a renamed metric fails here, before a
Prometheus is needed; test_monitoring_cluster.py then proves every query has data)."""

from __future__ import annotations

import urllib.request

from prometheus_client import REGISTRY, generate_latest

from dashboard_kit import metric_names, panels, queries

# A family's samples by its TYPE line (text format 0.0.4 names a counter with its `_total`): a histogram's
# `_bucket`, `_sum` and `_count`, any other the name itself.
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count")}


def _sample_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def exported_series() -> set[str]:
    """Every sample name the syncer, a learner and the operator expose."""
    import diloco_operator.metrics  # noqa: F401 - registers the operator's metrics on the default registry
    from diloco_trainer.learner.exporter import serve_metrics
    from diloco_trainer.protocol.messages import LearnerRecord
    from diloco_trainer.syncer.metrics import SyncerMetrics

    server = serve_metrics(0, lambda: LearnerRecord(time=1.0, learner_id="l0", versions={"0": 1}).model_dump())
    try:
        learner = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read()
    finally:
        server.shutdown()
    texts = (SyncerMetrics().render(), learner, generate_latest(REGISTRY))
    return set().union(*(_sample_names(t.decode()) for t in texts))


def test_every_dashboard_query_reads_only_series_that_the_code_exports():
    exported = exported_series()
    assert "diloco_syncer_outer_steps_total" in exported and "diloco_learner_bytes_up_total" in exported
    assert "diloco_operator_job_goodput" in exported
    unknown = {(title, ref): sorted(metric_names(expr) - exported) for title, ref, expr in queries()
               if metric_names(expr) - exported}
    assert not unknown, f"queries naming series nobody exports: {unknown}"


def test_every_panel_has_a_query_on_a_diloco_series_and_the_paper_figures_each_have_a_panel():
    for panel in panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert metric_names(target["expr"]), (panel["title"], target["refId"])
    read = set().union(*(metric_names(expr) for _, _, expr in queries()))
    for series in ("diloco_operator_job_goodput", "diloco_syncer_outer_steps_total", "diloco_syncer_fragment_version",
                   "diloco_syncer_quorum", "diloco_syncer_grace_window_seconds", "diloco_syncer_live_learners",
                   "diloco_syncer_staleness_versions_bucket", "diloco_learner_bytes_up_total",
                   "diloco_learner_bytes_down_total", "diloco_operator_unit_restarts_total",
                   "diloco_operator_job_last_recovery_seconds", "diloco_syncer_takeover_seconds",
                   "diloco_learner_ledger_acked_total", "diloco_learner_ledger_discarded_total"):
        assert series in read, series
