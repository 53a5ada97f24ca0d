"""The Grafana dashboard (charts/decoupled-diloco/dashboards/diloco.json) for the monitoring tests: its panels'
PromQL, made evaluable outside Grafana, and the metric names a query refers to."""

from __future__ import annotations

import json
import re

from cluster_kit import ROOT
from polling import wait_for

DASHBOARD = ROOT / "charts" / "decoupled-diloco" / "dashboards" / "diloco.json"
# Grafana fills these in; an evaluation outside it puts a window of its own in their place.
GRAFANA_VARIABLES = ("$__rate_interval", "$__interval", "$__range")
_METRIC = re.compile(r"\bdiloco_(?:syncer|learner|operator)_[a-z0-9_]+\b")


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def queries(window: str = "1m") -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL with Grafana's interval variables set to `window`) for every target of every
    panel, in order."""
    out = []
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable in GRAFANA_VARIABLES:
                expr = expr.replace(variable, window)
            out.append((panel["title"], target["refId"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    """The series a query reads: diloco_syncer_*, diloco_learner_*, diloco_operator_* (not the diloco_dev_* target
    labels that pod labels become)."""
    return set(_METRIC.findall(expr))


def queries_without_data(query) -> list[str]:
    """The dashboard's queries for which `query(expr)` (a Prometheus instant query) returns nothing, named by panel."""
    return [f"{title} [{ref}]: {expr}" for title, ref, expr in queries() if not query(expr)]


def wait_for_data_in_every_query(query, timeout: float) -> None:
    """Poll until every dashboard query has data (rates need two scrapes in their window); AssertionError naming
    the panels and queries still without data after `timeout` seconds."""
    missing: list[str] = []

    def every_query_has_data() -> bool:
        missing[:] = queries_without_data(query)
        return not missing
    try:
        wait_for(every_query_has_data, timeout, "data for every dashboard query", 1.0)
    except AssertionError:
        raise AssertionError("dashboard queries without data:\n" + "\n".join(missing)) from None
