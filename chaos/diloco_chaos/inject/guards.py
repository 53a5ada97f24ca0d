"""Who may be hit when a tick comes: scoping (role, unit index, labels, namespace) and the safety guards
(minimum healthy learner units, maximum victims down at once, maximum run time and faults). Pure."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Mapping

from diloco_chaos.inject.experiment import Experiment, SafetySpec, TargetSpec
from diloco_chaos.inject.schedule import Tick


@dataclass(frozen=True)
class Candidate:
    """A unit a fault could hit: a learner unit (one or more processes/pods) or the syncer."""

    unit: str  # the owner: learner id / LearnerUnit name / syncer name; at most one fault per owner at a time
    role: str  # "learner" or "syncer"
    index: int | None = None  # learner unit index
    members: tuple[str, ...] = ()  # process or pod names of the unit
    labels: Mapping[str, str] = field(default_factory=dict)
    alive: bool = True  # every member is running (a unit that is restarting is not)
    namespace: str | None = None


@dataclass(frozen=True)
class Decision:
    """What to do for one tick: victims (with the members hit) and why, or why nothing happens."""

    tick: Tick
    victims: tuple[Candidate, ...] = ()
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # unit -> members hit
    why: str = ""
    skipped: str | None = None


def in_scope(c: Candidate, target: TargetSpec, safety: SafetySpec) -> bool:
    """Whether the experiment may ever touch this unit (its role, index, labels and namespace match)."""
    if (c.role == "syncer") != (target.kind == "syncer"):
        return False
    if target.units is not None and c.index not in target.units:
        return False
    if any(c.labels.get(k) != v for k, v in target.labels.items()):
        return False
    return safety.namespace is None or c.namespace in (None, safety.namespace)


def victims_wanted(target: TargetSpec, in_scope_units: int) -> int:
    """Victims per fault: `count`, or `percent` of the matching units (rounded up, at least 1), else 1."""
    if target.count is not None:
        return target.count
    if target.percent is not None:
        return max(1, math.ceil(target.percent / 100.0 * in_scope_units - 1e-9))
    return 1


def healthy_learners(candidates: list[Candidate], down: set[str]) -> list[Candidate]:
    """Learner units running and not hit by a fault they have not recovered from."""
    return [c for c in candidates if c.role == "learner" and c.alive and c.unit not in down]


def decide(tick: Tick, candidates: list[Candidate], down: set[str], exp: Experiment,
           rng: random.Random) -> Decision:
    """Pick the victims of `tick` among `candidates`, given the units still `down` from earlier faults.

    Never more than safety.maxConcurrent units down at once, never fewer than safety.minAliveUnits healthy
    learner units left, one fault per unit at a time, and only units in scope.
    """
    target, safety = exp.target, exp.safety
    candidates = sorted(candidates, key=lambda c: c.unit)
    scoped = [c for c in candidates if in_scope(c, target, safety)]
    pool = [c for c in scoped if tick.unit is None or c.unit == tick.unit]
    if not pool:
        what = f"{tick.unit} is" if tick.unit else "no unit is"
        return Decision(tick, skipped=f"{what} in the experiment's scope")
    eligible = [c for c in pool if c.alive and c.unit not in down]
    if not eligible:
        states = ", ".join(f"{c.unit} {'recovering' if c.unit in down else 'not running'}" for c in pool)
        return Decision(tick, skipped=f"no eligible unit ({states})")

    wanted = 1 if tick.unit is not None else victims_wanted(target, len(scoped))
    room = safety.max_concurrent - len(down)
    if room <= 0:
        return Decision(tick, skipped=f"safety.maxConcurrent={safety.max_concurrent}: "
                                      f"{len(down)} victim(s) still down ({', '.join(sorted(down))})")
    limits = [wanted, room, len(eligible)]
    if target.kind != "syncer":
        healthy = healthy_learners(candidates, down)
        spare = len(healthy) - safety.min_alive_units
        if spare <= 0:
            return Decision(tick, skipped=f"safety.minAliveUnits={safety.min_alive_units}: only {len(healthy)} "
                                          f"healthy learner unit(s) left")
        limits.append(spare)
    n = min(limits)
    chosen = tuple(sorted(rng.sample(eligible, n), key=lambda c: c.unit))
    members = {c.unit: _members_hit(c, target, rng) for c in chosen}
    if tick.unit is not None:
        why = tick.why
    else:
        why = (f"{tick.why}; {n} of {len(eligible)} eligible chosen at random (seed {exp.schedule.seed}) "
               f"from {[c.unit for c in eligible]}")
    if n < wanted:
        why += f"; {wanted} wanted, limited by the safety guards"
    return Decision(tick, chosen, members, why)


def _members_hit(c: Candidate, target: TargetSpec, rng: random.Random) -> tuple[str, ...]:
    # A "learner" fault takes one process/pod of the unit (one victim per owner); "unit" and "syncer" take all.
    if target.kind == "learner" and len(c.members) > 1:
        return (rng.choice(sorted(c.members)),)
    return tuple(c.members)


def stop_reason(elapsed_s: float, faults: int, safety: SafetySpec) -> str | None:
    """Why the experiment must inject no more faults (run time or fault budget used up), else None."""
    if elapsed_s >= safety.max_duration_s:
        return f"safety.maxDuration of {safety.max_duration} reached"
    if safety.max_faults is not None and faults >= safety.max_faults:
        return f"safety.maxFaults={safety.max_faults} injected"
    return None
