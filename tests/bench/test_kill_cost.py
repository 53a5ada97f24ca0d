"""The breakdown of one kill (bench/diloco_bench/kill_cost.py) from a run directory written the way `diloco local`
and `diloco chaos` write theirs."""

import json
import time

import pytest
import yaml

from diloco_bench import kill_cost
from diloco_trainer.protocol.chaos_record import ChaosEntry

T0 = time.mktime(time.strptime("2026-11-24 20:00:00", "%Y-%m-%d %H:%M:%S"))


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(round((t % 1) * 1000)):03d}"


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "learners" / "learner-1").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"outer": {"fragments": 4}}))
    kill = T0 + 100.0
    events = [{"time": T0, "name": "learner-1", "role": "learner", "event": "start", "pid": 10},
              {"time": kill + 0.3, "name": "learner-1", "role": "learner", "event": "exit", "code": -9},
              {"time": kill + 2.3, "name": "learner-1", "role": "learner", "event": "start", "pid": 11, "spare": True}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = [  # the killed life: 40 steps, 4 × 20 fragment-steps acknowledged; then the new one, 1 step a line
        {"time": kill - 0.2, "step": 40, "acked_steps": 80, "acked": 5, "step_time_s": 0.4},
        {"time": kill + 4.0, "step": 1, "acked_steps": 0, "acked": 0, "step_time_s": 0.5},
        {"time": kill + 4.4, "step": 2, "acked_steps": 0, "acked": 0, "step_time_s": 0.4},
        {"time": kill + 7.0, "step": 8, "acked_steps": 5, "acked": 1, "step_time_s": 0.4}]
    (run / "learners" / "learner-1" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    log = [f"{_stamp(T0 + 1)} INFO learner-1[0] diloco_trainer.learner.client: syncer reachable",
           "\n=== 20:01:42 start #2: warm spare pid 11 takes over",
           f"{_stamp(kill + 2.35)} INFO learner-1[0] diloco_trainer.learner.main: warm spare took over (pid 11, x)",
           f"{_stamp(kill + 2.4)} INFO learner-1[0] diloco_trainer.learner.client: syncer reachable",
           f"{_stamp(kill + 3.1)} INFO learner-1[0] diloco_trainer.data.corpus: corpus from cache x.train.npy (1 / 1 bytes)",
           f"{_stamp(kill + 3.2)} INFO learner-1[0] diloco_trainer.learner.loop: learner learner-1 (...) starting at versions",
           f"{_stamp(kill + 3.3)} INFO learner-1[0] diloco_trainer.learner.loop: resending the unsent work of the "
           "previous start: 3 of 4 fragment(s), 1 of them rebased onto a newer version (24 steps)"]
    (run / "logs" / "learner-1.log").write_text("\n".join(log) + "\n")
    record = [ChaosEntry(event="fault", time=kill, unit="learner-1", fault=1),
              ChaosEntry(event="recovery", time=kill + 7.5, fault=1, unit="learner-1", merged_again_s=7.5)]
    return run, record


def test_a_kill_is_broken_down_into_the_phases_of_its_recovery_and_the_work_it_lost(tmp_path):
    run, record = _run_dir(tmp_path)
    [k] = kill_cost.kills(run, record, overwritten=0.1)
    assert k["spare"] is True
    assert k["exit_seen"] == pytest.approx(0.3) and k["restarted"] == pytest.approx(2.3)
    assert k["assigned"] == pytest.approx(2.35, abs=0.002) and k["registered"] == pytest.approx(2.4, abs=0.002)
    assert k["corpus"] == pytest.approx(3.1, abs=0.002) and k["ready"] == pytest.approx(3.2, abs=0.002)
    assert k["first_step"] == pytest.approx(4.0) and k["first_acked"] == pytest.approx(7.0)
    assert k["merged_again"] == 7.5
    # 40 steps trained (+0.5 until the kill), 20 of them acknowledged per fragment; 10% would be overwritten anyway.
    # The next life resent 24 fragment-steps (6 per fragment) of its snapshot: merged, so not lost.
    assert k["unacked_steps"] == pytest.approx(20.5) and k["resent_steps"] == pytest.approx(6.0)
    assert k["lost_steps"] == pytest.approx(20.5 - 6.0 - 4.05)
    assert k["lost_s"] == pytest.approx(k["lost_steps"] * 0.4)
    summary = kill_cost.phase_summary([k])
    assert summary["kills"] == 1 and summary["first_step"]["median"] == pytest.approx(4.0)
    assert "first step 4.0" in kill_cost.describe(summary)


def test_where_the_steps_went_counts_each_life_once_at_its_last_line(tmp_path):
    run, _ = _run_dir(tmp_path)
    path = run / "learners" / "learner-1" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0]["steps_discarded"], lines[-1]["steps_discarded"] = 40, 3
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    went = kill_cost.steps_went(run)
    # Two lives: 40 and 8 steps of 4 fragments; 80 + 5 acknowledged, 40 + 3 discarded, the rest lost.
    assert went["trained"] == 192
    assert went["acked"] == pytest.approx(85 / 192) and went["discarded"] == pytest.approx(43 / 192)
    assert went["lost"] == pytest.approx(64 / 192)
