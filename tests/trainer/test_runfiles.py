"""The run-directory files other packages read, through their one reader: final/state.json in both shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_trainer.protocol.runfiles import BaselineFinalState, SyncerFinalState, read_final_state


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
