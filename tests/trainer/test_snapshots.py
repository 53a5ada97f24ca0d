"""The per-step snapshots' budget (learner/snapshots.py): their copies on the step take a bounded share of training."""

from diloco_trainer.learner.snapshots import CAPTURE_BUDGET, within_budget


def test_a_snapshot_is_captured_while_the_copies_so_far_stay_within_their_share_of_the_training_time():
    assert within_budget(0.0, 0.0), "the first snapshot of a start"
    assert within_budget(CAPTURE_BUDGET * 10.0, 10.0)
    # A model whose copy costs more than the budget per step (a large one on a GPU): skipped until training catches up.
    assert not within_budget(0.5, 1.0)
    assert within_budget(0.5, 0.5 / CAPTURE_BUDGET)
