"""The local runtime reads N syncer shards as one syncer: their statuses and final checkpoints merged (shards.py)."""

from diloco_trainer.protocol.messages import LearnerStatus, SyncerStatus
from diloco_trainer.runtime.shards import merge_checkpoint_states, merge_statuses, syncer_names


def _status(shard: int, owned: list[int], merged: int, live: bool) -> SyncerStatus:
    return SyncerStatus(versions={str(p): 10 + p for p in owned}, outer_steps=len(owned),
                        outer_steps_per_fragment={str(p): 1 for p in owned}, merges=len(owned),
                        contributions_merged=merged, tokens_merged=100 * merged,
                        learners={"l0": LearnerStatus(tokens_merged=100 * merged, steps_merged=4 * merged,
                                                      submissions_merged=merged, live=live)},
                        pending={str(p): 0 for p in owned}, grace_s=0.1 * (shard + 1), fragments=4, shard=shard,
                        shards=2, owned=owned, uptime_s=5.0 + shard)


def test_shard_statuses_merge_into_one_covering_every_fragment_with_counters_summed():
    s = merge_statuses([_status(0, [0, 2], 3, live=False), _status(1, [1, 3], 5, live=True)])
    assert s.versions == {"0": 10, "2": 12, "1": 11, "3": 13} and s.owned == [0, 1, 2, 3]
    assert (s.outer_steps, s.merges, s.contributions_merged, s.tokens_merged) == (4, 4, 8, 800)
    l0 = s.learners["l0"]
    assert (l0.submissions_merged, l0.steps_merged, l0.tokens_merged, l0.live) == (8, 32, 800, True)
    assert s.live_learners == 1 and s.grace_s == 0.2 and s.uptime_s == 5.0 and s.shards == 2


def test_shard_checkpoint_states_merge_like_one_syncers_state_json():
    a = {"versions": {"0": 3}, "outer_steps": {"0": 3}, "tokens_merged": 10, "contributions_merged": 1,
         "learners": {"l0": {"tokens_merged": 10, "steps_merged": 2, "submissions_merged": 1}}}
    b = {"versions": {"1": 5}, "outer_steps": {"1": 5}, "tokens_merged": 30, "contributions_merged": 2,
         "learners": {"l0": {"tokens_merged": 20, "steps_merged": 4, "submissions_merged": 2},
                      "l1": {"tokens_merged": 10, "steps_merged": 2, "submissions_merged": 1}}}
    a["learners"]["l0"]["lives"] = [{"id": "n1", "first_seen": 1.0, "last_seen": 2.0, "steps": 3, "steps_merged": 2}]
    b["learners"]["l0"]["lives"] = [{"id": "n1", "first_seen": 1.5, "last_seen": 3.0, "steps": 4, "steps_merged": 4}]
    m = merge_checkpoint_states([a, b])
    assert m["versions"] == {"0": 3, "1": 5} and m["tokens_merged"] == 40 and m["contributions_merged"] == 3
    lives = m["learners"]["l0"].pop("lives")
    assert m["learners"]["l0"] == {"tokens_merged": 30, "steps_merged": 6, "submissions_merged": 3}
    assert [(w["id"], w["steps"], w["steps_merged"]) for w in lives] == [("n1", 4, 6)], "each shard's merges summed"
    assert m["learners"]["l1"]["tokens_merged"] == 10


def test_an_unsharded_run_keeps_its_one_syncer_named_syncer():
    assert syncer_names(1) == ["syncer"] and syncer_names(3) == ["syncer-0", "syncer-1", "syncer-2"]
