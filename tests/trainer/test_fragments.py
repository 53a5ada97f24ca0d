"""Balanced tensor fragmentation and the staggered send schedule."""

import itertools
import random

import pytest

from diloco_trainer.protocol.fragments import (
    due_fragments,
    fragment_of,
    fragment_offset,
    fragment_sizes,
    imbalance,
    plan_fragments,
)


def _model_sizes(preset: str) -> list[tuple[str, int]]:
    torch = pytest.importorskip("torch")  # the model needs torch; fragments.py does not
    from diloco_trainer.config import MODEL_PRESETS
    from diloco_trainer.model.gpt import build_model

    with torch.device("meta"):  # shapes only: no memory, no init time for the 100M preset
        model = build_model(MODEL_PRESETS[preset])
    return [(n, p.numel()) for n, p in model.named_parameters()]


def _check_partition(plan, sizes, num_fragments):
    names = [n for n, _ in sizes]
    flat = [n for frag in plan for n in frag]
    assert len(plan) == num_fragments
    assert all(frag for frag in plan), "every fragment must hold a tensor"
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat)), "every tensor exactly once"
    position = {n: i for i, n in enumerate(names)}
    for frag in plan:
        assert [position[n] for n in frag] == sorted(position[n] for n in frag), "model order within a fragment"


@pytest.mark.parametrize("preset,num_fragments", [
    ("tiny", 1), ("tiny", 2), ("tiny", 4),
    ("small", 4), ("small", 8),
    ("base", 4), ("base", 8), ("base", 16), ("base", 24),
    ("100m", 24),
])
def test_plan_of_a_real_model_is_balanced_within_four_thirds(preset, num_fragments):
    sizes = _model_sizes(preset)
    plan = plan_fragments(sizes, num_fragments)
    _check_partition(plan, sizes, num_fragments)
    assert imbalance(plan, sizes) <= 4 / 3


def test_plan_of_many_random_tensors_is_balanced_within_four_thirds():
    rng = random.Random(0)
    for trial in range(50):
        n = rng.randint(60, 300)
        sizes = [(f"t{i}", rng.randint(1, 1000)) for i in range(n)]
        num_fragments = rng.randint(1, 24)
        plan = plan_fragments(sizes, num_fragments)
        _check_partition(plan, sizes, num_fragments)
        assert imbalance(plan, sizes) <= 4 / 3, (trial, n, num_fragments)


def test_plan_meets_the_lpt_guarantee_against_the_exact_optimum():
    # Graham's bound: LPT makespan <= (4/3 - 1/(3P)) * optimum, checked against brute force on small cases.
    rng = random.Random(1)
    for _ in range(40):
        n, num_fragments = rng.randint(3, 8), rng.randint(2, 3)
        num_fragments = min(num_fragments, n)
        sizes = [(f"t{i}", rng.randint(1, 100)) for i in range(n)]
        best = min(
            max(sum(s for (_, s), a in zip(sizes, assign) if a == p) for p in range(num_fragments))
            for assign in itertools.product(range(num_fragments), repeat=n)
        )
        got = max(fragment_sizes(plan_fragments(sizes, num_fragments), sizes))
        assert got <= (4 / 3 - 1 / (3 * num_fragments)) * best + 1e-9


def test_plan_puts_the_largest_tensor_first_into_the_smallest_fragment():
    sizes = [("a", 5), ("b", 4), ("c", 3), ("d", 3), ("e", 3)]
    # LPT: a->0, b->1, c->2, d->2 (load 3 is smallest), e->1 (4 < 5 < 6).
    assert plan_fragments(sizes, 3) == [["a"], ["b", "e"], ["c", "d"]]


def test_plan_is_deterministic_whatever_the_input_order_of_equal_sizes():
    sizes = [(f"w{i}", 10) for i in range(7)]
    plan = plan_fragments(sizes, 3)
    shuffled = list(sizes)
    random.Random(3).shuffle(shuffled)
    again = plan_fragments(shuffled, 3)
    assert [sorted(f) for f in plan] == [sorted(f) for f in again]
    assert plan == plan_fragments(sizes, 3)


def test_plan_keeps_fragments_non_empty_with_zero_size_tensors():
    sizes = [("a", 0), ("b", 0), ("c", 0)]
    plan = plan_fragments(sizes, 3)
    _check_partition(plan, sizes, 3)
    assert imbalance(plan, sizes) == 1.0


@pytest.mark.parametrize("num_fragments", [0, -1, 4])
def test_plan_rejects_a_fragment_count_outside_one_to_the_number_of_tensors(num_fragments):
    with pytest.raises(ValueError, match="num_fragments"):
        plan_fragments([("a", 1), ("b", 2), ("c", 3)], num_fragments)


def test_plan_rejects_repeated_names_and_negative_sizes():
    with pytest.raises(ValueError, match="unique"):
        plan_fragments([("a", 1), ("a", 2)], 1)
    with pytest.raises(ValueError, match="'b'"):
        plan_fragments([("a", 1), ("b", -2)], 1)


def test_fragment_of_maps_every_name_to_its_fragment():
    plan = [["a", "c"], ["b"]]
    assert fragment_of(plan) == {"a": 0, "c": 0, "b": 1}


def test_offsets_spread_fragments_evenly_over_the_window():
    assert [fragment_offset(p, 16, 4) for p in range(4)] == [0, 4, 8, 12]
    assert [fragment_offset(p, 24, 24) for p in range(24)] == list(range(24))
    assert [fragment_offset(p, 4, 8) for p in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="fragment 4"):
        fragment_offset(4, 16, 4)


@pytest.mark.parametrize("sync_every,num_fragments", [(16, 4), (24, 24), (4, 8), (5, 3), (1, 1), (7, 7), (3, 10)])
def test_each_fragment_is_due_exactly_once_in_every_window_of_h_steps(sync_every, num_fragments):
    for start in (1, 2, sync_every, 3 * sync_every + 1):
        window = [p for s in range(start, start + sync_every) for p in due_fragments(s, sync_every, num_fragments)]
        assert sorted(window) == list(range(num_fragments))
    # Staggered: never more than ceil(P / H) fragments on one step.
    per_step = max(len(due_fragments(s, sync_every, num_fragments)) for s in range(1, sync_every + 1))
    assert per_step == -(-num_fragments // sync_every)


def test_first_fragment_is_due_after_h_steps_and_others_at_their_offset():
    assert due_fragments(16, 16, 4) == [0]
    assert due_fragments(4, 16, 4) == [1]
    assert due_fragments(1, 16, 4) == []
    assert due_fragments(32, 16, 4) == [0]


def test_schedule_rejects_nonsense_parameters():
    with pytest.raises(ValueError, match="1-based"):
        due_fragments(0, 16, 4)
    with pytest.raises(ValueError, match="sync_every"):
        due_fragments(1, 0, 4)
    with pytest.raises(ValueError, match="num_fragments"):
        due_fragments(1, 16, 0)


def test_first_sends_after_a_start_are_staggered_within_one_window():
    from diloco_trainer.protocol.fragments import first_due_step

    for H, P in [(16, 4), (24, 24), (4, 4), (8, 3)]:
        firsts = [first_due_step(p, H, P) for p in range(P)]
        assert all(1 <= f <= H for f in firsts)
        assert len(set(firsts)) == P  # never two fragments due on the same step after a start
        assert sorted(firsts) == sorted(s for s in range(1, H + 1) for _ in due_fragments(s, H, P))


def test_a_joining_learner_first_sends_a_fragment_when_the_others_next_will():
    from diloco_trainer.protocol.fragments import aligned_first_due

    H, step_s = 16, 0.25
    # Published 1 s ago (4 steps): the others, who adopted it then, send in 12 steps.
    assert aligned_first_due(1.0, step_s, H) == 12
    assert aligned_first_due(0.0, step_s, H) == H  # just published: a whole period, as they
    # A part of a step passed counts as a step: sooner rather than after their merge.
    assert aligned_first_due(1.1, step_s, H) == 11
    # More than a period since: the others' cycle goes on (their sends every H steps), so does the answer.
    assert aligned_first_due(H * step_s + 1.0, step_s, H) == 12
    assert all(1 <= aligned_first_due(s / 10, step_s, H) <= H for s in range(0, 200))
    with pytest.raises(ValueError):
        aligned_first_due(1.0, 0.0, H)
