"""Goodput, the one definition (goodput.py), and the learner slots a run directory gives it."""

from __future__ import annotations

import json

import pytest

from diloco_trainer.goodput import Slot, goodput, incarnation_busy
from diloco_trainer.protocol.messages import MetricsRecord
from diloco_trainer.runtime.rundir import learner_slots


def _line(t, step, step_time_s=1.0, **extra):
    return {"time": t, "learner_id": "l", "step": step, "step_time_s": step_time_s, **extra}


def test_goodput_is_useful_step_time_over_allocated_time():
    slots = [Slot(allocated_s=100, busy_s=80, steps=80, useful_steps=40),  # half its steps merged
             Slot(allocated_s=100, busy_s=50, steps=50, useful_steps=50)]
    g = goodput(slots)
    assert g["goodput"] == pytest.approx((40 + 50) / 200)
    assert g["compute_fraction"] == pytest.approx(130 / 200)
    assert g["merged_fraction"] == pytest.approx(90 / 130)  # of all trained steps
    assert goodput([]) == {"goodput": None, "compute_fraction": None, "merged_fraction": None,
                           "allocated_s": 0, "busy_s": 0, "useful_s": 0}


def test_a_slot_never_counts_more_useful_time_than_it_trained():
    assert Slot(allocated_s=10, busy_s=5, steps=5, useful_steps=9).useful_s == 5


def test_a_resumed_baseline_incarnation_counts_busy_time_from_its_checkpoint_step():
    lines = [MetricsRecord.model_validate(_line(t, step, 0.5, resumed_from_step=20)) for t, step in ((1, 24), (2, 30))]
    assert incarnation_busy(lines) == (10, 5.0)


def _run(tmp_path, lines_by_learner, events):
    for name, lines in lines_by_learner.items():
        d = tmp_path / "learners" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


def test_decoupled_slots_count_merged_steps_per_fragment_and_allocate_through_a_restart(tmp_path):
    events = [{"time": 0.0, "name": "learner-0", "role": "learner", "event": "start"},
              {"time": 12.0, "name": "learner-0", "role": "learner", "event": "exit", "code": -9},
              {"time": 20.0, "name": "learner-0", "role": "learner", "event": "start"},
              {"time": 40.0, "name": "learner-0", "role": "learner", "event": "exit", "code": 0}]
    lines = [_line(5, 5), _line(10, 10), _line(25, 5), _line(30, 10)]  # counters restart with the incarnation
    run = _run(tmp_path, {"learner-0": lines}, events)
    (slot,) = learner_slots(run, {"learner-0": 30}, fragments=2).values()
    assert slot == Slot(allocated_s=40.0, busy_s=20.0, steps=20, useful_steps=15.0)
    g = goodput([slot])
    assert g["goodput"] == pytest.approx(15 / 40) and g["merged_fraction"] == pytest.approx(0.75)
    (late,) = learner_slots(run, {"learner-0": 30}, fragments=2, after_startup=True).values()
    assert late.allocated_s == 35.0  # from its first training report


def test_synchronous_slots_keep_only_the_steps_the_final_model_holds(tmp_path):
    events = [{"time": 0.0, "name": "learner-0", "role": "learner", "event": "start"},
              {"time": 30.0, "name": "learner-0", "role": "learner", "event": "start"}]
    lines = [_line(10, 24), _line(40, 30, resumed_from_step=20, acked_steps=10)]  # steps 21..24 trained twice
    run = _run(tmp_path, {"learner-0": lines}, events)
    (slot,) = learner_slots(run, None).values()
    assert slot.steps == 34 and slot.useful_steps == 30 and slot.busy_s == 34.0 and slot.allocated_s == 40.0
