"""Schedules: fixed interval, cron and per-unit Poisson (MTBF) ticks, seeded and reproducible."""

from __future__ import annotations

import random
import statistics

import pytest

from diloco_chaos.inject.experiment import ScheduleSpec
from diloco_chaos.inject.experiment import parse_experiment
from diloco_chaos.inject.guards import Candidate, decide
from diloco_chaos.inject.schedule import Schedule, preview

T0 = 1_700_000_040.0  # a whole even minute (UTC), so cron ticks land on round offsets


def test_interval_ticks_every_period_starting_one_period_in():
    ticks = preview(ScheduleSpec(every="2m"), T0, T0 + 600)
    assert [t.at - T0 for t in ticks] == [120, 240, 360, 480, 600]
    assert [t.index for t in ticks] == [0, 1, 2, 3, 4]
    assert all(t.unit is None for t in ticks)


def test_start_after_sets_the_first_interval_tick():
    ticks = preview(ScheduleSpec(every=60, start_after="30s"), T0, T0 + 200)
    assert [t.at - T0 for t in ticks] == [30, 90, 150]


def test_due_hands_out_each_tick_once_and_only_when_its_time_has_come():
    sched = Schedule(ScheduleSpec(every="10s"), T0)
    assert sched.due(T0 + 9.9) == []
    assert [t.at - T0 for t in sched.due(T0 + 10)] == [10]
    assert sched.due(T0 + 10) == []
    assert [t.at - T0 for t in sched.due(T0 + 35)] == [20, 30]
    assert sched.next_at() == T0 + 40


def test_cron_ticks_follow_the_expression():
    ticks = preview(ScheduleSpec(cron="*/2 * * * *"), T0, T0 + 400)
    assert [t.at - T0 for t in ticks] == [120, 240, 360]
    assert "cron" in ticks[0].why


def test_a_sixth_cron_field_gives_second_resolution():
    ticks = preview(ScheduleSpec(cron="* * * * * */15"), T0, T0 + 60)
    assert [t.at - T0 for t in ticks] == [15, 30, 45, 60]


def test_mtbf_ticks_name_their_unit_and_repeat_exactly_with_the_same_seed():
    units = [f"learner-{i}" for i in range(4)]
    a = preview(ScheduleSpec(mtbf="1m", seed=3), T0, T0 + 3600, units)
    b = preview(ScheduleSpec(mtbf="1m", seed=3), T0, T0 + 3600, units)
    c = preview(ScheduleSpec(mtbf="1m", seed=4), T0, T0 + 3600, units)
    assert [(t.at, t.unit) for t in a] == [(t.at, t.unit) for t in b]
    assert [(t.at, t.unit) for t in a] != [(t.at, t.unit) for t in c]
    assert {t.unit for t in a} == set(units)
    assert [t.at for t in a] == sorted(t.at for t in a)


def test_mtbf_mean_gap_per_unit_is_the_mtbf():
    ticks = preview(ScheduleSpec(mtbf=60, seed=1), T0, T0 + 200 * 3600, ["u"])
    gaps = [b.at - a.at for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 10_000
    assert statistics.mean(gaps) == pytest.approx(60, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(60, rel=0.1)  # exponential: stdev = mean


def test_adding_a_unit_leaves_the_other_units_failures_unchanged():
    spec = ScheduleSpec(mtbf="5m", seed=0)
    two = preview(spec, T0, T0 + 7200, ["a", "b"])
    three = preview(spec, T0, T0 + 7200, ["a", "b", "c"])
    assert [(t.at, t.unit) for t in two] == [(t.at, t.unit) for t in three if t.unit != "c"]


def test_ticks_of_units_that_are_gone_are_dropped():
    sched = Schedule(ScheduleSpec(mtbf="10s", seed=0), T0, ["a", "b"])
    ticks = sched.due(T0 + 600, ["a"])
    assert ticks and {t.unit for t in ticks} == {"a"}


def test_a_unit_seen_later_starts_its_failure_clock_when_it_appears():
    sched = Schedule(ScheduleSpec(mtbf="10s", seed=0), T0, ["a"])
    sched.due(T0 + 1000, ["a"])
    ticks = sched.due(T0 + 1000, ["a", "late"])
    assert all(t.unit != "late" for t in ticks)  # its first failure is after it appeared, not in the past
    later = sched.due(T0 + 2000, ["a", "late"])
    assert any(t.unit == "late" and t.at > T0 + 1000 for t in later)


def test_a_fixed_seed_gives_the_same_victims_at_every_tick():
    exp = parse_experiment({"name": "x", "schedule": {"every": "1m", "seed": 42}, "safety": {"minAliveUnits": 0}})
    units = [Candidate(f"learner-{i}", "learner", i, (f"learner-{i}",)) for i in range(6)]

    def victims(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [decide(t, units, set(), exp, rng).victims[0].unit
                for t in preview(exp.schedule, T0, T0 + 3600)]

    first = victims(42)
    assert len(first) == 60 and first == victims(42)
    assert first != victims(43)
    assert set(first) == {c.unit for c in units}  # every unit gets its turn over an hour
