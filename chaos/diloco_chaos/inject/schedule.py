"""When faults happen: a fixed interval, a cron expression, or per-unit Poisson failures (MTBF). Pure and seeded:
the same spec, start time and units give the same ticks."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Iterable

from croniter import croniter

from diloco_chaos.inject.experiment import ScheduleSpec


@dataclass(frozen=True)
class Tick:
    """One scheduled fault: when (unix seconds), its number, the unit it names (MTBF) or None (pick one), why."""

    at: float
    index: int
    unit: str | None
    why: str


def unit_rng(seed: int, unit: str) -> random.Random:
    """The failure clock of one unit: its own stream, so adding a unit never changes another unit's failures."""
    return random.Random(f"diloco-chaos/{seed}/{unit}")


class Schedule:
    """Ticks of one experiment. `due(now, units)` hands out every tick whose time has come, in time order."""

    def __init__(self, spec: ScheduleSpec, start: float, units: Iterable[str] = ()):
        self.spec = spec
        self.start = start
        self.issued = 0
        self._next: float | None = None  # every / cron: the next tick time
        self._clocks: list[tuple[float, str]] = []  # mtbf: (next failure time, unit), a heap
        self._rngs: dict[str, random.Random] = {}
        if spec.kind == "every":
            self._next = start + (spec.start_after_s or spec.every_s)
        elif spec.kind == "cron":
            self._cron = croniter(spec.cron, start + spec.start_after_s)
            self._next = self._cron.get_next(float)
        self.add_units(units, start)

    def add_units(self, units: Iterable[str], now: float) -> None:
        """MTBF: start a failure clock for every unit not seen before (its first failure counts from `now`)."""
        if self.spec.kind != "mtbf":
            return
        for unit in units:
            if unit in self._rngs:
                continue
            rng = self._rngs[unit] = unit_rng(self.spec.seed, unit)
            origin = max(now, self.start + self.spec.start_after_s)
            heapq.heappush(self._clocks, (origin + rng.expovariate(1.0 / self.spec.mtbf_s), unit))

    def next_at(self) -> float | None:
        """When the next tick is due (for the runner's sleep and the progress display)."""
        if self.spec.kind == "mtbf":
            return self._clocks[0][0] if self._clocks else None
        return self._next

    def due(self, now: float, units: Iterable[str] = ()) -> list[Tick]:
        """Every tick at or before `now`. MTBF ticks name their unit; ticks of units not in `units` are dropped
        (a unit that was scaled away fails no more), but its clock keeps running in case it comes back."""
        units = list(units)
        self.add_units(units, now)
        present = set(units)
        out: list[Tick] = []
        if self.spec.kind == "mtbf":
            while self._clocks and self._clocks[0][0] <= now:
                at, unit = heapq.heappop(self._clocks)
                gap = self._rngs[unit].expovariate(1.0 / self.spec.mtbf_s)
                heapq.heappush(self._clocks, (at + gap, unit))
                if unit in present:
                    out.append(self._tick(at, unit, f"mtbf {self.spec.mtbf}: failure clock of {unit} fired"))
            return out
        while self._next is not None and self._next <= now:
            at = self._next
            if self.spec.kind == "every":
                self._next = at + self.spec.every_s
                why = f"every {self.spec.every}: tick #{self.issued + 1}"
            else:
                self._next = self._cron.get_next(float)
                why = f"cron {self.spec.cron!r}: tick #{self.issued + 1}"
            out.append(self._tick(at, None, why))
        return out

    def _tick(self, at: float, unit: str | None, why: str) -> Tick:
        tick = Tick(at, self.issued, unit, why)
        self.issued += 1
        return tick


def preview(spec: ScheduleSpec, start: float, until: float, units: Iterable[str] = ()) -> list[Tick]:
    """Every tick from `start` to `until` for a fixed set of units (dry runs and tests)."""
    return Schedule(spec, start, units).due(until, units)
