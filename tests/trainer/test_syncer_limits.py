"""The syncer's bounds on one learner's submission (syncer/limits.py): an honest learner's body always fits its
fragment's limits under every compression, and its counters are always possible; a lying one's are not."""

from __future__ import annotations

import pytest
import torch

from diloco_trainer.config import TrainConfig
from diloco_trainer.model.build import build_model, tensor_bytes
from diloco_trainer.protocol.fragments import plan_fragments
from diloco_trainer.protocol.wire import SubmissionMeta, _read_header, encode_submission, quantize
from diloco_trainer.syncer.limits import SubmissionLimits, weighed_counts

pytestmark = pytest.mark.fast


def fragments_of(config: TrainConfig) -> list[dict[str, tuple[int, ...]]]:
    model = build_model(config.model, config.seed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return [{n: shapes[n] for n in names} for names in plan_fragments(tensor_bytes(model), config.outer.fragments)]


@pytest.mark.parametrize("scheme,block_size", [("none", 64), ("bf16", 64), ("int8", 64), ("int4", 64), ("int4", 8),
                                               ("int8", 4096)])
def test_an_honest_submission_of_every_fragment_fits_its_body_and_header_limits(scheme, block_size):
    config = TrainConfig.model_validate({"model": {"seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 2},
                                         "outer": {"fragments": 5, "compression": scheme, "block_size": block_size}})
    fragments = fragments_of(config)
    limits = SubmissionLimits.from_config(config, fragments, max_unit_processes=1)
    assert limits.compression == (scheme, block_size)
    for p, shapes in enumerate(fragments):
        parts = {n: quantize(torch.randn(s), scheme, block_size) for n, s in shapes.items()}
        longest = SubmissionMeta("l" * 128, "s" * 128, p, 10**18, 10**18, 10**18)
        body = encode_submission(longest, parts, scheme, block_size, shapes)
        header = len(body) - 8 - sum(t.numel() * t.element_size() for d in parts.values() for t in d.values())
        assert len(body) <= limits.body_bytes[p] and header <= limits.header_bytes[p], (p, len(body), header)
        assert limits.body_bytes[p] < len(body) + 8192  # and not much more: a bound, not a loophole
        _read_header(body, limits.header_bytes[p])


def test_tokens_are_bounded_by_the_steps_of_the_largest_unit_the_config_allows():
    config = TrainConfig.model_validate({"inner": {"batch_size": 8}, "model": {"seq_len": 64, "d_model": 64,
                                                                               "n_layers": 2, "n_heads": 2}})
    limits = SubmissionLimits.from_config(config, fragments_of(config), max_unit_processes=4)
    assert limits.tokens_per_step == 8 * 64 * 4
    assert limits.counts_error(16, 16 * 8 * 64 * 4) is None
    assert limits.counts_error(16, 17 * 8 * 64 * 4) is None  # one step of slack (keep_fraction rounding)
    why = limits.counts_error(16, 10**18)
    assert why.startswith("c_tokens 1000000000000000000 is more than c_steps 16") and "--max-unit-processes" in why
    with pytest.raises(ValueError, match="max_unit_processes"):
        SubmissionLimits.from_config(config, fragments_of(config), max_unit_processes=0)


def test_a_merge_weight_counts_at_most_the_step_cap_at_the_submissions_own_rate():
    assert weighed_counts(16, 4096, 32) == (16, 4096.0)
    assert weighed_counts(32, 8192, 32) == (32, 8192.0)
    assert weighed_counts(10**15, 256 * 10**15, 32) == (32, 256 * 32)
