"""Token weights, RDA, weighted mean, re-anchoring and the Nesterov outer step."""

import math

import pytest
import torch

from diloco_trainer.syncer.merge import (NORM_WARMUP, NesterovOuter, NotFinite, bound_update, check_finite,
                                         merge_fragment, rda, reanchor, tensor_norm, token_weight, weighted_mean)


def _unit_randn(n, shape, norm, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randn(shape, generator=g)
        out.append(t / t.norm() * norm)
    return out


# ---------------------------------------------------------------- token weights


def test_token_weight_is_tokens_times_tokens_per_step():
    assert token_weight(16384, 16) == 16384 * 1024
    assert token_weight(0, 3) == 0


def test_a_slower_learner_weighs_less():
    # Same wall time: the fast learner did 16 steps of 1024 tokens, the slow one only 8.
    fast, slow = token_weight(16 * 1024, 16), token_weight(8 * 1024, 8)
    assert slow == fast / 2
    # Fewer devices: same number of steps, half the tokens per step -> a quarter of the weight.
    small = token_weight(16 * 512, 16)
    assert small == fast / 4


def test_token_weights_pull_the_merge_toward_the_learner_that_did_more_work():
    fast, slow = torch.ones(4), -torch.ones(4)
    weights = [token_weight(16 * 1024, 16), token_weight(4 * 1024, 4)]
    merged = weighted_mean([fast, slow], weights)
    assert torch.allclose(merged, torch.full((4,), (16 - 4) / (16 + 4)))


def test_token_weight_rejects_zero_steps_and_negative_tokens():
    with pytest.raises(ValueError, match="c_steps"):
        token_weight(10, 0)
    with pytest.raises(ValueError, match="c_tokens"):
        token_weight(-1, 1)


# ---------------------------------------------------------------- mean and RDA


def test_weighted_mean_matches_the_definition():
    ds = [torch.randn(3, 4) for _ in range(3)]
    ws = [1.0, 2.0, 5.0]
    expected = (ds[0] * 1 + ds[1] * 2 + ds[2] * 5) / 8
    assert torch.allclose(weighted_mean(ds, ws), expected, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_rda_keeps_the_update_norm_whatever_the_number_of_learners(m):
    deltas = _unit_randn(m, (64, 32), norm=3.0, seed=m)
    weights = [1.0] * m
    merged = rda(deltas, weights)
    assert merged.norm().item() == pytest.approx(3.0, rel=1e-5)
    mean_norm = weighted_mean(deltas, weights).norm().item()
    # Near-orthogonal random directions: the plain mean shrinks like 1/sqrt(M).
    assert mean_norm == pytest.approx(3.0 / math.sqrt(m), rel=0.1)


def test_rda_points_along_the_weighted_mean_of_directions():
    a, b = torch.tensor([10.0, 0.0]), torch.tensor([0.0, 1.0])  # very different norms
    merged = rda([a, b], [1.0, 3.0])
    direction = torch.tensor([0.25, 0.75]) / torch.tensor([0.25, 0.75]).norm()  # norms do not bias direction
    radius = (10.0 * 1 + 1.0 * 3) / 4
    assert torch.allclose(merged, direction * radius, atol=1e-6)


def test_rda_of_identical_deltas_is_that_delta():
    d = torch.randn(5, 5)
    assert torch.allclose(rda([d, d, d], [1.0, 2.0, 3.0]), d, atol=1e-6)


def test_rda_handles_zero_and_cancelling_deltas_without_nan():
    z = torch.zeros(6)
    assert torch.equal(rda([z, z], [1.0, 1.0]), z)
    d = torch.randn(6)
    assert torch.allclose(rda([d, -d], [1.0, 1.0]), z)
    # A zero delta adds no direction but lowers the radius.
    assert torch.allclose(rda([d, z], [1.0, 1.0]), d / 2, atol=1e-6)


def test_zero_weight_contributions_are_ignored():
    d, other = torch.randn(7), torch.randn(7)
    assert torch.allclose(rda([d, other], [2.0, 0.0]), d, atol=1e-6)
    assert torch.allclose(weighted_mean([d, other], [2.0, 0.0]), d)


def test_merges_reject_bad_weights_and_shapes():
    d = torch.ones(3)
    for fn in (rda, weighted_mean):
        with pytest.raises(ValueError, match="all merge weights are zero"):
            fn([d, d], [0.0, 0.0])
        with pytest.raises(ValueError, match="weight 1"):
            fn([d, d], [1.0, -1.0])
        with pytest.raises(ValueError, match="weight 0"):
            fn([d], [float("nan")])
        with pytest.raises(ValueError, match="2 contributions but 1 weights"):
            fn([d, d], [1.0])
        with pytest.raises(ValueError, match="delta 1 has shape"):
            fn([d, torch.ones(4)], [1.0, 1.0])
        with pytest.raises(ValueError, match="zero contributions"):
            fn([], [])


# ---------------------------------------------------------------- fragment merge


def test_merge_fragment_averages_embeddings_and_uses_rda_elsewhere():
    contributions = [
        {"tok_emb.weight": e, "blocks.0.mlp.0.weight": w}
        for e, w in zip(_unit_randn(4, (8, 4), 1.0, 1), _unit_randn(4, (4, 4), 2.0, 2))
    ]
    weights = [1.0, 2.0, 3.0, 4.0]
    merged = merge_fragment(contributions, weights, {"tok_emb.weight"})
    emb = [c["tok_emb.weight"] for c in contributions]
    mlp = [c["blocks.0.mlp.0.weight"] for c in contributions]
    assert torch.allclose(merged["tok_emb.weight"], weighted_mean(emb, weights))
    assert torch.allclose(merged["blocks.0.mlp.0.weight"], rda(mlp, weights))
    assert merged["blocks.0.mlp.0.weight"].norm().item() == pytest.approx(2.0, rel=1e-5)

    by_mean = merge_fragment(contributions, weights, {"tok_emb.weight"}, method="mean")
    assert torch.allclose(by_mean["blocks.0.mlp.0.weight"], weighted_mean(mlp, weights))


def test_merge_fragment_rejects_zero_weights_mismatched_names_and_unknown_methods():
    c = {"a": torch.ones(2)}
    with pytest.raises(ValueError, match="all merge weights are zero"):
        merge_fragment([c, c], [0.0, 0.0], set())
    with pytest.raises(ValueError, match="contribution 1 names different tensors"):
        merge_fragment([c, {"b": torch.ones(2)}], [1.0, 1.0], set())
    with pytest.raises(ValueError, match="unknown merge method 'median'"):
        merge_fragment([c], [1.0], set(), method="median")
    with pytest.raises(ValueError, match="zero contributions"):
        merge_fragment([], [], set())


# ---------------------------------------------------------------- re-anchoring


def test_reanchor_is_the_delta_itself_when_the_base_is_current():
    base, d = torch.randn(4, 3), torch.randn(4, 3)
    assert torch.allclose(reanchor(base, base.clone(), d), d)


def test_reanchored_delta_applied_to_the_current_version_lands_on_the_learner_parameters():
    base = torch.randn(10)
    theta_m = base - torch.randn(10) * 0.1  # the learner's parameters, trained from base
    current = base + torch.randn(10) * 0.2  # the syncer merged others meanwhile
    delta_prime = reanchor(base, current, base - theta_m)
    assert torch.allclose(current - delta_prime, theta_m, atol=1e-6)
    with pytest.raises(ValueError, match="shapes differ"):
        reanchor(base, current, torch.zeros(3))


# ---------------------------------------------------------------- Nesterov outer step


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_nesterov_outer_step_matches_torch_sgd(lr, momentum):
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}
    deltas = [{n: torch.randn(t.shape, generator=g) for n, t in init.items()} for _ in range(6)]

    ours = {n: t.clone() for n, t in init.items()}
    outer = NesterovOuter(lr, momentum)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=lr, momentum=momentum, nesterov=momentum > 0)
    for d in deltas:
        outer.step(ours, d)
        for n, p in ref.items():
            p.grad = d[n].clone()
        sgd.step()
        for n in init:
            assert torch.allclose(ours[n], ref[n].detach(), atol=1e-6, rtol=0)


def test_nesterov_state_round_trip_continues_identically():
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, generator=g)}
    deltas = [{"w": torch.randn(4, generator=g)} for _ in range(4)]
    a = NesterovOuter(0.7, 0.9)
    a.step(params, deltas[0])
    a.step(params, deltas[1])
    b = NesterovOuter(0.7, 0.9)
    b.load_state_dict(a.state_dict())
    pa, pb = {"w": params["w"].clone()}, {"w": params["w"].clone()}
    for d in deltas[2:]:
        a.step(pa, d)
        b.step(pb, d)
    assert torch.equal(pa["w"], pb["w"])
    assert a.state_dict()["w"] is not b.state_dict()["w"]  # loading copied the buffers


def test_nesterov_steps_only_the_named_parameters_and_keeps_buffers_per_name():
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    outer = NesterovOuter(1.0, 0.5)
    outer.step(params, {"a": torch.ones(2)})
    assert torch.equal(params["b"], torch.zeros(2))
    assert torch.allclose(params["a"], torch.full((2,), -1.5))  # buf = 1; Θ -= 1 * (1 + 0.5 * 1)
    assert set(outer.state_dict()) == {"a"}
    outer.forget(["a"])
    assert outer.state_dict() == {}


def test_nesterov_rejects_bad_inputs_without_touching_parameters():
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    outer = NesterovOuter(0.7, 0.9)
    with pytest.raises(ValueError, match="unknown parameters"):
        outer.step(params, {"a": torch.ones(2), "c": torch.ones(1)})
    with pytest.raises(ValueError, match="b: outer gradient shape"):
        outer.step(params, {"a": torch.ones(2), "b": torch.ones(2)})
    assert torch.equal(params["a"], torch.zeros(2)) and outer.state_dict() == {}
    with pytest.raises(ValueError, match="lr"):
        NesterovOuter(0.0, 0.9)
    with pytest.raises(ValueError, match="momentum"):
        NesterovOuter(0.7, 1.0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nesterov_stepped_equals_step_on_a_copy_and_leaves_the_parameters_untouched(momentum):
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    in_place, fresh = NesterovOuter(0.7, momentum), NesterovOuter(0.7, momentum)
    copy = {n: t.clone() for n, t in params.items()}
    before = {n: t.clone() for n, t in params.items()}
    current = params
    for _ in range(3):  # buffers exist from the second step on
        delta = {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}
        in_place.step(copy, delta)
        current = fresh.stepped(current, delta)
        assert all(torch.equal(current[n], copy[n]) for n in params)
    assert all(torch.equal(params[n], before[n]) for n in params), "stepped never writes its input"
    assert all(torch.equal(in_place.state_dict()[n], fresh.state_dict()[n]) for n in params)


def test_rda_matches_its_definition_with_unequal_weights():
    gen = torch.Generator().manual_seed(4)
    ds, ws = [torch.randn(50, generator=gen) * s for s in (0.5, 1.0, 3.0)], [1.0, 2.0, 0.5]
    total = sum(ws)
    radius = sum(w * d.norm() for d, w in zip(ds, ws)) / total
    direction = sum(w * d / d.norm() for d, w in zip(ds, ws)) / total
    assert torch.allclose(rda(ds, ws), radius * direction / direction.norm(), atol=1e-6)


# ---------------------------------------------------------------- huge finite updates (issue 38)


def test_rda_of_a_1e20_update_with_an_honest_one_is_finite_and_keeps_the_mean_radius():
    """‖1e20 x 1‖ squares past float32's range: the norm overflowed to inf and the merge was NaN."""
    honest, huge = torch.randn(1000) * 1e-3, torch.full((1000,), 1e20)
    out = rda([honest, huge], [1.0, 1.0])
    assert torch.isfinite(out).all()
    radius = (float(honest.double().norm()) + 1e20 * math.sqrt(1000)) / 2
    assert float(out.double().norm()) == pytest.approx(radius, rel=1e-4)
    assert tensor_norm(torch.full((4,), 1e-30)) == pytest.approx(2e-30)  # and no underflow to 0 either


def test_bound_update_clips_to_the_absolute_bound_then_to_the_median_of_recent_norms():
    param = torch.full((100,), 0.5)  # ‖Θ‖ = 5 < √n = 10: absolute bound 10 x 10 = 100
    huge = {"w": torch.full((100,), 1e20)}
    b = bound_update(huge, {"w": param}, {}, max_ratio=10.0)
    assert b.norms["w"] == pytest.approx(100.0) and float(b.deltas["w"].norm()) == pytest.approx(100.0, rel=1e-5)
    assert b.over[0][3] == "absolute" and "absolute bound 100" in b.reason()
    assert torch.equal(huge["w"], torch.full((100,), 1e20))  # the input is not modified
    # Warm-up: fewer than NORM_WARMUP norms seen, only the absolute bound applies.
    mid = {"w": torch.full((100,), 5.0)}  # norm 50
    assert not bound_update(mid, {"w": param}, {"w": (1.0,) * (NORM_WARMUP - 1)}, 10.0).over
    # After it: at most 10 x the lower median of the recent norms (a minority of larger ones does not raise it).
    history = {"w": (1.0,) * NORM_WARMUP + (1e6,) * (NORM_WARMUP - 1)}
    b = bound_update(mid, {"w": param}, history, 10.0)
    assert b.norms["w"] == pytest.approx(10.0) and b.over[0][3] == "relative"
    # Without clipping the tensor is kept as it was (the caller rejects the submission).
    assert bound_update(mid, {"w": param}, history, 10.0, clip=False).deltas["w"] is mid["w"]
    # Zero updates so far give no scale: only the absolute bound.
    assert not bound_update(mid, {"w": param}, {"w": (0.0,) * 20}, 10.0).over


def test_check_finite_names_the_tensors_with_nan_or_inf():
    check_finite({"a": torch.ones(3)})
    with pytest.raises(NotFinite, match=r"\['b', 'c'\]"):
        check_finite({"a": torch.ones(3), "b": torch.tensor([1.0, math.inf]), "c": torch.tensor([math.nan])})
