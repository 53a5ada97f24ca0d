"""Compression round-trips, error feedback, and the safetensors submission format with every rejection."""

import json
import pickle
import struct

import pytest
import safetensors.torch
import torch

from diloco_trainer.protocol.wire import (
    SCHEMES,
    ErrorFeedback,
    SubmissionMeta,
    WireError,
    decode_submission,
    decode_tensors,
    dequantize,
    encode_submission,
    encode_tensors,
    quantize,
    wire_bytes,
)

SHAPES = {"blocks.0.attn.qkv.weight": (24, 8), "blocks.0.ln1.bias": (8,), "odd": (3, 5, 7)}
META = SubmissionMeta("learner-0", "learner-0-f1-s3", fragment=1, base_version=4, c_steps=16, c_tokens=16384)


def _deltas(seed=0, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _body(scheme="int4", block_size=8, meta=META, deltas=None):
    deltas = deltas if deltas is not None else _deltas()
    parts = {n: quantize(t, scheme, block_size) for n, t in deltas.items()}
    return encode_submission(meta, parts, scheme, block_size, SHAPES)


def _blockwise_absmax(t, block_size):
    flat = t.reshape(-1)
    pad = (-flat.numel()) % block_size
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)
    return blocks.abs().amax(dim=1, keepdim=True).expand(-1, block_size).reshape(-1)[: flat.numel()]


# ---------------------------------------------------------------- quantization


@pytest.mark.parametrize("scheme,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block_size", [8, 64, 13])
def test_blockwise_round_trip_error_stays_within_half_a_step_per_block(scheme, qmax, block_size):
    g = torch.Generator().manual_seed(1)
    # Blocks with very different magnitudes: a single global scale would fail this bound.
    t = torch.randn(37, 11, generator=g) * torch.logspace(-4, 1, 37)[:, None]
    back = dequantize(quantize(t, scheme, block_size), scheme, tuple(t.shape), block_size)
    assert back.dtype == torch.float32 and back.shape == t.shape
    bound = _blockwise_absmax(t, block_size) / qmax / 2
    err = (back - t).abs().reshape(-1)
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
    assert err.max() > 0  # it is lossy: this test would notice a scheme that silently sends raw values


def test_int4_packs_two_values_per_byte_and_int8_one():
    t = torch.randn(1000)
    p4, p8 = quantize(t, "int4", 64), quantize(t, "int8", 64)
    assert p4["q"].dtype == torch.uint8 and p4["q"].numel() == 512  # 16 blocks * 64 / 2
    assert p8["q"].dtype == torch.int8 and p8["q"].numel() == 1024
    assert p4["scale"].dtype == p8["scale"].dtype == torch.float32 and p4["scale"].numel() == 16
    assert wire_bytes({"t": 1000}, "int4", 64) == 512 + 64
    assert wire_bytes({"t": 1000}, "int8", 64) == 1024 + 64
    assert wire_bytes({"t": 1000}, "bf16", 64) == 2000
    assert wire_bytes({"t": 1000, "u": 10}, "none", 64) == 4040


def test_int4_keeps_the_extremes_of_each_block_exact():
    t = torch.tensor([0.7, -0.7, 0.1, 0.0, 7.0, -3.0, 1.0, 2.0, 5.0])  # odd length: padded nibble
    back = dequantize(quantize(t, "int4", 4), "int4", (9,), 4)
    assert back[0] == pytest.approx(0.7) and back[1] == pytest.approx(-0.7)
    assert back[4] == pytest.approx(7.0) and back[8] == pytest.approx(5.0)


def test_none_round_trip_is_exact_and_bf16_is_within_its_precision():
    t = torch.randn(50, 3) * 1e-3
    assert torch.equal(dequantize(quantize(t, "none", 64), "none", (50, 3), 64), t)
    back = dequantize(quantize(t, "bf16", 64), "bf16", (50, 3), 64)
    assert quantize(t, "bf16", 64)[""].dtype == torch.bfloat16
    assert bool(((back - t).abs() <= t.abs() * 2**-8).all())  # 8 significant bits: relative error <= 2^-8


def test_all_zero_blocks_quantize_to_zeros():
    for scheme in SCHEMES:
        back = dequantize(quantize(torch.zeros(20), scheme, 8), scheme, (20,), 8)
        assert torch.equal(back, torch.zeros(20))


def test_quantize_rejects_unknown_schemes_bad_blocks_and_non_finite_input():
    with pytest.raises(ValueError, match="int2"):
        quantize(torch.ones(3), "int2", 8)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.ones(3), "int8", 0)
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([1.0, float("nan")]), "int4", 8)


# ---------------------------------------------------------------- error feedback


def _drift(scheme, feedback: bool, rounds=200):
    # Each delta: one large value per block plus a small steady drift that alone rounds to zero in int4.
    g = torch.Generator().manual_seed(2)
    ef = ErrorFeedback()
    true_sum, sent_sum = torch.zeros(64), torch.zeros(64)
    for _ in range(rounds):
        delta = torch.full((64,), 0.01) + torch.randn(64, generator=g) * 0.002
        delta[::16] = 1.0
        parts = (ef.compress({"w": delta}, scheme, 16) if feedback else {"w": quantize(delta, scheme, 16)})["w"]
        true_sum += delta
        sent_sum += dequantize(parts, scheme, (64,), 16)
    return (sent_sum - true_sum).abs().max().item(), ef


def test_error_feedback_keeps_the_sum_of_sent_deltas_on_the_true_sum():
    with_feedback, ef = _drift("int4", feedback=True)
    without, _ = _drift("int4", feedback=False)
    # Without feedback the 0.01 drift is lost every round (~200 * 0.01 = 2); with it the gap stays below
    # one quantization step (1/7/2 ≈ 0.07), which is exactly the current residual.
    assert without > 1.5
    assert with_feedback < 1.0 / 7
    assert ef.residual("w") is not None and ef.residual("w").abs().max() < 1.0 / 7


def test_error_feedback_residual_stays_zero_without_compression():
    ef = ErrorFeedback()
    d = {"w": torch.randn(10)}
    parts = ef.compress(d, "none", 8)
    assert torch.equal(parts["w"][""], d["w"])
    assert ef.residual("w") is None and ef.state_dict() == {}


def test_error_feedback_state_round_trips_and_reset_forgets():
    ef = ErrorFeedback()
    ef.compress({"a": torch.randn(33), "b": torch.randn(7)}, "int4", 8)
    snapshot = ef.state_dict()
    assert set(snapshot) == {"a", "b"}
    other = ErrorFeedback()
    other.load_state_dict(snapshot)
    nxt = {"a": torch.randn(33), "b": torch.randn(7)}
    out1, out2 = ef.compress(nxt, "int4", 8), other.compress(nxt, "int4", 8)
    assert all(torch.equal(out1[n]["q"], out2[n]["q"]) for n in nxt)
    assert not torch.equal(snapshot["a"], ef.state_dict()["a"])  # the old snapshot was not mutated in place
    ef.reset(["a"])
    assert ef.residual("a") is None and ef.residual("b") is not None


def test_error_feedback_changes_nothing_when_a_delta_cannot_be_compressed():
    ef = ErrorFeedback()
    ef.compress({"a": torch.randn(8)}, "int8", 8)
    before = ef.state_dict()
    with pytest.raises(ValueError):
        ef.compress({"a": torch.randn(8), "b": torch.tensor([float("inf")])}, "int8", 8)
    assert ef.state_dict().keys() == before.keys() and torch.equal(ef.state_dict()["a"], before["a"])


# ---------------------------------------------------------------- submissions


@pytest.mark.parametrize("scheme", SCHEMES)
def test_submission_round_trips_metadata_and_deltas(scheme):
    deltas = _deltas()
    meta, got = decode_submission(_body(scheme, deltas=deltas), SHAPES)
    assert meta == META
    assert set(got) == set(SHAPES)
    for name, t in deltas.items():
        assert got[name].dtype == torch.float32 and got[name].shape == t.shape
        expected = dequantize(quantize(t, scheme, 8), scheme, tuple(t.shape), 8)
        assert torch.equal(got[name], expected)


def test_submission_body_is_plain_safetensors_with_string_metadata():
    body = _body("int8")
    header_len = struct.unpack("<Q", body[:8])[0]
    header = json.loads(body[8 : 8 + header_len])
    md = header["__metadata__"]
    assert md["learner_id"] == "learner-0" and md["c_tokens"] == "16384" and md["compression"] == "int8"
    assert md["block_size"] == "8" and json.loads(md["shapes"])["odd"] == [3, 5, 7]
    assert {"odd.q", "odd.scale", "blocks.0.ln1.bias.q"} <= set(header)


def _forge(tensors, metadata):
    return safetensors.torch.save(tensors, metadata=metadata)


def _parts_of(body):
    tensors = safetensors.torch.load(body)
    header_len = struct.unpack("<Q", body[:8])[0]
    return tensors, json.loads(body[8 : 8 + header_len])["__metadata__"]


def _with_metadata(**changes):
    tensors, md = _parts_of(_body())
    for k, v in changes.items():
        if v is None:
            md.pop(k)
        else:
            md[k] = v
    return _forge(tensors, md)


def _with_tensors(scheme="int4", **changes):
    tensors, md = _parts_of(_body(scheme))
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    return _forge(tensors, md)


def _reject(body, match):
    with pytest.raises(WireError, match=match) as info:
        decode_submission(body, SHAPES)
    assert isinstance(info.value, ValueError) and info.value.reason


def test_decode_rejects_bodies_that_are_not_safetensors():
    _reject(b"", "not safetensors")
    _reject(b"\x00" * 7, "not safetensors")
    _reject(json.dumps({"learner_id": "x"}).encode(), "not safetensors")
    _reject(pickle.dumps({"x": 1}), "not safetensors")
    _reject(struct.pack("<Q", 4) + b"nope", "not JSON")
    for header in (b"[" * 5000 + b"]" * 5000, b'{"a": ' + b"9" * 5000 + b"}"):  # were a 500 at the syncer
        _reject(struct.pack("<Q", len(header)) + header, "not JSON")


@pytest.mark.parametrize("shapes", ["[" * 5000 + "]" * 5000, '{"w": [' + "9" * 5000 + "]}"])
def test_decode_rejects_shapes_metadata_that_json_cannot_turn_into_python(shapes):
    _reject(_with_metadata(shapes=shapes), "shapes")


def test_decode_rejects_a_truncated_body():
    body = _body()
    _reject(body[: len(body) - 10], "truncated")
    _reject(body[:20], "truncated")


def test_decode_rejects_a_header_that_lies_about_tensor_sizes_without_allocating_them():
    header = {"w.q": {"dtype": "U8", "shape": [1 << 40], "data_offsets": [0, 1 << 40]},
              "__metadata__": {"learner_id": "a"}}
    raw = json.dumps(header).encode()
    _reject(struct.pack("<Q", len(raw)) + raw + b"\x00" * 16, "not valid safetensors|truncated")


@pytest.mark.parametrize("field", ["learner_id", "submission_id", "fragment", "base_version", "c_steps",
                                   "c_tokens", "compression", "block_size", "shapes"])
def test_decode_rejects_a_missing_metadata_field(field):
    _reject(_with_metadata(**{field: None}), field)


@pytest.mark.parametrize("field,value", [("fragment", "one"), ("base_version", "1.5"), ("c_steps", ""),
                                         ("c_tokens", "1e9"), ("block_size", "eight")])
def test_decode_rejects_non_integer_metadata(field, value):
    _reject(_with_metadata(**{field: value}), f"{field}.*integer")


@pytest.mark.parametrize("field", ["fragment", "base_version", "c_steps", "c_tokens"])
def test_decode_rejects_negative_counters(field):
    _reject(_with_metadata(**{field: "-3"}), f"{field} must be non-negative")


def test_a_rebased_submission_says_so_and_any_other_value_of_the_flag_is_refused():
    meta, _ = decode_submission(_with_metadata(rider="1"), SHAPES)
    assert meta.rider and not META.rider and "rider" not in _parts_of(_body())[1], "absent unless set"
    for bad in ("true", "2", ""):
        _reject(_with_metadata(rider=bad), "rider.*'0' or '1'")


def test_decode_rejects_zero_steps_and_zero_tokens():
    _reject(_with_metadata(c_steps="0"), "c_steps must be >= 1")
    _reject(_with_metadata(c_tokens="0"), "c_tokens must be >= 1")


def test_decode_rejects_unsafe_ids():
    _reject(_with_metadata(submission_id="../../etc/passwd"), "submission_id")
    _reject(_with_metadata(learner_id=""), "learner_id")
    _reject(_with_metadata(learner_id="x" * 200), "learner_id")


def test_decode_rejects_an_unknown_compression_scheme():
    _reject(_with_metadata(compression="int2"), "unknown compression 'int2'")


def test_decode_rejects_a_missing_or_unknown_parameter():
    shapes = dict(SHAPES)
    shapes.pop("odd")
    _reject(_with_metadata(shapes=json.dumps(shapes)), r"missing.*\['odd'\]")
    with pytest.raises(WireError, match=r"unknown parameters.*'odd'"):
        decode_submission(_body(), {n: s for n, s in SHAPES.items() if n != "odd"})
    _reject(_with_tensors(**{"odd.q": None}), r"missing.*odd\.q")
    _reject(_with_tensors(**{"extra.q": torch.zeros(4, dtype=torch.uint8)}), r"unknown tensors.*extra\.q")


def test_decode_rejects_a_shape_that_does_not_match():
    shapes = {n: list(s) for n, s in SHAPES.items()}
    shapes["odd"] = [7, 5, 3]
    _reject(_with_metadata(shapes=json.dumps(shapes)), "odd: shape")
    _reject(_with_metadata(shapes="[1, 2]"), "JSON object")
    _reject(_with_metadata(shapes="{not json"), "not JSON")
    _reject(_with_tensors("none", odd=torch.zeros(7, 5, 3)), "odd: tensor shape")


def test_decode_rejects_wrong_dtypes_and_lengths_of_q_and_scale():
    _reject(_with_tensors(**{"odd.q": torch.zeros(52, dtype=torch.int8)}), r"odd\.q: dtype")
    _reject(_with_tensors(**{"odd.q": torch.zeros(51, dtype=torch.uint8)}), r"odd\.q: length 51")
    _reject(_with_tensors(**{"odd.scale": torch.zeros(13, dtype=torch.float32)}), r"odd\.scale: length 13")
    _reject(_with_tensors(**{"odd.scale": torch.zeros(14, dtype=torch.float64)}), r"odd\.scale: dtype")
    _reject(_with_tensors("bf16", odd=torch.zeros(3, 5, 7)), "odd: dtype")
    _reject(_with_tensors("none", odd=torch.zeros(3, 5, 7, dtype=torch.float16)), "odd: dtype")


def test_decode_rejects_non_finite_scales_and_values():
    bad_scale = torch.ones(14)
    bad_scale[3] = float("nan")
    _reject(_with_tensors(**{"odd.scale": bad_scale}), r"odd\.scale: scales must be finite")
    _reject(_with_tensors(**{"odd.scale": -torch.ones(14)}), r"odd\.scale: scales must be finite and non-negative")
    huge = torch.full((14,), 3e38)  # finite scale, but 7 * 3e38 overflows float32
    _reject(_with_tensors(**{"odd.scale": huge}), "odd: non-finite values")
    values = torch.zeros(3, 5, 7)
    values[1, 2, 3] = float("inf")
    _reject(_with_tensors("none", odd=values), "odd: non-finite values")


def test_encode_refuses_parts_that_do_not_match_the_shapes():
    parts = {n: quantize(t, "int4", 8) for n, t in _deltas().items()}
    with pytest.raises(ValueError, match="odd"):
        encode_submission(META, parts, "int4", 8, {n: s for n, s in SHAPES.items() if n != "odd"})
    with pytest.raises(ValueError, match="dtype"):
        encode_submission(META, parts, "int8", 8, SHAPES)


def test_submission_meta_refuses_bad_counters_at_construction():
    with pytest.raises(ValueError, match="c_steps"):
        SubmissionMeta("a", "b", 0, 0, 0, 10)
    with pytest.raises(ValueError, match="fragment"):
        SubmissionMeta("a", "b", True, 0, 1, 10)


# ---------------------------------------------------------------- plain tensor transfers


def test_tensor_transfer_round_trips_with_metadata_even_for_aliased_tensors():
    w = torch.randn(4, 4)
    tensors = {"a": w, "b": w, "c": w.t(), "d": torch.arange(5)}
    got, md = decode_tensors(encode_tensors(tensors, {"fragment": "2", "version": "7"}))
    assert md == {"fragment": "2", "version": "7"}
    assert torch.equal(got["a"], w) and torch.equal(got["b"], w) and torch.equal(got["c"], w.t())
    assert torch.equal(got["d"], torch.arange(5))


def test_tensor_transfer_rejects_garbage_and_non_string_metadata():
    with pytest.raises(WireError, match="not safetensors"):
        decode_tensors(b"garbage!" * 3)
    with pytest.raises(ValueError, match="strings"):
        encode_tensors({"a": torch.ones(1)}, {"version": 3})
