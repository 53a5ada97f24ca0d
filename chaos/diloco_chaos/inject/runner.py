"""Runs one experiment against one target: ticks → guarded victims → faults → recoveries, all into the record.

`run_experiment` is the API both `diloco chaos run` and the operator (a DilocoJob's `spec.chaos`) call.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from diloco_trainer.protocol.chaos_record import ChaosEntry

from diloco_chaos.inject.experiment import Experiment
from diloco_chaos.inject.guards import Candidate, Decision, decide, in_scope, stop_reason
from diloco_chaos.inject.metrics import ChaosMetrics
from diloco_chaos.inject.record import Record, RecoveryTracker, summarize
from diloco_chaos.inject.schedule import Schedule, Tick
from diloco_chaos.inject.targets import Fault, Target


@dataclass
class Progress:
    """A snapshot for progress displays (and the operator's status)."""

    experiment: str
    dry_run: bool
    elapsed_s: float
    max_duration_s: float
    next_fault_in_s: float | None
    faults: int
    skipped: int
    down: list[str]
    recovered: int
    ending: str | None
    recent: list[ChaosEntry] = field(default_factory=list)


async def run_experiment(exp: Experiment, target: Target, record: Record, *, dry_run: bool = False,
                         stop: asyncio.Event | None = None, on_progress: Callable[[Progress], None] | None = None,
                         on_fault: Callable[[Fault, dict], object] | None = None, poll_s: float = 0.5,
                         clock: Callable[[], float] = time.time, started_at: float | None = None,
                         metrics: ChaosMetrics | None = None) -> dict:
    """Run `exp` against `target` until its time or fault budget is used, `stop` is set, or the run under test
    ends; then wait (bounded by safety.recoveryTimeout) for open recoveries. Returns the record's summary.

    Dry run (`dry_run` or `exp.dry_run`): every decision is made and recorded, nothing is touched.
    `on_fault(fault, details)` is awaited after each injection (the operator updates its status from it).
    `metrics`: Prometheus counters to update (faults, skips, recoveries, victims down).
    `started_at`: when the experiment first started (an operator that restarted resumes its schedule and
    maxDuration from there; ticks missed while it was away are not fired).
    """
    dry_run = dry_run or exp.dry_run
    await target.preflight(exp)
    start = started_at if started_at is not None else clock()
    record.write("experiment", name=exp.name, description=exp.description, dry_run=dry_run,
                 target=target.describe(), spec=exp.model_dump(mode="json", by_alias=True))
    cands = await target.candidates()
    scoped = [c.unit for c in cands if in_scope(c, exp.target, exp.safety)]
    sched = Schedule(exp.schedule, start, scoped)
    missed = sched.due(clock(), scoped)  # only when resuming: those moments have passed
    if missed:
        record.write("resumed", missed_ticks=len(missed), started_at=start)
    tracker = RecoveryTracker()
    ending, ending_at = None, None
    timeout_s = exp.safety.recovery_timeout_s

    def note(event: str, **fields) -> ChaosEntry:
        entry = record.write(event, **fields)
        if metrics is not None:
            metrics.observe(exp.name, entry)
        if event == "skipped":
            counts["skipped"] += 1
        return entry

    run = _Run(exp, target, sched, random.Random(exp.schedule.seed), tracker, note, dry_run, on_fault)
    counts = run.counts
    try:
        while True:
            now = clock()
            for rec in tracker.feed(now, await target.observe()) + tracker.expire(now, timeout_s):
                counts["recovered"] += bool(rec["recovered"])
                note("recovery", **rec)
            gone = await target.ended()
            await _release_or_hold(run, now, gone)
            if ending is None:
                ending = gone or stop_reason(now - start, counts["faults"], exp.safety) or (
                    "stop requested" if stop is not None and stop.is_set() else None)
                if ending is not None:
                    ending_at = now
                    note("ending", reason=ending)
            if ending is None:
                await _fire_due(run, now)
            if ending is not None and (gone or not run.active and not tracker.faults or now - ending_at > timeout_s):
                break
            if metrics is not None:
                metrics.down.labels(exp.name).set(len(tracker.down()))
            if on_progress is not None:
                on_progress(_progress(run, record, now - start, now, ending))
            nxt = sched.next_at()
            await _pause(stop, poll_s if nxt is None or ending else min(poll_s, max(0.0, nxt - clock())))
    finally:
        await _wind_down(run)
        summary = summarize(record.entries)
        record.write("end", reason=ending or "interrupted", elapsed_s=clock() - start, summary=summary)
    return summary


async def _release_or_hold(run: _Run, now: float, gone: str | None) -> None:
    """Faults whose time is up (or whose run ended) are released; the others held (e.g. a deleted pod kept away)."""
    for f in list(run.active.values()):
        if now >= f.back_at or gone:
            run.note("released", fault=f.id, unit=f.unit, **(await run.target.release(f) or {}))
            del run.active[f.id]
        elif f.action != "pause":
            held = await run.target.hold(f)
            if held:
                run.note("held", fault=f.id, unit=f.unit, until=f.back_at, **held)


def _progress(run: _Run, record: Record, elapsed: float, now: float, ending: str | None) -> Progress:
    nxt = run.sched.next_at()
    return Progress(run.exp.name, run.dry_run, elapsed, run.exp.safety.max_duration_s,
                    None if nxt is None or ending else max(0.0, nxt - now), run.counts["faults"],
                    run.counts["skipped"], sorted(run.tracker.down()), run.counts["recovered"], ending,
                    record.entries[-6:])


async def _pause(stop: asyncio.Event | None, delay: float) -> None:
    """Sleep `delay`, or less when a stop is requested meanwhile."""
    if stop is None:
        await asyncio.sleep(delay)
        return
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(0.01, delay))
    except asyncio.TimeoutError:
        pass


async def _wind_down(run: _Run) -> None:
    """Never leave a victim stopped or held behind; then close the target and the recoveries still open."""
    for f in list(run.active.values()):
        try:
            run.note("released", fault=f.id, unit=f.unit, **(await run.target.release(f) or {}))
        except Exception as exc:  # report and go on releasing the others
            run.note("error", fault=f.id, unit=f.unit, error=f"release failed: {exc}")
    await run.target.close()
    for rec in run.tracker.close():
        run.note("recovery", **rec)


@dataclass
class _Run:
    """One experiment while it runs: what firing the due ticks reads and changes."""

    exp: Experiment
    target: Target
    sched: Schedule
    rng: random.Random
    tracker: RecoveryTracker
    note: Callable[..., ChaosEntry]  # writes a record entry (and counts it)
    dry_run: bool
    on_fault: Callable[[Fault, dict], object] | None
    active: dict[int, Fault] = field(default_factory=dict)  # faults with a pause or downtime still running
    counts: dict[str, int] = field(default_factory=lambda: {"faults": 0, "skipped": 0, "recovered": 0})

    def budget_used(self, now: float) -> bool:
        return stop_reason(now - self.sched.start, self.counts["faults"], self.exp.safety) is not None


async def _fire_due(run: _Run, now: float) -> None:
    """Every tick due by `now`: pick its victims (guards.decide) and inject a fault into each, within the budget."""
    exp = run.exp
    cands = await run.target.candidates()
    scoped = [c.unit for c in cands if in_scope(c, exp.target, exp.safety)]
    for tick in run.sched.due(now, scoped):
        if run.budget_used(now):
            return
        down = run.tracker.down() | {f.unit for f in run.active.values()}
        decision = decide(tick, cands, down, exp, run.rng)
        if decision.skipped:
            run.note("skipped", tick=tick.index + 1, scheduled_at=tick.at, reason=decision.skipped)
            continue
        for victim in decision.victims:
            if run.budget_used(now):
                return
            if await _inject(run, tick, victim, decision, now):
                cands = await run.target.candidates()  # the victim is no longer alive: the next tick sees that


async def _inject(run: _Run, tick: Tick, victim: Candidate, decision: Decision, now: float) -> bool:
    """One fault into `victim`, recorded (a dry run records what it would do); False if none was injected."""
    exp = run.exp
    run.counts["faults"] += 1
    back_at = now + (exp.action.duration_s if exp.action.type == "pause" else exp.schedule.downtime_s)
    fault = Fault(run.counts["faults"], victim.unit, victim.role, decision.members[victim.unit], exp.action.type,
                  now, back_at, exp.action.exit_code, exp.name, decision.why)
    entry = {"fault": fault.id, "tick": tick.index + 1, "scheduled_at": tick.at, "unit": fault.unit,
             "role": fault.role, "members": list(fault.members), "action": fault.action,
             "exit_code": fault.exit_code, "back_at": back_at, "why": decision.why, "dry_run": run.dry_run}
    if run.dry_run:
        run.note("fault", **entry, details={"would": f"{fault.action} {', '.join(fault.members)}"})
        return False
    try:
        details = await run.target.inject(fault)
    except RuntimeError as exc:
        run.counts["faults"] -= 1
        run.note("skipped", tick=tick.index + 1, scheduled_at=tick.at, unit=fault.unit, reason=str(exc))
        return False
    run.note("fault", **entry, details=details)
    run.tracker.add(fault.id, fault.unit, fault.action, now, back_at)
    if back_at > now:
        run.active[fault.id] = fault
    if run.on_fault is not None:
        result = run.on_fault(fault, details)
        if asyncio.iscoroutine(result):
            await result
    return True
