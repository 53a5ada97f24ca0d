"""Goodput: the one definition the project reports everywhere (summary.json, the live display of `diloco local`,
`diloco chaos goodput`, the benchmarks). Pure arithmetic over what a run recorded; readers live in runtime/.

    goodput = useful learner time / allocated learner time

- allocated: each learner slot from its first start to its last exit (or its last report while it still runs),
  dead time, restarts and start-up included;
- busy: time spent in inner steps, Σ (steps in a metrics window × that window's `step_time_s`);
- useful: busy × the slot's merged fraction, the share of its trained steps whose work reached the global model.
  Decoupled: steps_merged / (P · steps), since a step feeds one outer gradient per fragment and the syncer counts
  merged steps per fragment submission; work lost to a crash, a stale base or an overwriting adoption is not
  useful. Synchronous baselines: steps kept in the final model / steps trained (a rollback to a checkpoint throws
  the steps since away).

The merged fraction on its own (the share of all trained steps whose work reached the model) is reported beside
goodput as `merged_fraction`: multiplied by the tokens trained it gives the tokens that reached the model, which is
what the benchmarks compare.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from diloco_trainer.protocol.messages import MetricsRecord


@dataclass(frozen=True)
class Slot:
    """One learner slot of a run: time allocated to it, time in steps, steps trained and steps useful."""

    allocated_s: float
    busy_s: float
    steps: int  # trained, over all incarnations
    useful_steps: float  # of those, the steps whose work is in the global model (fragment-normalized)

    @property
    def merged_fraction(self) -> float:
        return min(1.0, self.useful_steps / self.steps) if self.steps else 0.0

    @property
    def useful_s(self) -> float:
        return self.busy_s * self.merged_fraction


def goodput(slots: Iterable[Slot]) -> dict:
    """Goodput over `slots` with its parts: compute fraction (busy / allocated) and merged fraction (the share of
    all trained steps whose work reached the global model). A figure is None when there is nothing to divide by."""
    slots = list(slots)
    allocated = sum(s.allocated_s for s in slots)
    busy = sum(s.busy_s for s in slots)
    useful = sum(s.useful_s for s in slots)
    steps = sum(s.steps for s in slots)
    return {"goodput": useful / allocated if allocated > 0 else None,
            "compute_fraction": busy / allocated if allocated > 0 else None,
            "merged_fraction": sum(s.steps * s.merged_fraction for s in slots) / steps if steps else None,
            "allocated_s": allocated, "busy_s": busy, "useful_s": useful}


def incarnation_busy(records: list[MetricsRecord]) -> tuple[int, float]:
    """(steps, seconds in steps) of one incarnation's metrics lines; a baseline worker resumed from a checkpoint
    counts from the step it resumed at."""
    ordered = sorted(records, key=lambda r: r.time)
    prev = ordered[0].resumed_from_step if ordered else 0
    first, busy = prev, 0.0
    for rec in ordered:
        if rec.step > prev:
            busy += (rec.step - prev) * float(rec.step_time_s or 0.0)
            prev = rec.step
    return prev - first, busy


def slot(incarnations: list[list[MetricsRecord]], starts: list[float], exits: list[float],
         useful_steps: float) -> Slot:
    """A learner slot from its metrics lines (grouped by incarnation) and the supervisor's start and exit times.

    Allocated from the first start to the last exit, or to the last report (or start) while it still runs.
    """
    lines = [r for group in incarnations for r in group]
    end = max([r.time for r in lines] + ([exits[-1]] if exits and len(exits) >= len(starts) else [])
              + [starts[-1]])
    steps, busy = 0, 0.0
    for group in incarnations:
        s, b = incarnation_busy(group)
        steps, busy = steps + s, busy + b
    return Slot(allocated_s=end - starts[0], busy_s=busy, steps=steps, useful_steps=useful_steps)
