"""Experiment descriptions: the examples are valid, durations parse, and every bad field is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco_chaos.inject.experiment import load_experiment, parse_duration, parse_experiment

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "chaos" / "examples").glob("*.yaml"))


def test_there_are_examples_and_every_one_is_valid():
    assert len(EXAMPLES) >= 3
    names = {load_experiment(p).name for p in EXAMPLES}
    assert "learner-dies-every-2-minutes" in names


def test_the_two_minute_example_means_a_learner_kill_every_120_seconds():
    exp = load_experiment(next(p for p in EXAMPLES if p.stem == "learner-dies-every-2-minutes"))
    assert exp.schedule.every_s == 120 and exp.action.type == "kill" and exp.target.kind == "learner"


@pytest.mark.parametrize("text, seconds", [(90, 90), ("90", 90), ("90s", 90), ("2m", 120), ("1h30m", 5400),
                                           ("500ms", 0.5), ("1.5s", 1.5), ("1d", 86400), (2.5, 2.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["2q", "m", "", "-5s", "5 minutes", True, -1])
def test_malformed_durations_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_snake_case_is_accepted_like_camel_case():
    a = parse_experiment({"name": "x", "schedule": {"every": 5, "startAfter": 3}, "safety": {"minAliveUnits": 2}})
    b = parse_experiment({"name": "x", "schedule": {"every": 5, "start_after": 3}, "safety": {"min_alive_units": 2}})
    assert a == b and a.schedule.start_after_s == 3


GOOD = {"name": "ok", "schedule": {"every": "1m"}}


def _with(path: str, value):
    raw = {"name": "ok", "schedule": {"every": "1m"}}
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return raw


@pytest.mark.parametrize("raw, field", [
    (_with("schedule.every", "soon"), "schedule.every"),
    (_with("schedule.every", 0), "schedule"),
    (_with("schedule.cron", "* * * * *"), "schedule"),  # two schedules given
    ({"name": "ok", "schedule": {"cron": "not cron"}}, "schedule.cron"),
    ({"name": "ok", "schedule": {}}, "schedule"),
    ({"name": "ok"}, "schedule"),
    (_with("name", "Learner_Dies"), "name"),
    (_with("target.kind", "gpu"), "target.kind"),
    (_with("target.units", []), "target.units"),
    (_with("target.units", [-1]), "target.units"),
    (_with("target.percent", 150), "target.percent"),
    ({**GOOD, "target": {"count": 1, "percent": 10}}, "target"),
    ({**GOOD, "target": {"kind": "syncer", "units": [0]}}, "target"),
    (_with("action.type", "explode"), "action.type"),
    (_with("action.type", "fail"), "action"),  # no exit code
    ({**GOOD, "action": {"type": "fail", "exitCode": 300}}, "action.exitCode"),
    ({**GOOD, "action": {"type": "pause"}}, "action"),  # no duration
    ({**GOOD, "action": {"type": "kill", "duration": "5s"}}, "action"),
    (_with("safety.minAliveUnits", -1), "safety.minAliveUnits"),
    (_with("safety.maxConcurrent", 0), "safety.maxConcurrent"),
    (_with("safety.maxDuration", "0s"), "safety.maxDuration"),
    (_with("safety.recoveryTimeout", "eventually"), "safety.recoveryTimeout"),
    (_with("safety.blastRadius", 3), "safety.blastRadius"),  # unknown field
    (_with("surprise", 1), "surprise"),
])
def test_a_bad_description_is_rejected_naming_the_field(raw, field):
    with pytest.raises(ValueError) as info:
        parse_experiment(raw)
    message = str(info.value)
    assert message.startswith("invalid chaos experiment")
    assert f"\n  {field}:" in message, message


def test_a_file_error_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: ok\nschedule: {every: 1m}\naction: {type: pause}\n")
    with pytest.raises(ValueError, match="(?s)bad.yaml.*action: a pause action needs a duration"):
        load_experiment(path)
    path.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_experiment(path)
    with pytest.raises(ValueError, match="not found"):
        load_experiment(tmp_path / "missing.yaml")


def test_a_mtbf_schedule_cannot_target_the_syncer_and_a_pause_takes_no_downtime():
    with pytest.raises(ValueError, match="mtbf is per learner unit"):
        parse_experiment({"name": "x", "schedule": {"mtbf": "5m"}, "target": {"kind": "syncer"}})
    with pytest.raises(ValueError, match="downtime applies to kill and fail"):
        parse_experiment({"name": "x", "schedule": {"every": "1m", "downtime": "10s"},
                          "action": {"type": "pause", "duration": "5s"}})


def test_a_jobs_spec_chaos_becomes_an_experiment_scoped_to_that_job():
    from diloco_chaos.inject.experiment import JobChaos

    chaos = JobChaos.model_validate({"schedule": {"every": "2m"}, "safety": {"minAliveUnits": 2}})
    exp = chaos.to_experiment("llm-7b", "team-a")
    assert exp.name == "llm-7b-chaos" and exp.safety.namespace == "team-a" and exp.safety.min_alive_units == 2
    assert exp.schedule.every_s == 120
    with pytest.raises(ValueError, match="mtbf is per learner unit"):
        JobChaos.model_validate({"schedule": {"mtbf": "5m"}, "target": {"kind": "syncer"}})
    with pytest.raises(ValueError, match="name"):
        JobChaos.model_validate({"name": "x", "schedule": {"every": "2m"}})  # the job names it
