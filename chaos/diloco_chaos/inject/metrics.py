"""Prometheus counters of a chaos experiment (a counter on every fault, as the chaos tools do), plus the measured
goodput and uptime of the run under test. A private registry, so an operator can run several experiments."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from diloco_trainer.protocol.chaos_record import ChaosEntry

_RECOVERY_S = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class ChaosMetrics:
    """Every figure `diloco chaos run` exports; names start with `diloco_chaos_`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.faults = Counter("diloco_chaos_faults", "Faults injected (dry runs included, labelled)",
                              ["experiment", "action", "role", "dry_run"], registry=r)
        self.skipped = Counter("diloco_chaos_ticks_skipped", "Scheduled faults not injected (a guard, or refused)",
                               ["experiment"], registry=r)
        self.recoveries = Counter("diloco_chaos_recoveries", "Faults followed to the end, by outcome",
                                  ["experiment", "outcome"], registry=r)
        self.recovery_seconds = Histogram("diloco_chaos_recovery_seconds", "Time from a fault until the victim "
                                          "trained again / had its contribution merged again",
                                          ["experiment", "until"], buckets=_RECOVERY_S, registry=r)
        self.down = Gauge("diloco_chaos_victims_down", "Victims that have not trained again yet", ["experiment"],
                          registry=r)
        self.goodput = Gauge("diloco_chaos_run_goodput", "Measured goodput of the run under test", ["experiment"],
                             registry=r)
        self.uptime = Gauge("diloco_chaos_run_uptime", "Measured system uptime of the run under test",
                            ["experiment"], registry=r)

    def observe(self, experiment: str, entry: ChaosEntry) -> None:
        """Count one record entry."""
        kind = entry.event
        if kind == "fault":
            self.faults.labels(experiment, entry.action, entry.role, str(bool(entry.dry_run)).lower()).inc()
        elif kind == "skipped":
            self.skipped.labels(experiment).inc()
        elif kind == "recovery":
            self.recoveries.labels(experiment, "recovered" if entry.recovered else "not_recovered").inc()
            for until, value in (("trained", entry.trained_again_s), ("merged", entry.merged_again_s)):
                if value is not None:
                    self.recovery_seconds.labels(experiment, until).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
