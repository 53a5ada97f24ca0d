"""Scoping and safety guards: minimum healthy units, victims down at once, run time, labels and namespaces."""

from __future__ import annotations

import random

from diloco_chaos.inject.experiment import parse_experiment
from diloco_chaos.inject.guards import Candidate, decide, in_scope, stop_reason, victims_wanted
from diloco_chaos.inject.schedule import Tick, preview

T0 = 1_700_000_040.0


def _exp(**fields):
    raw = {"name": "t", "schedule": {"every": "1s"}}
    for key, value in fields.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return parse_experiment(raw)


def _units(n: int, pods: int = 1, alive: bool = True) -> list[Candidate]:
    return [Candidate(f"u{i}", "learner", i, tuple(f"u{i}-r{r}" for r in range(pods)),
                      {"diloco.dev/template": "h100" if i % 2 else "l4"}, alive, "team-a") for i in range(n)]


def _tick(i: int = 0, unit=None) -> Tick:
    return Tick(T0 + i, i, unit, f"tick {i}")


def test_min_alive_guard_holds_under_a_schedule_that_would_break_it():
    # Every second, 3 victims wanted out of 5 units, nobody ever recovers: without the guard all would die.
    exp = _exp(target={"count": 3}, safety={"minAliveUnits": 2, "maxConcurrent": 10})
    units, down, rng = _units(5), set(), random.Random(0)
    skipped = []
    for tick in preview(exp.schedule, T0, T0 + 30):
        d = decide(tick, units, down, exp, rng)
        down |= {v.unit for v in d.victims}
        if d.skipped:
            skipped.append(d.skipped)
        assert len(units) - len(down) >= 2
    assert len(down) == 3
    assert skipped and all("minAliveUnits=2" in s for s in skipped)


def test_units_not_running_count_against_the_minimum():
    exp = _exp(safety={"minAliveUnits": 2, "maxConcurrent": 3})
    units = _units(3)
    units[0] = Candidate("u0", "learner", 0, ("u0-r0",), alive=False)  # restarting on its own
    d = decide(_tick(), units, {"u1"}, exp, random.Random(0))
    assert not d.victims and "only 1 healthy" in d.skipped


def test_max_concurrent_limits_victims_down_at_once():
    exp = _exp(target={"count": 4}, safety={"minAliveUnits": 0, "maxConcurrent": 2})
    d = decide(_tick(), _units(6), set(), exp, random.Random(0))
    assert len(d.victims) == 2 and "limited by the safety guards" in d.why
    d = decide(_tick(1), _units(6), {"u0", "u1"}, exp, random.Random(0))
    assert not d.victims and "maxConcurrent=2" in d.skipped


def test_a_unit_still_recovering_is_not_hit_again():
    exp = _exp(safety={"minAliveUnits": 0, "maxConcurrent": 5})
    rng = random.Random(0)
    for i in range(20):
        d = decide(_tick(i), _units(2), {"u0"}, exp, rng)
        assert [v.unit for v in d.victims] == ["u1"]


def test_scoping_by_unit_index_labels_and_namespace():
    units = _units(6)
    by_index = _exp(target={"units": [1, 4]}).target
    assert [c.unit for c in units if in_scope(c, by_index, _exp().safety)] == ["u1", "u4"]
    by_label = _exp(target={"labels": {"diloco.dev/template": "h100"}}).target
    assert [c.unit for c in units if in_scope(c, by_label, _exp().safety)] == ["u1", "u3", "u5"]
    other_ns = _exp(safety={"namespace": "team-b"}).safety
    assert not any(in_scope(c, _exp().target, other_ns) for c in units)
    syncer = Candidate("job-syncer", "syncer", None, ("job-syncer-abc",))
    assert not in_scope(syncer, _exp().target, _exp().safety)
    assert in_scope(syncer, _exp(target={"kind": "syncer"}).target, _exp().safety)


def test_victims_come_only_from_the_scope():
    exp = _exp(target={"labels": {"diloco.dev/template": "h100"}}, safety={"minAliveUnits": 0})
    rng = random.Random(1)
    hit = {decide(_tick(i), _units(6), set(), exp, rng).victims[0].unit for i in range(50)}
    assert hit == {"u1", "u3", "u5"}


def test_percent_takes_that_share_of_the_matching_units_rounded_up():
    assert victims_wanted(_exp(target={"percent": 50}).target, 5) == 3
    assert victims_wanted(_exp(target={"percent": 10}).target, 4) == 1
    assert victims_wanted(_exp(target={"percent": 100}).target, 4) == 4
    assert victims_wanted(_exp().target, 9) == 1
    exp = _exp(target={"percent": 50}, safety={"minAliveUnits": 0, "maxConcurrent": 10})
    assert len(decide(_tick(), _units(8), set(), exp, random.Random(0)).victims) == 4


def test_a_learner_fault_hits_one_pod_per_unit_and_a_unit_fault_all_of_them():
    units = _units(3, pods=4)
    one = decide(_tick(), units, set(), _exp(safety={"minAliveUnits": 0}), random.Random(0))
    assert len(one.members[one.victims[0].unit]) == 1
    whole = decide(_tick(), units, set(), _exp(target={"kind": "unit"}, safety={"minAliveUnits": 0}),
                   random.Random(0))
    assert len(whole.members[whole.victims[0].unit]) == 4


def test_an_mtbf_tick_hits_only_its_own_unit_and_skips_when_it_is_down():
    exp = _exp(safety={"minAliveUnits": 0, "maxConcurrent": 3})
    d = decide(_tick(unit="u2"), _units(4), set(), exp, random.Random(0))
    assert [v.unit for v in d.victims] == ["u2"]
    d = decide(_tick(unit="u2"), _units(4), {"u2"}, exp, random.Random(0))
    assert not d.victims and "u2 recovering" in d.skipped


def test_the_syncer_target_is_not_limited_by_the_learner_minimum():
    exp = _exp(target={"kind": "syncer"}, safety={"minAliveUnits": 5})
    syncer = Candidate("job-syncer", "syncer", None, ("job-syncer-abc",))
    d = decide(_tick(), _units(2) + [syncer], set(), exp, random.Random(0))
    assert [v.unit for v in d.victims] == ["job-syncer"]


def test_run_time_and_fault_budget_end_the_experiment():
    safety = _exp(safety={"maxDuration": "10m", "maxFaults": 3}).safety
    assert stop_reason(599, 2, safety) is None
    assert "maxDuration" in stop_reason(600, 0, safety)
    assert "maxFaults=3" in stop_reason(10, 3, safety)
