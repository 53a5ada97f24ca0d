"""Recovery tracking: trained again and merged again, from observations of the run (pure, with given times)."""

from __future__ import annotations

import pytest

from diloco_chaos.inject.record import Record, RecoveryTracker, UnitObservation, summarize
from diloco_trainer.protocol.chaos_record import ChaosEntry, read_record


def obs(started=None, lines=(), merged=(), running=True, running_since=None, no_lines=False):
    return UnitObservation(started=started, running=running, lines=None if no_lines else list(lines),
                           running_since=running_since, merged=None if merged is None else list(merged))


def test_a_killed_learner_recovers_when_its_replacement_trains_and_gets_merged():
    tr = RecoveryTracker()
    tr.feed(99.0, {"a": obs(started=10.0, lines=[(99.0, 50)], merged=[(99.0, 7)])})
    tr.add(1, "a", "kill", at=100.0)
    assert tr.down() == {"a"}
    # The dead incarnation's last pending contribution is merged after the kill: that is not a recovery.
    assert tr.feed(101.0, {"a": obs(started=10.0, merged=[(101.0, 8)], running=False)}) == []
    assert tr.feed(103.0, {"a": obs(started=102.0, merged=[(103.0, 8)])}) == []
    assert tr.down() == {"a"}
    assert tr.feed(106.0, {"a": obs(started=102.0, lines=[(105.5, 1), (106.0, 2)], merged=[(106.0, 8)])}) == []
    assert tr.down() == set()  # trained again: healthy for the guards, still waiting for a merge
    done = tr.feed(109.0, {"a": obs(started=102.0, lines=[(109.0, 9)], merged=[(108.5, 9)])})
    assert len(done) == 1
    rec = done[0]
    assert rec["recovered"] and rec["replacement_started_at"] == 102.0
    assert rec["trained_again_s"] == 5.5 and rec["merged_again_s"] == 8.5


def test_lines_of_the_old_incarnation_do_not_count_as_training_again():
    tr = RecoveryTracker()
    tr.add(1, "a", "kill", at=100.0)
    tr.feed(100.2, {"a": obs(started=10.0, lines=[(99.9, 60)])})  # written just before the kill, read after
    assert tr.down() == {"a"}


def test_a_paused_learner_recovers_after_its_resume():
    tr = RecoveryTracker()
    tr.feed(50.0, {"a": obs(started=1.0, lines=[(50.0, 10)], merged=[(50.0, 3)])})
    tr.add(1, "a", "pause", at=51.0, back_at=61.0)
    assert tr.feed(60.0, {"a": obs(started=1.0, merged=[(60.0, 4)])}) == []  # merged during the pause: old work
    done = tr.feed(64.0, {"a": obs(started=1.0, lines=[(62.0, 11)], merged=[(63.0, 4), (64.0, 5)])})
    assert done and done[0]["trained_again_s"] == 11.0 and done[0]["merged_again_s"] == 13.0


def test_without_step_reports_a_running_replacement_counts_as_training():
    tr = RecoveryTracker()
    tr.add(1, "pod-unit", "kill", at=10.0)
    tr.feed(12.0, {"pod-unit": obs(started=11.0, no_lines=True, running_since=None, running=False)})
    assert tr.down() == {"pod-unit"}
    assert tr.feed(15.0, {"pod-unit": obs(started=11.0, no_lines=True, running_since=14.0)}) == []
    assert tr.down() == set()  # running again; its recovery waits for a merge


def test_a_target_blind_to_merges_completes_a_recovery_when_the_unit_trains_again():
    tr = RecoveryTracker()
    tr.add(1, "pod-unit", "kill", at=10.0)
    (rec,) = tr.feed(15.0, {"pod-unit": obs(started=11.0, no_lines=True, running_since=14.0, merged=None)})
    assert rec["recovered"] and rec["trained_again_s"] == 4.0 and rec["merged_again_s"] is None
    assert "not observable" in rec["note"]


def test_unrecovered_faults_expire_and_are_recorded_as_such():
    tr = RecoveryTracker()
    tr.add(1, "a", "kill", at=0.0, back_at=5.0)
    assert tr.expire(60.0, timeout_s=60.0) == []
    rec = tr.expire(65.1, timeout_s=60.0)[0]
    assert not rec["recovered"] and rec["note"] == "never trained again" and tr.faults == {}


def test_the_record_is_json_lines_that_survive_the_writer(tmp_path):
    rec = Record(tmp_path / "chaos" / "r.jsonl")
    rec.write("fault", fault=1, unit="a")
    rec.write("recovery", fault=1, unit="a", recovered=True, trained_again_s=4.0, merged_again_s=6.0)
    rec.write("recovery", fault=2, unit="b", recovered=True, trained_again_s=2.0, merged_again_s=None)
    with open(rec.path, "a") as f:
        f.write('{"event": "fau')  # torn by a kill
    entries = read_record(rec.path)
    assert [e.event for e in entries] == ["fault", "recovery", "recovery"] and entries == rec.entries
    s = summarize(entries)
    assert s["faults"] == 1 and s["recovered"] == 2
    assert s["trained_again_s_median"] == 3.0 and s["merged_again_s_median"] == 6.0


def test_a_target_s_own_details_are_kept_and_a_record_line_of_another_shape_names_its_field(tmp_path):
    rec = Record(tmp_path / "r.jsonl")
    rec.write("held", fault=1, unit="a", until=5.0, held_pids=[11, 12])
    (held,) = read_record(rec.path)
    assert held.until == 5.0 and held.model_extra == {"held_pids": [11, 12]}
    with open(rec.path, "a") as f:
        f.write('{"event": "fault", "time": 2.0, "fault": "first"}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl, line 2: fault"):
        read_record(rec.path)
    line = ChaosEntry(event="end", time=1.0, reason="done").line()
    assert line == '{"event": "end", "time": 1.0, "reason": "done"}\n'


def test_a_recovery_whose_merges_the_target_cannot_see_is_described_without_a_merge_time():
    from diloco_chaos.cli import describe

    rec = RecoveryTracker()
    rec.add(1, "a", "kill", at=0.0)
    (done,) = rec.feed(5.0, {"a": UnitObservation(started=1.0, lines=[(2.0, 1)], merged=None)})
    line = describe(ChaosEntry(event="recovery", time=5.0, **done))
    assert "recovered: trained again after 2.0s, merges not observable" in line
    seen = describe(ChaosEntry(event="recovery", time=5.0, fault=2, unit="b", recovered=True,
                               trained_again_s=1.0, merged_again_s=3.5))
    assert seen.endswith("recovered: trained again after 1.0s, merged again after 3.5s")
