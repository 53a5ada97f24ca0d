"""Goodput (useful learner compute / allocated learner time) and system uptime, from a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from diloco_chaos.goodput import advances_from_samples, from_counters, from_run_dir, uptime
from diloco_trainer.goodput import incarnation_busy
from diloco_trainer.protocol.messages import MetricsRecord, SyncerSample


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _lines(name: str, t0: float, steps: int, step_s: float, every: int = 5) -> list[dict]:
    return [{"time": t0 + s * step_s, "learner_id": name, "step": s, "step_time_s": step_s, "tokens": 64 * s}
            for s in range(every, steps + 1, every)]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two learners, P = 2 fragments, 1 s steps. learner-0 trains 90 steps over 100 s, all of it merged;
    learner-1 is killed at t=40 (30 steps, 1 s each), restarts at t=50 and trains 40 steps from t=60;
    half of its fragment contributions were merged. The syncer merges every second but stalls 40 s → 60 s."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"outer": {"fragments": 2}}))
    _jsonl(tmp_path / "events.jsonl", [
        {"time": 0.0, "name": "syncer", "role": "syncer", "event": "start"},
        {"time": 0.0, "name": "learner-0", "role": "learner", "event": "start"},
        {"time": 0.0, "name": "learner-1", "role": "learner", "event": "start"},
        {"time": 40.0, "name": "learner-1", "role": "learner", "event": "exit", "code": -9},
        {"time": 50.0, "name": "learner-1", "role": "learner", "event": "start"},
        {"time": 100.0, "name": "learner-0", "role": "learner", "event": "exit", "code": 0},
        {"time": 100.0, "name": "learner-1", "role": "learner", "event": "exit", "code": 0},
    ])
    _jsonl(tmp_path / "learners/learner-0/metrics.jsonl", _lines("learner-0", 10.0, 90, 1.0))
    _jsonl(tmp_path / "learners/learner-1/metrics.jsonl",
           _lines("learner-1", 10.0, 30, 1.0) + _lines("learner-1", 60.0, 40, 1.0))
    (tmp_path / "final").mkdir()
    (tmp_path / "final/state.json").write_text(json.dumps({"learners": {
        "learner-0": {"steps_merged": 180, "tokens_merged": 0}, "learner-1": {"steps_merged": 70}}}))
    samples, steps = [], 0
    for t in range(11, 101):
        if not 40 <= t < 60:
            steps += 1
        samples.append({"time": float(t), "up": True, "outer_steps": steps, "fragments": 2, "learners": {}})
    _jsonl(tmp_path / "syncer.jsonl", samples)
    (tmp_path / "learners").mkdir(exist_ok=True)
    return tmp_path


def test_goodput_counts_only_merged_work_over_allocated_time(run_dir):
    g = from_run_dir(run_dir)
    l0, l1 = g["learners"]["learner-0"], g["learners"]["learner-1"]
    assert l0["busy_s"] == pytest.approx(90) and l0["merged_fraction"] == pytest.approx(1.0)
    assert l1["incarnations"] == 2 and l1["steps"] == 70 and l1["busy_s"] == pytest.approx(70)
    assert l1["merged_fraction"] == pytest.approx(0.5)  # 70 merged fragment-steps of 2 × 70
    assert l1["allocated_s"] == pytest.approx(100)  # the slot stays allocated while the learner is dead
    assert g["useful_s"] == pytest.approx(90 + 35)
    assert g["goodput"] == pytest.approx(125 / 200)
    assert g["compute_fraction"] == pytest.approx(160 / 200)
    assert g["merged_fraction"] == pytest.approx(125 / 160)
    # Counted from each learner's first report (t=15): the one-time start-up is left out, the restart's is not.
    assert g["goodput_after_startup"] == pytest.approx(125 / (85 + 85))


def test_uptime_counts_the_stall_as_down(run_dir):
    g = from_run_dir(run_dir)
    assert g["first_merge_after_s"] == pytest.approx(12.0)
    assert len(g["stalls"]) == 1
    stall = g["stalls"][0]
    assert stall["s"] == pytest.approx(21.0)  # last advance at 39, next at 60
    assert g["uptime"] == pytest.approx(1 - 21.0 / (100 - 12))


def test_a_learner_that_never_trained_is_allocated_and_useless(run_dir):
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": 20.0, "name": "learner-2", "role": "learner", "event": "start"}) + "\n")
        f.write(json.dumps({"time": 30.0, "name": "learner-2", "role": "learner", "event": "exit", "code": 2}) + "\n")
    g = from_run_dir(run_dir)
    assert g["learners"]["learner-2"]["allocated_s"] == pytest.approx(10)
    assert g["learners"]["learner-2"]["useful_s"] == 0
    assert g["goodput"] == pytest.approx(125 / 210)


def test_busy_time_of_an_incarnation_weights_each_window_by_its_step_time():
    recs = [MetricsRecord.model_validate(r) for r in (
        {"time": 1, "step": 5, "step_time_s": 0.2}, {"time": 2, "step": 10, "step_time_s": 0.4},
        {"time": 3, "step": 10, "step_time_s": 9.9, "final": True})]  # a final line adds no steps
    assert incarnation_busy(recs) == (10, pytest.approx(5 * 0.2 + 5 * 0.4))


def test_uptime_is_whole_when_the_model_keeps_advancing():
    assert uptime([float(t) for t in range(0, 101)], 0.0, 100.0)["uptime"] == 1.0
    assert uptime([], 0.0, 100.0)["uptime"] == 0.0


def test_merges_across_a_gap_in_the_samples_are_spread_over_it():
    def sample(t, outer_steps, uptime_s):
        return SyncerSample.from_line({"time": t, "elapsed_s": t, "up": True, "outer_steps": outer_steps,
                                       "uptime_s": uptime_s})

    # The sampler missed 20 s, but the syncer merged 10 times in between: the model kept advancing.
    samples = [sample(0.0, 0, 50.0), sample(20.0, 10, 70.0)]
    assert advances_from_samples(samples) == pytest.approx([2.0 * i for i in range(1, 11)])
    # The syncer restarted 5 s before the second sample: its 10 merges (a replayed spool) all came after that.
    samples[1] = sample(20.0, 10, 5.0)
    adv = advances_from_samples(samples)
    assert min(adv) > 15.0 and uptime(adv, 0.0, 20.0, threshold_s=3.0)["uptime"] == pytest.approx(1 - 15.5 / 20)


def test_cluster_goodput_from_prometheus_counters():
    # 4 units for 1000 s, 100 tokens/s each when healthy, P = 2: 2 units' worth of merged fragment-tokens.
    g = from_counters(tokens_merged=2 * 2 * 100 * 1000, tokens_trained=3 * 100 * 1000, unit_tokens_per_s=100,
                      units=4, fragments=2, wall_s=1000, advances=[float(t) for t in range(0, 1001, 2)], start=0)
    assert g["goodput"] == pytest.approx(0.5) and g["compute_fraction"] == pytest.approx(0.75)
    assert g["uptime"] == 1.0
    with pytest.raises(ValueError):
        from_counters(1, 1, 0, 4, 2, 1000, [], 0)


def test_a_directory_that_is_not_a_run_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        from_run_dir(tmp_path)


def test_the_shutdown_drain_is_not_a_stall_but_stays_allocated(run_dir):
    before = from_run_dir(run_dir)
    with open(run_dir / "learners/learner-0/metrics.jsonl", "a") as f:  # drained for 25 s after the last step
        f.write(json.dumps({"time": 125.0, "step": 90, "step_time_s": 1.0, "final": True}) + "\n")
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": 126.0, "name": "learner-0", "role": "learner", "event": "exit", "code": 0}) + "\n")
    after = from_run_dir(run_dir)
    assert after["uptime"] == pytest.approx(before["uptime"]) and len(after["stalls"]) == 1
    assert after["learners"]["learner-0"]["allocated_s"] == pytest.approx(126.0)
