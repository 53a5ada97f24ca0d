"""Syncer memory plan: hand-computed bytes, sharding arithmetic, the measured merge speed, machine fits, the CLI."""

import json

import pytest

from diloco_chaos.simulate.syncer_plan import (GIB, PROCESS_OVERHEAD_BYTES, Machine, SyncerPlanInputs, fit, merge_seconds,
                                      shard_plan, valid_shard_counts)
from diloco_trainer.cli import main as diloco_main


def test_hand_computed_one_shard_of_a_1b_model():
    x = SyncerPlanInputs(params=1e9, fragments=24, learners=8, versions_kept=8, pending_bits=32, standby=True)
    plan = shard_plan(x, 1)
    assert plan.theta == plan.momentum == plan.checkpoint_buffer == 4e9
    assert plan.versions == 7 * 4e9  # versions_kept − 1 copies besides the current Θ
    assert plan.pending == 8 * 4e9  # eight submissions per fragment, decoded to fp32
    assert plan.merge_workspace == pytest.approx(4 * (1e9 / 24) * (8 + 3))  # one merge at a time
    assert plan.downlink == 0 and plan.process == 2 * PROCESS_OVERHEAD_BYTES
    assert plan.total == pytest.approx(4e9 * (1 + 1 + 7 + 8 + 1) + 4 * (1e9 / 24) * 11 + 2 * PROCESS_OVERHEAD_BYTES)


def test_sharding_divides_the_model_state_but_not_the_fixed_costs():
    x = SyncerPlanInputs(params=12e9)
    one, six = shard_plan(x, 1), shard_plan(x, 6)
    for part in ("theta", "momentum", "versions", "pending", "checkpoint_buffer"):
        assert getattr(six, part) == pytest.approx(getattr(one, part) / 6), part
    assert six.merge_workspace == one.merge_workspace  # one fragment's merge, whatever the shard count
    assert six.process == one.process
    assert six.cores == pytest.approx(one.cores / 6)


def test_merge_time_is_the_measured_point_and_scales_with_fragment_size_and_submissions():
    assert merge_seconds(100e6, 16) == pytest.approx(0.395)
    assert merge_seconds(500e6, 8) == pytest.approx(0.395 * 5 / 2)
    x = SyncerPlanInputs(params=12e9, fragments=24, learners=8, sync_every=24, step_time_s=1.0)
    # 24 fragments of 500M parameters, each merged once per 24 s round: 24 × 0.9875 s / 24 s.
    assert shard_plan(x, 1).cores == pytest.approx(0.9875)


def test_shard_counts_must_divide_the_fragments():
    assert valid_shard_counts(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    with pytest.raises(ValueError, match="divide"):
        shard_plan(SyncerPlanInputs(params=1e9), 5)


def test_quantized_downlink_and_compressed_pending_change_the_right_parts():
    base = shard_plan(SyncerPlanInputs(params=1e9), 1)
    lean = shard_plan(SyncerPlanInputs(params=1e9, pending_bits=4, downlink_bits=4, versions_kept=2), 1)
    assert lean.pending == base.pending / 8
    assert lean.versions == base.versions / 7
    assert lean.downlink == pytest.approx(4e9 + 2 * 1e9 * 0.5)  # fp32 residual + two kept int4 updates


def test_fit_picks_the_fewest_shards_that_fit_one_machine():
    x = SyncerPlanInputs(params=12e9)
    big = fit(x, Machine(1024, 64))
    assert big.shards is not None
    chosen = shard_plan(x, big.shards)
    assert chosen.total <= 1024 * GIB * 0.8
    smaller = [s for s in valid_shard_counts(24) if s < big.shards]
    assert all(shard_plan(x, s).total > 1024 * GIB * 0.8 for s in smaller)
    assert big.machines * big.shards_per_machine >= big.shards
    assert fit(SyncerPlanInputs(params=100e9), Machine(64, 16)).shards is None  # not even one fragment fits


def test_more_memory_never_needs_more_shards():
    x = SyncerPlanInputs(params=12e9)
    shards = [fit(x, Machine(ram, 64)).shards for ram in (256, 512, 1024, 4096)]
    assert all(s is not None for s in shards) and shards == sorted(shards, reverse=True)


@pytest.mark.parametrize("kwargs, field", [({"params": 0}, "params"), ({"params": 1e9, "fragments": 0}, "fragments"),
                                           ({"params": 1e9, "pending_bits": 3}, "pending_bits"),
                                           ({"params": 1e9, "step_time_s": 0}, "step_time_s")])
def test_bad_inputs_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SyncerPlanInputs(**kwargs)


def test_diloco_simulate_syncer_memory_json_parses(capsys):
    code = diloco_main(["simulate", "syncer-memory", "--params", "1e9", "12e9", "--ram-gib", "256", "--cores", "16",
                        "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [x["params"] for x in out["inputs"]] == [1e9, 12e9]
    assert out["one_shard"][0]["theta"] == 4e9
    assert out["fits"][1][0]["machine"] == {"ram_gib": 256.0, "cores": 16, "usable": 0.8}
    assert out["fits"][1][0]["shards"] == fit(SyncerPlanInputs(params=12e9), Machine(256, 16)).shards


def test_diloco_simulate_syncer_memory_prints_the_tables(capsys):
    assert diloco_main(["simulate", "syncer-memory"]) == 0
    out = capsys.readouterr().out
    assert "1e+11" in out and "1024 GiB, 64 cores" in out and "does not fit" in out


def test_diloco_simulate_syncer_memory_rejects_a_bad_value(capsys):
    assert diloco_main(["simulate", "syncer-memory", "--fragments", "0"]) == 2
    assert "fragments" in capsys.readouterr().err
