"""Where the seconds of one kill go, read from a `diloco local` run directory and its `diloco chaos` record.

Per kill (seconds after it): the supervisor saw the exit, restarted the learner (after --restart-delay; on a warm
spare or cold), the new incarnation registered with the syncer, had pulled Θ and built model, optimizer and data
(`ready`), trained its first step, and had its first outer gradient acknowledged; plus the work the process took
with it: steps trained but not yet acknowledged when it died (averaged over fragments). `spare_cpu` adds the CPU
the spare pool spent warming up spares (each kill makes it start one)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import yaml

from diloco_trainer.protocol.chaos_record import ChaosEntry
from diloco_trainer.protocol.runfiles import read_events
from diloco_trainer.runtime.rundir import learner_totals, metrics_records, read_jsonl

PHASES = ("exit_seen", "restarted", "assigned", "registered", "corpus", "ready", "first_step", "first_acked",
          "merged_again")
# Lines the learner's log carries at each phase (the logging format starts with `%Y-%m-%d %H:%M:%S,mmm`): Θ is
# pulled and the model and optimizer built between `registered` and `corpus` (the corpus loaded).
LOG_MARKS = {"assigned": "warm spare took over", "registered": "syncer reachable", "corpus": "corpus from cache",
             "ready": "starting at versions"}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
# The next life's resend of the unsent work its predecessor's snapshot held (learner/loop.py, Learner._resend).
_RESENT = re.compile(r"resending the unsent work of the previous start: \d+ of \d+ fragment\(s\).*\((\d+) steps\)")


def log_time(line: str) -> float | None:
    """Unix time of a log line written with the learner's logging format, or None."""
    m = _STAMP.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def _log_marks(log_path: Path, after: float, before: float) -> dict[str, float]:
    """The first time each LOG_MARKS line appears in (after, before)."""
    found: dict[str, float] = {}
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        t = log_time(line)
        if t is None or not after - 0.001 <= t < before:
            continue
        for phase, needle in LOG_MARKS.items():
            if phase not in found and needle in line:
                found[phase] = t
    return found


def _resent_steps(log_path: Path, after: float, before: float) -> int:
    """Fragment-steps the life started in (after, before) resent from its predecessor's snapshot (0 if none)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        t = log_time(line)
        if t is not None and after - 0.001 <= t < before and (m := _RESENT.search(line)):
            return int(m.group(1))
    return 0


def kills(run_dir: Path, record: list[ChaosEntry], overwritten: float = 0.0) -> list[dict]:
    """One breakdown per fault of the record (see the module docstring); times in seconds after the kill.

    `overwritten`: the fraction of trained steps that never reach the model even without failures (a newer version
    overwrote them before they were sent; 1 − goodput of the failure-free run). The steps a kill took with it
    (`lost_steps`) are the unacknowledged ones less that share of the incarnation's steps and less what the next life
    resent from the snapshot the killed one left (`resent_steps`: its base version had not moved, so it is merged)."""
    run_dir = Path(run_dir)
    fragments = int(yaml.safe_load((run_dir / "config.yaml").read_text())["outer"]["fragments"])
    events = read_events(run_dir)
    recoveries = {e.fault: e for e in record if e.event == "recovery"}
    out = []
    for f in (e for e in record if e.event == "fault" and not e.dry_run):
        unit, at = f.unit, f.time
        mine = [e for e in events if e.name == unit]
        exit_ = next((e for e in mine if e.event == "exit" and e.time >= at - 1.0), None)
        start = next((e for e in mine if e.event == "start" and exit_ and e.time >= exit_.time), None)
        nxt = next((e.time for e in mine if e.event == "start" and start and e.time > start.time), float("inf"))
        metrics = read_jsonl(run_dir / "learners" / unit / "metrics.jsonl")
        k: dict = {"unit": unit, "at": at, "spare": bool(start and start.spare)}
        k["exit_seen"] = exit_.time - at if exit_ else None
        k["restarted"] = start.time - at if start else None
        if start:
            # From the exit on: a spare may log its takeover a few ms before the supervisor records the start.
            marks = _log_marks(run_dir / "logs" / f"{unit}.log", exit_.time, nxt)
            for phase in LOG_MARKS:
                k[phase] = marks[phase] - at if phase in marks else None
            k["resent_steps"] = _resent_steps(run_dir / "logs" / f"{unit}.log", exit_.time, nxt) / fragments
            new = [r for r in metrics if start.time <= float(r["time"]) < nxt and int(r.get("step", 0)) > 0]
            if new:
                r0 = new[0]
                k["first_step"] = float(r0["time"]) - (int(r0["step"]) - 1) * float(r0.get("step_time_s") or 0) - at
                acked = next((r for r in new if int(r.get("acked", 0)) > 0), None)
                k["first_acked"] = float(acked["time"]) - at if acked else None
        rec = recoveries.get(f.fault)
        k["merged_again"] = rec.merged_again_s if rec else None
        old = [r for r in metrics if float(r["time"]) <= at]
        if old:
            last = old[-1]
            step_s = float(last.get("step_time_s") or 0)
            since = (at - float(last["time"])) / step_s if step_s else 0.0
            k["unacked_steps"] = int(last["step"]) - int(last.get("acked_steps", 0)) / fragments + since
            k["lost_steps"] = max(0.0, k["unacked_steps"] - k.get("resent_steps", 0.0)
                                  - overwritten * (int(last["step"]) + since))
            k["step_time_s"] = step_s
            k["lost_s"] = k["lost_steps"] * step_s
        out.append(k)
    return out


def steps_went(run_dir: Path) -> dict | None:
    """Where a run's trained fragment-steps went, summed over learners and lives (rundir.learner_totals: each
    life's last metrics line): acknowledged by the syncer (`acked`), discarded by an adoption (`discarded`, `adopt:
    overwrite`), or neither (`lost`: with a process, or trained after its last line). Fractions of `trained`; None
    without metrics."""
    run_dir = Path(run_dir)
    fragments = int(yaml.safe_load((run_dir / "config.yaml").read_text())["outer"]["fragments"])
    events = read_events(run_dir)
    trained = acked = discarded = 0
    for path in sorted(run_dir.glob("learners/*/metrics.jsonl")):
        starts = [e.time for e in events if e.name == path.parent.name and e.event == "start"]
        totals = learner_totals(metrics_records(path), starts)
        trained += totals["step"] * fragments
        acked += totals["acked_steps"]
        discarded += totals["steps_discarded"]
    if not trained:
        return None
    return {"trained": trained, "acked": acked / trained, "discarded": discarded / trained,
            "lost": max(0, trained - acked - discarded) / trained}


def phase_summary(breakdown: list[dict]) -> dict:
    """Median and max of every phase over kills (seconds after the kill), and of the work lost at a kill."""
    out: dict = {"kills": len(breakdown), "on_spare": sum(1 for k in breakdown if k["spare"])}
    for key in (*PHASES, "unacked_steps", "resent_steps", "lost_steps", "lost_s"):
        xs = [k[key] for k in breakdown if k.get(key) is not None]
        out[key] = {"median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else None
    return out


def describe(summary: dict) -> str:
    """One line: the median seconds after a kill at which each phase was reached, and the work lost."""
    parts = [f"{p.replace('_', ' ')} {summary[p]['median']:.1f} (max {summary[p]['max']:.1f})"
             for p in PHASES if summary.get(p)]
    if summary.get("spare_cpu_s"):
        parts.append(f"spare warm-up {summary['spare_cpu_s']:.1f} CPU-s per spare started")
    if summary.get("lost_steps"):
        resent = summary.get("resent_steps") or {"median": 0.0}
        parts.append(f"work lost with the process {summary['lost_steps']['median']:.1f} steps "
                     f"({summary['lost_s']['median']:.1f} s of a learner; "
                     f"{summary['unacked_steps']['median']:.1f} unacknowledged, "
                     f"{resent['median']:.1f} resent from its snapshot)")
    return f"{summary['kills']} kills, {summary['on_spare']} on a warm spare: " + "; ".join(parts)


def spare_cpu(run_dir: Path, after: float = 0.0) -> dict:
    """CPU seconds that warm spares (and a zygote) ready after unix time `after` spent warming up (`warm.json`,
    runtime/spares.py): refills during training take that CPU from the learners."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted((Path(run_dir) / "spares").glob("*/warm.json"))]
    cpu = [float(d["cpu_s"]) for d in docs if float(d.get("ready_at", 0)) > after]
    return {"processes": len(cpu), "cpu_s": sum(cpu), "max_cpu_s": max(cpu, default=0.0)}
