"""The quantized down-link without the network: published updates rebuild the syncer's values bit for bit, error
feedback keeps the published values on the exact ones, chains exist only while every update is kept, and a
wrong update is caught by the digest."""

import pytest
import torch

from diloco_trainer.protocol.downlink import (Update, UpdateHistory, apply_update, decode_answer, dequantize_update,
                                     encode_chain, fragment_digest, publish, quantize_update, reconstruct,
                                     update_nbytes)
from diloco_trainer.protocol.wire import WireError

SHAPES = {"blocks.0.attn.qkv.weight": (24, 8), "blocks.0.ln1.bias": (8,), "odd": (3, 5, 7)}


def _theta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _run(scheme: str, versions: int, keep: int, seed: int = 0):
    """A syncer's publishing loop: each outer step is taken from the published values (as the syncer's merge
    does), the update published; returns the published versions, the last residual, the history and the sum of
    all outer steps."""
    current, residual, history = _theta(seed), {}, UpdateHistory(keep)
    published = {0: current}
    exact = dict(current)
    for v in range(1, versions + 1):
        step = _theta(1000 + v, scale=1e-2)
        exact = {n: exact[n] + step[n] for n in exact}
        stepped = {n: current[n] + step[n] for n in current}
        current, parts, residual = publish(current, stepped, residual, scheme, 16)
        history.add(Update(v - 1, v, parts, update_nbytes(parts), fragment_digest(current)))
        published[v] = current
    return published, residual, history, exact


@pytest.mark.parametrize("scheme", ["int8", "int4", "int2"])
def test_a_learner_following_every_version_rebuilds_each_one_bit_identically(scheme):
    published, _, history, _ = _run(scheme, versions=60, keep=60)
    held = published[0]
    for v in range(1, 61):
        chain = history.chain(v - 1, v)
        held = reconstruct(held, decode_answer(encode_chain(0, v - 1, v, chain, scheme, 16, chain[-1].digest)))
        assert fragment_digest(held) == fragment_digest(published[v])
        assert all(torch.equal(held[n], published[v][n]) for n in SHAPES)
    assert not all(torch.equal(published[60][n], published[0][n]) for n in SHAPES)


@pytest.mark.parametrize("scheme", ["int8", "int4", "int2"])
def test_error_feedback_keeps_published_plus_residual_equal_to_the_exact_outer_steps(scheme):
    published, residual, _, exact = _run(scheme, versions=30, keep=2)
    last = published[30]
    for n in SHAPES:
        torch.testing.assert_close(last[n] + residual[n], exact[n], rtol=0, atol=1e-5)
        # What is still owed is one update's quantization error (RMS below one step's 1e-2), not 30 of them.
        assert residual[n].pow(2).mean().sqrt() < 1e-2


def test_a_chain_exists_only_while_every_update_from_the_base_is_kept():
    published, _, history, _ = _run("int4", versions=10, keep=3)
    assert [u.version for u in history.chain(7, 10)] == [8, 9, 10]
    assert [u.version for u in history.chain(9, 10)] == [10]
    assert history.chain(10, 10) == []
    assert history.chain(6, 10) is None  # update 7 is gone
    assert history.chain(42, 10) is None  # never published (or published before a restart and lost)
    held = reconstruct(published[7], decode_answer(encode_chain(0, 7, 10, history.chain(7, 10), "int4", 16,
                                                                history.chain(7, 10)[-1].digest)))
    assert all(torch.equal(held[n], published[10][n]) for n in SHAPES)


def test_a_wrong_base_or_a_tampered_update_fails_the_digest_check_instead_of_giving_wrong_values():
    published, _, history, _ = _run("int4", versions=3, keep=3)
    answer = decode_answer(encode_chain(0, 2, 3, history.chain(2, 3), "int4", 16, history.chain(2, 3)[-1].digest))
    with pytest.raises(WireError, match="digest"):
        reconstruct(published[1], answer)  # the learner holds another version than the base
    answer.steps[0]["odd"]["scale"] = answer.steps[0]["odd"]["scale"] * 2
    with pytest.raises(WireError, match="digest"):
        reconstruct(published[2], answer)
    with pytest.raises(WireError, match="do not match"):
        apply_update({"other": torch.zeros(3)}, history.chain(2, 3)[0].parts, "int4", 16)


def test_publishing_never_mutates_the_current_version_or_the_residual_it_started_from():
    current, residual = _theta(1), {n: torch.full(s, 1e-3) for n, s in SHAPES.items()}
    before = {n: t.clone() for n, t in current.items()}, {n: t.clone() for n, t in residual.items()}
    publish(current, _theta(2), residual, "int4", 16)
    assert all(torch.equal(current[n], before[0][n]) and torch.equal(residual[n], before[1][n]) for n in SHAPES)


def test_int2_updates_use_four_odd_levels_per_block_and_a_quarter_byte_per_value():
    x = torch.linspace(-3, 3, 64)
    parts = quantize_update(x, "int2", 64)
    assert parts["q"].numel() == 16 and parts["scale"].item() == 1.0
    back = dequantize_update(parts, "int2", (64,), 64)
    assert set(back.tolist()) == {-3.0, -1.0, 1.0, 3.0} and (back - x).abs().max() <= 1.0
    assert torch.equal(dequantize_update(quantize_update(torch.zeros(9), "int2", 4), "int2", (9,), 4), torch.zeros(9))


@pytest.mark.parametrize("change, reason", [({"q": torch.zeros(3, dtype=torch.uint8)}, "q must be"),
                                            ({"scale": torch.tensor([float("nan")] * 2)}, "scale must be"),
                                            ({"scale": -torch.ones(2)}, "scale must be")])
def test_a_malformed_int2_update_is_a_wire_error(change, reason):
    parts = quantize_update(torch.randn(7), "int2", 4) | change
    with pytest.raises(WireError, match=reason):
        dequantize_update(parts, "int2", (7,), 4)
