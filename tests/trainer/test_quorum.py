"""Quorum and grace-window decisions, driven by a fake clock."""

import json

import pytest

from diloco_trainer.syncer.quorum import Ema, MergePolicy, robust_step_time


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def run_round(policy: MergePolicy, arrivals: dict[str, float], n_live: int | None = None):
    """Drive one fragment's collection like the syncer does; return (merge time, learners merged).

    Arrivals are contribution times per learner. The syncer calls decide on every arrival and when a
    returned wait expires, and records the quorum time when quorum is first reached.
    """
    clock = FakeClock(min(arrivals.values()))
    events = sorted((t, name) for name, t in arrivals.items())
    pending: list[str] = []
    first_at = quorum_at = None
    wake = None
    while True:
        while events and events[0][0] <= clock():
            pending.append(events.pop(0)[1])
        first_at = first_at if first_at is not None or not pending else clock()
        wait = policy.decide(len(pending), first_at, quorum_at, clock(), n_live=n_live)
        if wait is not None and quorum_at is None:
            quorum_at = clock()
            policy.observe_quorum_time(quorum_at - first_at)
        if wait == 0.0:
            return clock(), sorted(pending)
        wake = clock() + wait if wait is not None else None
        candidates = [t for t in (wake, events[0][0] if events else None) if t is not None]
        assert candidates, "the policy waits for nothing that can happen"
        clock.t = min(candidates)


def warmed(quorum=1, grace=0.5, overlap=2, step=1.0, quorum_time=0.2, sync=0.3) -> MergePolicy:
    policy = MergePolicy(quorum=quorum, grace=grace, overlap=overlap)
    policy.observe_step_time(step)
    policy.observe_quorum_time(quorum_time)
    policy.observe_sync_time(sync)
    return policy


def test_ema_starts_at_the_first_value_then_moves_by_alpha():
    ema = Ema(0.2)
    assert ema.value is None
    assert ema.update(10.0) == 10.0
    assert ema.update(20.0) == pytest.approx(12.0)
    with pytest.raises(ValueError, match="alpha"):
        Ema(0.0)
    with pytest.raises(ValueError, match="finite"):
        ema.update(float("nan"))


def test_quorum_of_one_merges_at_once_with_grace_zero():
    policy = warmed(quorum=1, grace=0.0)
    assert policy.grace_seconds() == 0.0
    assert policy.decide(1, 100.0, None, 100.0) == 0.0
    assert run_round(policy, {"a": 100.0, "b": 100.1}) == (100.0, ["a"])


def test_nothing_pending_means_no_quorum():
    assert MergePolicy(1, 0.0, 2).decide(0, None, None, 5.0) is None


def test_grace_window_is_zero_until_every_ema_is_known():
    policy = MergePolicy(quorum=1, grace=0.5, overlap=2)
    policy.observe_step_time(1.0)
    policy.observe_sync_time(0.3)
    assert policy.grace_seconds() == 0.0
    assert policy.decide(1, 50.0, None, 50.0) == 0.0
    policy.observe_quorum_time(0.2)
    assert policy.grace_seconds() == pytest.approx(0.5 * (2 * 1.0 - (0.2 + 0.3)))


def test_quorum_of_two_waits_for_the_second_learner():
    policy = MergePolicy(quorum=2, grace=0.0, overlap=2)
    assert policy.decide(1, 100.0, None, 100.0) is None
    assert policy.decide(1, 100.0, None, 130.0) is None  # however long it takes
    assert policy.decide(2, 100.0, None, 130.0) == 0.0
    assert run_round(policy, {"a": 100.0, "b": 103.5, "c": 104.0}) == (103.5, ["a", "b"])
    assert policy.quorum_time.value == pytest.approx(3.5)


def test_grace_window_length_follows_the_emas():
    policy = warmed(step=1.0, quorum_time=0.2, sync=0.3, overlap=2, grace=0.5)
    assert policy.grace_seconds() == pytest.approx(0.75)  # 0.5 * (2 * 1.0 - 0.5)
    policy.observe_step_time(2.0)  # learners got slower: EMA 1.2, more slack
    assert policy.grace_seconds() == pytest.approx(0.5 * (2 * 1.2 - 0.5))
    policy.observe_sync_time(10.0)  # merges got slow: no slack left
    assert policy.grace_seconds() == 0.0


def test_grace_window_counts_down_from_quorum_and_closes_at_the_deadline():
    policy = warmed()  # window 0.75 s
    assert policy.decide(1, 100.0, None, 100.0) == pytest.approx(0.75)
    assert policy.decide(1, 100.0, 100.0, 100.5) == pytest.approx(0.25)
    assert policy.decide(2, 100.0, 100.0, 100.74) == pytest.approx(0.01)
    assert policy.decide(2, 100.0, 100.0, 100.75) == 0.0
    assert policy.decide(2, 100.0, 100.0, 130.0) == 0.0


def test_contributions_inside_the_window_join_the_merge_and_later_ones_do_not():
    policy = warmed()  # window ~0.75 s after quorum (quorum time 0 is folded in at quorum: ~0.77 s)
    merged_at, merged = run_round(policy, {"a": 100.0, "b": 100.5, "c": 100.7, "late": 100.9})
    assert merged_at == pytest.approx(100.0 + policy.grace_seconds())
    assert 100.7 < merged_at < 100.9
    assert merged == ["a", "b", "c"]


def test_merges_at_once_when_every_live_learner_is_already_in():
    policy = warmed()  # a 0.75 s window would otherwise apply
    assert policy.decide(3, 100.0, 100.0, 100.1, n_live=3) == 0.0
    assert policy.decide(2, 100.0, 100.0, 100.1, n_live=3) == pytest.approx(0.65)
    assert run_round(policy, {"a": 100.0, "b": 100.2}, n_live=2) == (100.2, ["a", "b"])


def test_a_quorum_larger_than_the_live_learners_does_not_stop_merging():
    policy = MergePolicy(quorum=4, grace=0.0, overlap=2)
    assert policy.decide(2, 100.0, None, 100.0, n_live=3) is None
    assert policy.decide(3, 100.0, None, 101.0, n_live=3) == 0.0  # the fourth learner is dead


def test_policy_state_is_json_and_round_trips():
    policy = warmed(step=1.5)
    state = json.loads(json.dumps(policy.state_dict()))
    other = MergePolicy(quorum=1, grace=0.5, overlap=2)
    assert other.grace_seconds() == 0.0
    other.load_state_dict(state)
    assert other.grace_seconds() == policy.grace_seconds() > 0
    fresh = MergePolicy(1, 0.5, 2)
    fresh.load_state_dict(MergePolicy(1, 0.5, 2).state_dict())
    assert fresh.state_dict() == {"step_time": None, "quorum_time": None, "sync_time": None}


def test_policy_rejects_bad_settings_and_observations_without_changing_state():
    with pytest.raises(ValueError, match="quorum"):
        MergePolicy(0, 0.5, 2)
    with pytest.raises(ValueError, match="grace"):
        MergePolicy(1, 1.0, 2)
    with pytest.raises(ValueError, match="overlap"):
        MergePolicy(1, 0.5, -1)
    policy = warmed()
    before = policy.state_dict()
    with pytest.raises(ValueError, match="step time"):
        policy.observe_step_time(-1.0)
    with pytest.raises(ValueError, match="sync time"):
        policy.observe_sync_time(float("inf"))
    with pytest.raises(ValueError, match="sync_time"):
        policy.load_state_dict({"step_time": 1.0, "quorum_time": 0.1, "sync_time": -2.0})
    assert policy.state_dict() == before
    with pytest.raises(ValueError, match="first_pending_at"):
        policy.decide(1, None, None, 10.0)
    with pytest.raises(ValueError, match="later than now"):
        policy.decide(1, 11.0, None, 10.0)


# ---------------------------------------------------------------- reported step times (issue 38)


def test_the_step_time_is_the_lower_median_over_learners_each_clamped_to_what_the_syncer_observed():
    assert robust_step_time([]) is None
    assert robust_step_time([(0.1, None), (999_999.0, None)]) == 0.1  # two learners: the smaller
    assert robust_step_time([(0.1, None), (0.2, None), (999_999.0, None)]) == 0.2
    assert robust_step_time([(999_999.0, 0.5)]) == 0.5  # alone: no slower than it submits
    assert robust_step_time([(0.1, 0.5)]) == 0.1


def test_the_grace_window_is_never_longer_than_max_grace_s():
    policy = MergePolicy(quorum=1, grace=0.5, overlap=2, max_grace_s=60.0)
    policy.observe_quorum_time(0.0)
    policy.observe_sync_time(0.0)
    policy.set_step_time(999_999.0)
    assert policy.grace_seconds() == 60.0
    policy.set_step_time(1.0)
    assert policy.grace_seconds() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_grace_s"):
        MergePolicy(quorum=1, grace=0.5, overlap=2, max_grace_s=0.0)
