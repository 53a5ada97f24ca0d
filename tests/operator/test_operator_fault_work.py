"""Work lost per unit fault (faultwork.py), the pure part: which learner life a fault ended, what of its training
no merge covers, and when the figure can be told. On the cluster: test_operator_fault_work_cluster.py."""

from __future__ import annotations

from datetime import datetime, timezone

from diloco_operator.api import models as api
from diloco_operator.plan import faultwork
from diloco_trainer.protocol.messages import IncarnationWork, LearnerStatus

P = 4
T_FAULT = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
FAULT = api.UnitFault(time="2026-01-01T12:00:00Z", reason="PodDeleted", incarnation=1)


def life(id_: str, first: float, steps: int, merged: int, discarded: int = 0, per_step: int = 256) -> IncarnationWork:
    """A life that trained `steps` and had `merged` of them merged on every fragment (P per step)."""
    at = T_FAULT.timestamp() + first
    return IncarnationWork(id=id_, first_seen=at, last_seen=at + 1, steps=steps, tokens=steps * per_step,
                           steps_discarded=discarded, steps_merged=merged * P, tokens_merged=merged * P * per_step)


def test_the_work_lost_is_what_the_ended_life_trained_that_no_merge_covers_nor_its_adoptions_dropped_by_design():
    assert faultwork.work_lost(life("a", -60, steps=100, merged=93), P) == (7, 7 * 256)
    # overwrite adoption dropped 8 fragment-steps (2 steps' worth) while it trained: not the fault's loss
    assert faultwork.work_lost(life("a", -60, steps=100, merged=93, discarded=8), P) == (5, 5 * 256)
    # a resend merged more than the heartbeat had said (steps after the last heartbeat): nothing lost, not < 0
    assert faultwork.work_lost(life("a", -60, steps=100, merged=101), P) == (0, 0)
    assert faultwork.work_lost(life("a", -60, steps=0, merged=0), P) == (0, 0)


def test_the_ended_life_is_the_last_one_first_heard_from_before_the_fault():
    lives = [life("a", -600, 50, 50), life("b", -60, 100, 93), life("c", +5, 3, 0)]
    learner = LearnerStatus(incarnations=lives)
    assert faultwork.ended_life(learner, T_FAULT.timestamp()).id == "b"
    assert faultwork.ended_life(LearnerStatus(incarnations=[life("c", +5, 3, 0)]), T_FAULT.timestamp()) is None


def test_a_life_first_heard_of_within_the_faults_whole_second_is_the_ended_one_and_the_next_is_told():
    # the fault's time is floored to the second: a life that started 0.1 s into it ran when the fault came
    # (the cluster test's first life can start in the same second its pod is deleted)
    learner = LearnerStatus(incarnations=[life("a", +0.1, 4, 0), life("b", +1.6, 1, 0)])
    assert faultwork.ended_life(learner, T_FAULT.timestamp()).id == "a"
    told = faultwork.fault_work(FAULT, learner, P, unit_ended=False)
    assert (told.lostSteps, told.lostTokens, told.trainingAgainSeconds) == (4, 4 * 256, 1.6)


def test_the_loss_is_told_once_the_next_life_trained_a_step_or_the_unit_ended():
    ended = life("b", -60, 100, 93)
    waiting = LearnerStatus(incarnations=[ended, life("c", +5, 0, 0)])  # started, no step: its resend may be due
    assert faultwork.fault_work(FAULT, waiting, P, unit_ended=False) == FAULT
    going = LearnerStatus(incarnations=[ended, life("c", +5, 1, 0)])
    told = faultwork.fault_work(FAULT, going, P, unit_ended=False)
    assert (told.lostSteps, told.lostTokens, told.trainingAgainSeconds) == (7, 7 * 256, 5.0)
    alone = LearnerStatus(incarnations=[ended])
    assert faultwork.fault_work(FAULT, alone, P, unit_ended=False) == FAULT
    failed = faultwork.fault_work(FAULT, alone, P, unit_ended=True)
    assert failed.lostSteps == 7 and failed.trainingAgainSeconds is None, "a failed unit has no next life"


def test_without_the_syncers_ledger_nothing_is_claimed():
    assert faultwork.fault_work(FAULT, None, P, unit_ended=True) == FAULT
    assert faultwork.fault_work(FAULT, LearnerStatus(), P, unit_ended=True) == FAULT  # an older syncer or learner
    assert faultwork.fault_work(FAULT, LearnerStatus(incarnations=[life("b", -60, 9, 1)]), 0, unit_ended=True) \
        == FAULT
