"""The record of an experiment (JSON lines of `protocol.chaos_record.ChaosEntry`: every fault, what, when, why, and
its recovery) and the pure tracker that turns observations of the run into recovery times."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.protocol.chaos_record import ChaosEntry, append_entry

HISTORY = 4096  # merged-counter samples kept per unit (a few hours at the runtimes' 1 Hz)


@dataclass
class UnitObservation:
    """What a target saw of one unit since its previous observation.

    `lines` are training reports (time, step) of any incarnation, or None when the target has no step reports
    (kwok pods run nothing): then `running_since` (when every member became Running) stands for training.
    `merged` are samples (time, contributions of this unit merged so far) from the syncer; None when the target
    cannot see the syncer (then a recovery is complete once the unit trains again).
    """

    started: float | None = None  # unix start of the current incarnation
    running: bool = False
    lines: list[tuple[float, int]] | None = None
    running_since: float | None = None
    merged: list[tuple[float, int]] | None = field(default_factory=list)


@dataclass
class _Fault:
    id: int
    unit: str
    action: str
    at: float  # injected (unix)
    back_at: float  # allowed back: end of the pause or of the downtime
    restarts: bool  # kill/fail: a new incarnation trains; pause: the same one resumes
    replacement_started: float | None = None
    trained_at: float | None = None
    merged_at: float | None = None
    baseline: int | None = None
    merges_seen: bool = True  # False: the target cannot observe merges


class RecoveryTracker:
    """Follows every injected fault until its unit trained again and its contribution was merged again.

    Trained again: the first training report after the fault from a new incarnation (kill, fail) or after the
    resume (pause). Merged again: the unit's merged-contribution counter rises above its value when the
    replacement started (or the pause ended), so merges before that moment do not count. Merges after it count
    whichever life sent the work: the predecessor's unacknowledged work, which the replacement resends at its
    start, or a Δ acknowledged just before the fault that the syncer merges only then; so merged again can come
    before trained again.
    """

    def __init__(self) -> None:
        self.faults: dict[int, _Fault] = {}
        self.merged: dict[str, list[tuple[float, int]]] = {}
        self.started: dict[str, float | None] = {}

    def add(self, fault_id: int, unit: str, action: str, at: float, back_at: float | None = None) -> None:
        self.faults[fault_id] = _Fault(fault_id, unit, action, at, back_at if back_at is not None else at,
                                       restarts=action != "pause")

    def down(self) -> set[str]:
        """Units hit by a fault that have not trained again yet (the guards count them as down)."""
        return {f.unit for f in self.faults.values() if f.trained_at is None}

    def feed(self, now: float, units: dict[str, UnitObservation]) -> list[dict]:
        """Take one observation; returns the recovery records completed by it."""
        for unit, obs in units.items():
            history = self.merged.setdefault(unit, [])
            history.extend(obs.merged or [])
            del history[:-HISTORY]
            if obs.started is not None:
                self.started[unit] = obs.started
        done = []
        for f in list(self.faults.values()):
            obs = units.get(f.unit)
            if obs is not None:
                f.merges_seen = obs.merged is not None
                self._advance(f, obs)
            if f.trained_at is not None and (f.merged_at is not None or not f.merges_seen):
                done.append(self._finish(f, recovered=True))
        return done

    def _advance(self, f: _Fault, obs: UnitObservation) -> None:
        if f.restarts and f.replacement_started is None and obs.started is not None and obs.started > f.at:
            f.replacement_started = obs.started
        anchor = f.replacement_started if f.restarts else f.back_at
        if anchor is None:
            return
        if f.trained_at is None:
            if obs.lines is not None:
                f.trained_at = next((t for t, step in obs.lines if t > anchor and step > 0), None)
            elif obs.running_since is not None and obs.running_since >= anchor:
                f.trained_at = obs.running_since
        history = self.merged.get(f.unit, [])
        if f.baseline is None and history:
            before = [v for t, v in history if t <= anchor]
            # No sample before the anchor (the syncer was away): the first one after it is the baseline.
            f.baseline = before[-1] if before else history[0][1]
        if f.trained_at is not None and f.merged_at is None and f.baseline is not None:
            f.merged_at = next((t for t, v in history if t > anchor and v > f.baseline), None)

    def expire(self, now: float, timeout_s: float) -> list[dict]:
        """Records for faults still unrecovered `timeout_s` after they were allowed back."""
        return [self._finish(f, recovered=False) for f in list(self.faults.values()) if now - f.back_at > timeout_s]

    def close(self) -> list[dict]:
        """Records for every fault still open (the experiment ends)."""
        return [self._finish(f, recovered=False) for f in list(self.faults.values())]

    def _finish(self, f: _Fault, recovered: bool) -> dict:
        del self.faults[f.id]
        rec = {"fault": f.id, "unit": f.unit, "action": f.action, "injected_at": f.at, "back_at": f.back_at,
               "replacement_started_at": f.replacement_started, "trained_again_at": f.trained_at,
               "merged_again_at": f.merged_at,
               "trained_again_s": None if f.trained_at is None else f.trained_at - f.at,
               "merged_again_s": None if f.merged_at is None else f.merged_at - f.at,
               "recovered": recovered}
        if not recovered:
            rec["note"] = ("never trained again" if f.trained_at is None
                           else "trained again, but no contribution merged again")
        elif not f.merges_seen:
            rec["note"] = "merges not observable from this target (no syncer status)"
        return rec


class Record:
    """Appends one JSON object per line (flushed at once, so a killed experiment keeps what it did)."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path is not None else None
        self.entries: list[ChaosEntry] = []

    def write(self, event: str, **fields) -> ChaosEntry:
        entry = ChaosEntry(event=event, time=time.time(), **fields)
        self.entries.append(entry)
        if self.path is not None:
            append_entry(self.path, entry)
        return entry


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(entries: list[ChaosEntry]) -> dict:
    """Counts and median/max recovery times of a record."""
    faults = [e for e in entries if e.event == "fault"]
    recoveries = [e for e in entries if e.event == "recovery"]
    trained = [e.trained_again_s for e in recoveries if e.trained_again_s is not None]
    merged = [e.merged_again_s for e in recoveries if e.merged_again_s is not None]
    return {
        "faults": len(faults),
        "dry_run_faults": sum(1 for e in faults if e.dry_run),
        "skipped": sum(1 for e in entries if e.event == "skipped"),
        "recovered": sum(1 for e in recoveries if e.recovered),
        "not_recovered": sum(1 for e in recoveries if not e.recovered),
        "trained_again_s_median": _median(trained), "trained_again_s_max": max(trained, default=None),
        "merged_again_s_median": _median(merged), "merged_again_s_max": max(merged, default=None),
    }
