"""The learner's outer-step bookkeeping (outer_sync.OuterSync): what goes out when, what an answer changes, and what
adoption does to the local parameters and counters in each `outer.adopt` mode."""

import pytest
import torch

from diloco_trainer.learner.link import Answer
from diloco_trainer.learner.outer_sync import OuterSync
from diloco_trainer.protocol.wire import decode_submission

PLAN = [["a"], ["b"]]
SHAPES = {"a": (4,), "b": (2, 2)}
TOKENS = 100


def make(adopt: str, sync_every: int = 4, compression: str = "none") -> tuple[OuterSync, dict[str, torch.Tensor]]:
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    return OuterSync(PLAN, {0: 1, 1: 1}, params, sync_every=sync_every, adopt=adopt, compression=compression,
                     block_size=8), params


def train(sync: OuterSync, params: dict[str, torch.Tensor], steps: int, by: float = 1.0) -> None:
    """`steps` inner steps, each moving every parameter by -by (so Δ = base − θ grows by `by` a step)."""
    for _ in range(steps):
        for t in params.values():
            t.sub_(by)
        sync.trained(TOKENS)


def answer(sub, status: int = 202) -> Answer:
    return Answer(sub.fragment, sub.base_version, sub.submission_id, status, sub.c_steps, sub.c_tokens)


def sent_of(sync: OuterSync, step: int, p: int):
    """The submission of fragment p among those due after `step` (fragment 0 is due at H, fragment 1 at H/2)."""
    (sub,) = [s for s in sync.send_due(step, "l0", "n0") if s.fragment == p]
    return sub


def decoded(sub):
    return decode_submission(sub.body, {n: SHAPES[n] for n in PLAN[sub.fragment]})


def test_fragments_go_out_staggered_every_h_steps_with_the_work_since_adoption():
    sync, params = make("overwrite", sync_every=4)
    sent = []
    for step in range(1, 9):
        train(sync, params, 1)
        sent += [(step, s.fragment, s.c_steps) for s in sync.send_due(step, "l0", "n0")]
    # Fragment 1 is due at its offset H/P = 2, fragment 0 (offset 0) at H; an unanswered Δ is superseded H steps
    # later by one from the same base that covers every step since adoption.
    assert sent == [(2, 1, 2), (4, 0, 4), (6, 1, 6), (8, 0, 8)]


def test_a_learner_lined_up_with_the_others_first_sends_each_fragment_when_told_then_every_h_steps():
    sync, params = make("overwrite", sync_every=4)
    sync.align({0: 1, 1: 3}, step=0)  # the others send fragment 0 after our first step, fragment 1 after our third
    sent = []
    for step in range(1, 8):
        train(sync, params, 1)
        sent += [(step, s.fragment, s.c_steps) for s in sync.send_due(step, "l0", "n0")]
    assert sent == [(1, 0, 1), (3, 1, 3), (5, 0, 5), (7, 1, 7)]


def test_an_acknowledged_fragment_is_not_sent_again_from_the_same_base():
    sync, params = make("overwrite", sync_every=2)
    train(sync, params, 1)
    sub = sent_of(sync, 1, 1)
    sync.book([answer(sub)])
    train(sync, params, 4)
    assert [s.fragment for s in sync.send_due(5, "l0", "n0")] == [0], "fragment 1 waits for a newer version"
    meta, deltas = decoded(sub)
    assert (meta.c_steps, meta.c_tokens) == (1, TOKENS)
    assert torch.equal(deltas["b"], torch.ones(2, 2)), "Δ = base − θ after one step of −1"


def test_overwrite_replaces_the_fragment_and_discards_the_steps_since_the_send():
    sync, params = make("overwrite")
    train(sync, params, 4)
    sync.book([answer(sent_of(sync, 4, 0))])
    train(sync, params, 2)  # two steps after the send, then version 2 of fragment 0 arrives
    theta = {"a": torch.full((4,), 10.0)}
    sync.adopt(0, 2, theta, step=6)
    assert torch.equal(params["a"], theta["a"])
    fs = sync.frags[0]
    assert (fs.version, fs.c_steps, fs.c_tokens, fs.acked) == (2, 0, 0, False)
    assert sync.steps_discarded == 2 and sync.steps_kept == 0
    assert torch.equal(fs.base["a"], theta["a"]) and fs.base["a"] is not theta["a"]


def test_keep_carries_the_progress_since_the_send_on_top_of_the_new_version():
    sync, params = make("keep")
    train(sync, params, 4)
    sync.book([answer(sent_of(sync, 4, 0))])  # θ_a = −4 went out
    train(sync, params, 2)  # θ_a = −6: two unsent steps
    theta = {"a": torch.full((4,), 10.0)}
    sync.adopt(0, 2, theta, step=6)
    assert torch.equal(params["a"], torch.full((4,), 8.0)), "Θ_new + (θ − θ_sent) = 10 + (−6 − (−4))"
    fs = sync.frags[0]
    assert (fs.version, fs.c_steps, fs.c_tokens) == (2, 2, 2 * TOKENS), "the unsent steps are carried"
    assert torch.equal(fs.base["a"], theta["a"])
    assert sync.steps_kept == 2 and sync.steps_discarded == 0
    # The next Δ of fragment 0 (base version 2, due H steps after adoption) carries those two steps and four more.
    train(sync, params, 4)
    meta, deltas = decoded(sent_of(sync, 10, 0))
    assert (meta.base_version, meta.c_steps) == (2, 6)
    assert torch.equal(deltas["a"], torch.full((4,), 6.0))


def test_keep_with_nothing_sent_carries_everything_since_the_adopted_base():
    sync, params = make("keep")
    train(sync, params, 1)
    sync.adopt(1, 5, {"b": torch.ones(2, 2)}, step=1)  # another learner's merge, before this one's own send of b
    assert torch.equal(params["b"], torch.zeros(2, 2)), "1 + (−1 − 0)"
    assert sync.frags[1].c_steps == 1 and sync.frags[1].version == 5


def test_a_refused_submission_leaves_its_work_to_be_carried_by_keep():
    sync, params = make("keep")
    train(sync, params, 4)
    sync.book([answer(sent_of(sync, 4, 0), 409)])
    assert not sync.frags[0].in_flight and not sync.frags[0].acked
    train(sync, params, 1)
    sync.adopt(0, 3, {"a": torch.zeros(4)}, step=5)
    assert torch.equal(params["a"], torch.full((4,), -5.0)), "nothing of the refused Δ was merged: all 5 steps kept"
    assert sync.frags[0].c_steps == 5


def test_an_answer_for_an_older_base_changes_nothing():
    sync, params = make("keep")
    train(sync, params, 4)
    sub = sent_of(sync, 4, 0)
    sync.adopt(0, 2, {"a": torch.zeros(4)}, step=4)
    sync.book([answer(sub)])
    assert not sync.frags[0].acked, "the acknowledgement was for version 1's Δ"


def test_flush_sends_unsent_work_but_leaves_unanswered_and_acknowledged_fragments_alone():
    sync, params = make("keep", sync_every=4)
    train(sync, params, 2)
    sub = sent_of(sync, 2, 1)
    train(sync, params, 1)
    flushed = sync.flush("l0", "n0")
    assert [s.fragment for s in flushed] == [0], "fragment 1's Δ is in flight"
    assert sync.flush("l0", "n0") == [], "fragment 0's flushed Δ is in flight now"
    sync.book([answer(sub), answer(flushed[0])])
    train(sync, params, 1)
    assert sync.flush("l0", "n0") == [], "both fragments' Δs from these bases were acknowledged"


@pytest.mark.parametrize("adopt", ["keep", "overwrite"])
def test_a_leaving_learner_is_settled_once_every_step_is_acknowledged_or_would_be_discarded_anyway(adopt):
    sync, params = make(adopt, sync_every=4)
    train(sync, params, 2)
    sub = sent_of(sync, 2, 1)
    train(sync, params, 1)  # fragment 1: a step after its in-flight Δ; fragment 0: 3 steps unsent
    assert sync.unsettled() == [0, 1] and sync.flushable() == [0]
    flushed = sync.flush("l0", "n0")
    sync.book([answer(sub), answer(flushed[0])])
    # Fragment 0's Δ covers all of its steps. Fragment 1's third step follows its acknowledged Δ: keep carries it
    # over the version that merges that Δ and sends it from there; overwrite would discard it at that adoption.
    assert sync.unsettled() == ([1] if adopt == "keep" else [])
    sync.adopt(1, 2, {"b": torch.zeros(2, 2)}, step=3)
    assert sync.flushable() == ([1] if adopt == "keep" else [])
    (tail,) = sync.flush("l0", "n0") if adopt == "keep" else [None]
    if adopt == "keep":
        assert (tail.base_version, tail.c_steps, tail.c_tokens) == (2, 1, TOKENS)
        sync.book([answer(tail)])
    assert sync.unsettled() == [] and sync.flushable() == []


@pytest.mark.parametrize("adopt", ["keep", "overwrite"])
def test_a_learner_leaving_before_the_version_that_merges_its_delta_counts_the_steps_after_it_as_discarded(adopt):
    sync, params = make(adopt, sync_every=4)
    train(sync, params, 2)
    sub = sent_of(sync, 2, 1)
    train(sync, params, 3)  # fragment 1: 3 steps after its Δ; fragment 0: 5 steps, none sent
    sync.book([answer(sub)])
    # Overwrite: the version that merges fragment 1's Δ would discard its 3 later steps; the learner leaves first,
    # so it counts them itself (else they would be neither merged nor discarded). Keep sends them from that version
    # (unsettled), and fragment 0's unsent work is never counted as discarded.
    assert sync.discard_after_acknowledged() == (3 if adopt == "overwrite" else 0)
    assert sync.steps_discarded == (3 if adopt == "overwrite" else 0)
    assert sync.discard_after_acknowledged() == 0, "counted once"
    assert sync.unsettled() == ([0, 1] if adopt == "keep" else [0])


def test_a_refused_fragment_is_not_flushed_again_from_the_same_base():
    sync, params = make("keep", sync_every=4)
    train(sync, params, 2)
    (flushed,) = [s for s in sync.flush("l0", "n0") if s.fragment == 1]
    sync.book([answer(flushed, status=409)])
    assert 1 not in sync.flushable() and 1 not in sync.unsettled(), "its base is gone: a newer version first"
    sync.adopt(1, 2, {"b": torch.zeros(2, 2)}, step=2)
    assert 1 in sync.flushable() and 1 in sync.unsettled(), "the work rides on the new version and goes out"


def test_the_sending_rank_alone_keeps_bases_and_builds_submissions():
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    follower = OuterSync(PLAN, {0: 1, 1: 1}, params, sync_every=2, adopt="keep", compression="none", block_size=8,
                         sends=False)
    follower.trained(TOKENS)
    assert follower.send_due(1, "l0", "n0") == [] and follower.frags[0].base == {}
    follower.adopt(0, 4, None, step=1)
    assert follower.versions() == {"0": 4, "1": 1}


def test_an_unknown_adopt_mode_is_refused():
    with pytest.raises(ValueError, match="adopt"):
        make("average")


def test_error_feedback_residuals_carry_what_int4_dropped_into_the_next_send():
    sync, params = make("overwrite", sync_every=1, compression="int4")
    params["a"].copy_(torch.tensor([0.0, 0.013, -0.7, 1.0]))
    sync.frags[0].base["a"] = torch.zeros(4)
    sync.trained(TOKENS)
    (sub,) = [s for s in sync.send_due(1, "l0", "n0") if s.fragment == 0]
    _, deltas = decoded(sub)
    residual = sync.ef.residual("a")
    assert residual is not None and torch.allclose(deltas["a"] + residual, -params["a"])


@pytest.mark.parametrize("adopt", ["overwrite", "keep"])
def test_a_delta_the_link_may_have_delivered_stands_and_the_steps_after_it_are_discarded_or_carried_not_lost(adopt):
    # H=4: fragment 0's Δ after step 4 is on the wire when its next falls due after step 8. The link refuses a fresh
    # Δ of that id (the syncer merges one per id): the first stands, and once it is acknowledged the four steps
    # after it count as trained after an acknowledged Δ (discarded by overwrite, carried by keep), never as merged.
    sync, params = make(adopt, compression="int4")
    train(sync, params, 4, by=0.013)
    params["a"].add_(torch.tensor([0.0, 0.013, -0.7, 1.0]))  # uneven: int4 leaves a residual
    first = sent_of(sync, 4, 0)
    residual = sync.ef.residual("a").clone()
    assert residual.abs().sum() > 0
    train(sync, params, 4, by=0.013)
    offered = []
    assert [s.fragment for s in sync.send_due(8, "l0", "n0", lambda sub: offered.append(sub) or sub.fragment != 0)] \
        == [1]
    assert [s.submission_id for s in offered if s.fragment == 0] == [first.submission_id]
    assert torch.equal(sync.ef.residual("a"), residual), "the residuals are those the standing Δ left"
    sync.book([answer(first)])
    sync.adopt(0, 2, {"a": torch.full((4,), 10.0)}, step=8)
    if adopt == "overwrite":
        assert (sync.steps_discarded, sync.frags[0].c_steps) == (4, 0)
        assert torch.equal(params["a"], torch.full((4,), 10.0))
    else:
        assert (sync.steps_kept, sync.frags[0].c_steps) == (4, 4)
        assert torch.allclose(params["a"], torch.full((4,), 10.0 - 4 * 0.013)), "the four steps ride on top"


def test_keep_with_a_fraction_carries_that_share_of_the_progress_and_of_its_counters():
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    sync = OuterSync(PLAN, {0: 1, 1: 1}, params, sync_every=4, adopt="keep", compression="none", block_size=8,
                     keep_fraction=0.5)
    train(sync, params, 4)
    sync.book([answer(sent_of(sync, 4, 0))])  # θ_a = −4 went out
    train(sync, params, 4)  # θ_a = −8: four unsent steps
    sync.adopt(0, 2, {"a": torch.full((4,), 10.0)}, step=8)
    assert torch.equal(params["a"], torch.full((4,), 8.0)), "10 + 0.5 · (−8 − (−4))"
    assert (sync.frags[0].c_steps, sync.frags[0].c_tokens) == (2, 2 * TOKENS)
    assert (sync.steps_kept, sync.steps_discarded) == (2, 2)
    with pytest.raises(ValueError, match="keep_fraction"):
        OuterSync(PLAN, {0: 1, 1: 1}, params, sync_every=4, adopt="keep", compression="none", block_size=8,
                  keep_fraction=0.0)


def test_unsent_work_comes_back_as_the_previous_incarnations_resends_also_where_the_base_moved_on():
    sync, params = make("overwrite", sync_every=4, compression="none")
    train(sync, params, 4)
    sync.book([answer(sent_of(sync, 4, 0))])  # fragment 0's work is acknowledged: nothing to carry over
    train(sync, params, 1)
    tensors, fragments = sync.unsent_work()
    assert [f["fragment"] for f in fragments] == [1] and fragments[0]["c_steps"] == 5
    assert set(tensors) == {"base.1.b", "theta.1.b"}

    after, after_params = make("overwrite")
    (sub,) = after.resend(tensors, fragments, {0: 1, 1: 1}, "l0", "oldnonce")
    assert sub.recovered and sub.submission_id == "l0.oldnonce.p1.v1", "the previous life's id: never merged twice"
    meta, deltas = decoded(sub)
    assert (meta.base_version, meta.c_steps, meta.c_tokens) == (1, 5, 5 * TOKENS)
    assert torch.equal(deltas["b"], torch.full((2, 2), 5.0))
    assert meta.rider, "a resend: the syncer holds it for the fragment's next merge"
    (moved,) = after.resend(tensors, fragments, {0: 1, 1: 3}, "l0", "oldnonce")
    meta, deltas = decoded(moved)
    assert meta.rider and moved.submission_id == "l0.oldnonce.p1.v1", \
        "fragment 1 moved on: its work still goes (the syncer applies it to the current version), under the same id"
    assert (meta.base_version, meta.c_steps) == (1, 5) and torch.equal(deltas["b"], torch.full((2, 2), 5.0))
    assert after.resend(tensors, fragments, {0: 1, 1: 0}, "l0", "oldnonce") == [], \
        "fragment 1 went back (a syncer shard lost state): nothing to rebase onto"


# ------------------------------------------------------------------ the ledger (docs/protocol.md, Ledger)


def total(ledger: dict[str, int]) -> int:
    return sum(ledger.values())


def test_a_refused_deltas_work_lands_in_refused_not_discarded_at_the_next_adoption():
    sync, params = make("overwrite", sync_every=4)
    train(sync, params, 4)
    sub = sent_of(sync, 4, 0)  # fragment 0's Δ covers 4 steps (fragment 1's, also due, stays unanswered)
    sync.book([answer(sub, 409)])
    train(sync, params, 2)  # 2 more steps on both fragments after the Δs
    ledger = sync.ledger()
    assert (ledger["refused_stale"], ledger["in_flight"], ledger["unsent"]) == (4, 4, 2 + 2)
    sync.adopt(0, 2, {"a": torch.zeros(4)}, step=6)
    ledger = sync.ledger()
    assert ledger["refused_stale"] == 4, "the refused Δ's steps are refused, not discarded"
    assert ledger["discarded"] == 2 and sync.steps_discarded == 2, "only the steps after it"
    assert ledger["refused_other"] == 0 and total(ledger) == 2 * 6


def test_a_refusal_other_than_stale_is_its_own_class_and_a_later_delta_from_the_base_settles_it():
    sync, params = make("overwrite", sync_every=2)
    train(sync, params, 1)
    sync.book([answer(sent_of(sync, 1, 1), 422)])
    assert sync.ledger()["refused_other"] == 1
    train(sync, params, 2)
    (again,) = [s for s in sync.send_due(3, "l0", "n0") if s.fragment == 1]  # due again: covers all 3 steps
    assert again.c_steps == 3 and sync.ledger()["refused_other"] == 0 and sync.ledger()["in_flight"] >= 3
    sync.book([answer(again)])
    assert sync.ledger()["acked"] == 3 and sync.ledger()["refused_other"] == 0


@pytest.mark.parametrize("adopt", ["keep", "overwrite"])
def test_an_unanswered_delta_at_an_adoption_is_settled_by_its_late_answer(adopt):
    sync, params = make(adopt, sync_every=4)
    train(sync, params, 4)
    sub = sent_of(sync, 4, 0)
    train(sync, params, 1)
    sync.adopt(0, 2, {"a": torch.zeros(4)}, step=5)
    assert sync.ledger()["in_flight"] == 4 + 4, "fragment 0's Δ of version 1, and fragment 1's"
    sync.book([answer(sub, 409)])
    ledger = sync.ledger()
    assert ledger["in_flight"] == 4 and ledger["refused_stale"] == 4 and total(ledger) == 2 * 5


@pytest.mark.parametrize("adopt,keep_fraction", [("overwrite", 1.0), ("keep", 1.0), ("keep", 0.5)])
@pytest.mark.parametrize("seed", range(6))
def test_the_ledger_always_sums_to_the_fragment_steps_trained(adopt, keep_fraction, seed):
    """A random walk of steps, sends, answers (accepted, stale, other, late), adoptions and a leaving learner's
    flush: at every point the buckets sum to P·steps exactly."""
    import random

    rng = random.Random(seed)
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    sync = OuterSync(PLAN, {0: 1, 1: 1}, params, sync_every=3, adopt=adopt, compression="none", block_size=8,
                     keep_fraction=keep_fraction)
    outstanding, steps, versions = [], 0, {0: 1, 1: 1}
    for step in range(1, 120):
        train(sync, params, 1)
        steps += 1
        rng.shuffle(outstanding)
        k = rng.randint(0, len(outstanding))
        answered, outstanding = outstanding[:k], outstanding[k:]
        sync.book([answer(s, rng.choice([202, 202, 409, 422])) for s in answered])
        outstanding += sync.send_due(step, "l0", "n0")
        outstanding = list({s.submission_id: s for s in outstanding}.values())  # a superseded Δ keeps its id
        for p in (0, 1):
            if rng.random() < 0.15:
                versions[p] += 1
                sync.adopt(p, versions[p], {n: torch.zeros(SHAPES[n]) for n in PLAN[p]}, step)
        assert total(sync.ledger()) == 2 * steps, sync.ledger()
    outstanding += sync.flush("l0", "n0")
    sync.discard_after_acknowledged()
    assert total(sync.ledger()) == 2 * steps
    sync.book([answer(s) for s in outstanding])
    ledger = sync.ledger()
    assert total(ledger) == 2 * steps and ledger["in_flight"] == 0
