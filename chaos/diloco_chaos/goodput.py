"""Goodput and system uptime measured from a real run: a `diloco local` run directory, or Prometheus on a cluster.

goodput: the project's one definition, `diloco_trainer.goodput` (useful learner time / allocated learner time).
system uptime = fraction of wall time in which the global model advanced (stalls longer than a threshold are down).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from diloco_trainer.goodput import goodput
from diloco_trainer.protocol.messages import SyncerSample
from diloco_trainer.protocol.runfiles import (BaselineFinalState, SyncerFinalState, read_events,
                                              read_final_state, starts_by_name)
from diloco_trainer.runtime.rundir import learner_slots, metrics_records, read_jsonl

MIN_STALL_S = 3.0  # the local runtime samples the syncer about once a second; shorter gaps are sampling noise
STALL_FACTOR = 5.0  # a gap longer than 5× the typical interval between merges is a stall


def stalls(advances: list[float], start: float, end: float, threshold_s: float | None = None) -> tuple[list, float]:
    """Intervals of [start, end] without a global-model advance longer than the threshold, and the threshold.

    `advances`: times at which the global model advanced. Default threshold: max(MIN_STALL_S, STALL_FACTOR ×
    the median gap between advances).
    """
    points = sorted(t for t in advances if start <= t <= end)
    edges = [start] + points + [end]
    gaps = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    if threshold_s is None:
        inner = [b - a for a, b in zip(points, points[1:])]
        threshold_s = max(MIN_STALL_S, STALL_FACTOR * statistics.median(inner)) if inner else MIN_STALL_S
    return [(a, b) for a, b in gaps if b - a > threshold_s], threshold_s


def uptime(advances: list[float], start: float, end: float, threshold_s: float | None = None,
           origin: float | None = None) -> dict:
    """System uptime over [start, end]: 1 − (time inside stalls) / (end − start). Stalls are reported in
    seconds since `origin` (default `start`)."""
    if end <= start:
        return {"uptime": None, "stalls": [], "stall_threshold_s": threshold_s}
    found, threshold_s = stalls(advances, start, end, threshold_s)
    down = sum(b - a for a, b in found)
    origin = start if origin is None else origin
    return {"uptime": 1.0 - down / (end - start), "stall_threshold_s": threshold_s,
            "stalls": [{"from_s": a - origin, "to_s": b - origin, "s": b - a} for a, b in found]}


def _fragments(run_dir: Path, samples: list[dict]) -> int:
    cfg = run_dir / "config.yaml"
    if cfg.exists():
        raw = yaml.safe_load(cfg.read_text()) or {}
        if (raw.get("outer") or {}).get("fragments"):
            return int(raw["outer"]["fragments"])
    for s in reversed(samples):
        if s.status is not None and s.status.fragments:
            return s.status.fragments
    raise ValueError(f"{run_dir}: cannot tell the number of fragments (no config.yaml, no syncer samples)")


def _merged_steps(final: SyncerFinalState | None, samples: list[SyncerSample]) -> dict[str, int]:
    """steps_merged per learner: the final checkpoint if the run finished, else the syncer's last status."""
    merged: dict[str, int] = {}
    for s in samples:
        for lid, info in (s.status.learners if s.status else {}).items():
            merged[lid] = max(merged.get(lid, 0), info.steps_merged)
    for lid, info in (final.learners if final is not None else {}).items():
        merged[lid] = max(merged.get(lid, 0), info.steps_merged)
    return merged


def from_run_dir(run_dir: str | Path, stall_threshold_s: float | None = None) -> dict:
    """Goodput, its parts and system uptime of a local run, from its directory alone (live or finished)."""
    run_dir = Path(run_dir)
    if not (run_dir / "learners").is_dir():
        raise ValueError(f"{run_dir} is not a run directory of `diloco local` (no learners/ inside)")
    events = read_events(run_dir)
    starts = starts_by_name(events)
    samples = [SyncerSample.from_line(s) for s in read_jsonl(run_dir / "syncer.jsonl") if s.get("up")]
    final = read_final_state(run_dir)
    if isinstance(final, BaselineFinalState):  # a synchronous job: no syncer; useful = the final model's steps
        fragments, merged = None, None
    else:
        fragments = _fragments(run_dir, samples)
        merged = _merged_steps(final, samples)
    slots = learner_slots(run_dir, merged, fragments or 1)
    if not slots:
        raise ValueError(f"{run_dir}: no learner has started yet")
    steady = learner_slots(run_dir, merged, fragments or 1, after_startup=True)

    learners, t_trained = {}, None
    for name, sl in slots.items():
        learners[name] = {"incarnations": len(starts[name]), "allocated_s": sl.allocated_s,
                          "allocated_after_startup_s": steady[name].allocated_s, "busy_s": sl.busy_s,
                          "steps": sl.steps,
                          "steps_merged": merged.get(name, 0) if merged is not None else round(sl.useful_steps),
                          "merged_fraction": sl.merged_fraction, "useful_s": sl.useful_s}
        last_step = max((r.time for r in metrics_records(run_dir / "learners" / name / "metrics.jsonl")
                         if not r.final), default=None)
        if last_step is not None:
            t_trained = last_step if t_trained is None else max(t_trained, last_step)
    t_start = min(starts[name][0] for name in slots)
    t_end = t_start + max(sl.allocated_s + starts[n][0] - t_start for n, sl in slots.items())

    figures = goodput(slots.values())
    advances = advances_from_samples(samples)
    first = advances[0] if advances else None
    # From the first merge to the last training report: the start-up before and the shutdown drain after
    # are not stalls of a running system (start-up is reported as first_merge_after_s).
    up = {"uptime": 0.0 if merged is not None else None, "stalls": []}  # a baseline has no global-model clock
    if first is not None and t_trained is not None:
        up = uptime(advances, first, max(first, t_trained), stall_threshold_s, origin=t_start)
    return {
        "source": str(run_dir), "fragments": fragments, "learners": learners,
        **figures,
        # The same, with each slot counted from its first training report: the one-time start-up (process,
        # corpus, first pull of Θ) left out; the start-up of every restart still counts as lost.
        "goodput_after_startup": goodput(steady.values())["goodput"],
        "wall_s": t_end - t_start, "first_merge_after_s": None if first is None else first - t_start,
        **up,
    }


def advances_from_samples(samples: list[SyncerSample]) -> list[float]:
    """Estimated times of the global model's advances, from the syncer's status samples.

    Between two answered samples the count of outer steps tells how many merges happened; they are spread
    evenly over that interval (the sampler may have been slow or unanswered for a while, yet the syncer
    merged), but never before the syncer's own start (`uptime_s`): a restarted syncer merged nothing while
    it was down, so its replayed merges do not hide the outage.
    """
    out: list[float] = []
    prev = None
    for s in sorted((s for s in samples if s.status is not None), key=lambda s: s.time):
        t, count = s.time, s.status.outer_steps
        if prev is not None and count > prev[1]:
            since = prev[0] if s.status.uptime_s is None else max(prev[0], t - s.status.uptime_s)
            k = count - prev[1]
            out.extend(since + (t - since) * (i + 1) / k for i in range(k))
        if prev is None or count >= prev[1]:
            prev = (t, count)
    return out


# ---------------------------------------------------------------------------------------- clusters (Prometheus)

# PromQL over the metrics the syncer and learners export; {sel} is a label selector such as
# namespace="team-a",job="diloco" (whatever relabelling the scrape config applies).
PROMQL = {
    "tokens_merged": "sum(increase(diloco_syncer_tokens_merged_total{{{sel}}}[{range}]))",
    "tokens_trained": "sum(increase(diloco_learner_tokens_total{{{sel}}}[{range}]))",
    "unit_tokens_per_s": "quantile(0.5, max_over_time(diloco_learner_tokens_per_s{{{sel}}}[{range}]))",
    "units": "count(count by (learner_id) (diloco_learner_step{{{sel}}}))",
    "outer_steps": "sum(diloco_syncer_outer_steps_total{{{sel}}})",
}


def from_counters(tokens_merged: float, tokens_trained: float, unit_tokens_per_s: float, units: int,
                  fragments: int, wall_s: float, advances: list[float], start: float) -> dict:
    """Cluster goodput from Prometheus figures over a window of `wall_s` seconds starting at `start`.

    useful time = tokens merged / P / (a healthy unit's tokens per second); allocated = units × wall time.
    """
    if units < 1 or wall_s <= 0 or unit_tokens_per_s <= 0 or fragments < 1:
        raise ValueError("need units >= 1, wall_s > 0, unit_tokens_per_s > 0 and fragments >= 1")
    useful = tokens_merged / fragments / unit_tokens_per_s
    allocated = units * wall_s
    busy = tokens_trained / unit_tokens_per_s
    return {"source": "prometheus", "fragments": fragments, "units": units, "allocated_s": allocated,
            "busy_s": busy, "useful_s": useful, "goodput": min(1.0, useful / allocated),
            "compute_fraction": min(1.0, busy / allocated),
            "merged_fraction": useful / busy if busy else None, "wall_s": wall_s,
            **uptime(advances, start, start + wall_s)}


async def from_prometheus(url: str, selector: str, start: float, end: float, fragments: int,
                          step_s: float = 5.0) -> dict:
    """Query a Prometheus server (HTTP API) for the window [start, end] and compute `from_counters`."""
    import aiohttp

    rng = f"{max(1, int(end - start))}s"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async def instant(query: str) -> float:
            async with http.get(f"{url.rstrip('/')}/api/v1/query", params={"query": query, "time": end}) as r:
                doc = await r.json()
            if doc.get("status") != "success":
                raise ValueError(f"Prometheus rejected {query!r}: {doc.get('error')}")
            result = doc["data"]["result"]
            return float(result[0]["value"][1]) if result else 0.0

        values = {k: await instant(q.format(sel=selector, range=rng)) for k, q in PROMQL.items() if k != "outer_steps"}
        async with http.get(f"{url.rstrip('/')}/api/v1/query_range", params={
                "query": PROMQL["outer_steps"].format(sel=selector), "start": start, "end": end, "step": step_s}) as r:
            doc = await r.json()
    series = doc.get("data", {}).get("result") or [{"values": []}]
    points = [(float(t), float(v)) for t, v in series[0]["values"]]
    advances = [t for (t0, v0), (t, v) in zip(points, points[1:]) if v > v0]
    return from_counters(values["tokens_merged"], values["tokens_trained"], values["unit_tokens_per_s"],
                         int(values["units"]), fragments, end - start, advances, start)
