"""The run-directory files other packages read, through their one reader: final/state.json in both shapes and
events.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_trainer.protocol.runfiles import (BaselineFinalState, RunEvent, SyncerFinalState, append_event, read_events,
                                              read_final_state, starts_by_name)


def _write(run_dir: Path, doc) -> Path:
    (run_dir / "final").mkdir(parents=True, exist_ok=True)
    (run_dir / "final" / "state.json").write_text(json.dumps(doc))
    return run_dir


def test_a_syncer_final_state_reads_as_its_merged_counters_per_learner(tmp_path):
    state = read_final_state(_write(tmp_path, {
        "format": 3, "versions": {"0": 4, "1": 5}, "outer_steps": {"0": 4, "1": 5}, "tokens_merged": 900,
        "learners": {"learner-0": {"tokens_merged": 600, "steps_merged": 12, "submissions_merged": 6},
                     "learner-1": {"steps_merged": 3}},
        "merged_ids": {"x": [0, 1]}, "policy": {"ema": 1.0}}))
    assert isinstance(state, SyncerFinalState)
    assert state.learners["learner-0"].steps_merged == 12 and state.learners["learner-1"].tokens_merged == 0
    assert state.versions == {"0": 4, "1": 5}


def test_a_baseline_final_state_reads_as_the_baseline_shape(tmp_path):
    state = read_final_state(_write(tmp_path, {"mode": "ddp", "steps": 24, "outer_steps": 24, "learners": 2,
                                               "wall_s": 31.5}))
    assert state == BaselineFinalState(mode="ddp", steps=24, outer_steps=24, learners=2, wall_s=31.5)


def test_a_run_without_a_final_state_reads_as_none(tmp_path):
    assert read_final_state(tmp_path) is None


@pytest.mark.parametrize("doc, field", [
    ({"mode": "ddp", "steps": "many", "outer_steps": 1, "learners": 2, "wall_s": 1.0}, "steps"),
    ({"mode": "ring", "steps": 1, "outer_steps": 1, "learners": 2, "wall_s": 1.0}, "mode"),
    ({"learners": {"learner-0": {"steps_merged": "x"}}}, "learners"),
    ([1, 2], "not a JSON object"),
])
def test_a_final_state_of_neither_shape_is_a_value_error_naming_the_file_and_field(tmp_path, doc, field):
    with pytest.raises(ValueError, match=rf"state\.json: .*{field}"):
        read_final_state(_write(tmp_path, doc))


def test_events_written_by_the_one_writer_read_back_as_the_same_events(tmp_path):
    events = [RunEvent(time=1.0, name="learner-0", role="learner", event="start", pid=10),
              RunEvent(time=5.0, name="learner-0", role="learner", event="exit", code=-9),
              RunEvent(time=6.0, name="learner-0", role="learner", event="start", pid=11, spare=True),
              RunEvent(time=7.0, name="job", role="job", event="job_restart", restart=1, code=0, lost_steps=0,
                       lost_steps_by_worker={"learner-1": 0})]
    for e in events:
        append_event(tmp_path / "events.jsonl", e)
    assert read_events(tmp_path) == events
    assert starts_by_name(events) == {"learner-0": [1.0, 6.0]}
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines[1] == {"time": 5.0, "name": "learner-0", "role": "learner", "event": "exit", "code": -9}
    assert lines[3]["code"] == 0 and lines[3]["lost_steps"] == 0  # a zero is a value, not a default left out


def test_events_of_a_run_still_writing_skip_the_torn_last_line(tmp_path):
    append_event(tmp_path / "events.jsonl", RunEvent(time=1.0, name="syncer", role="syncer", event="start", pid=3))
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 2.0, "name": "syn')
    assert [e.name for e in read_events(tmp_path)] == ["syncer"]
    assert read_events(tmp_path / "nowhere") == []


def test_an_event_of_another_shape_is_a_value_error_naming_the_line_and_field(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1.0, "name": "a", "role": "learner", "event": "start"})
                                           + "\n" + json.dumps({"time": 2.0, "name": "a", "role": "learner",
                                                                "event": "vanished"}) + "\n")
    with pytest.raises(ValueError, match=r"events\.jsonl, line 2: event"):
        read_events(tmp_path)
