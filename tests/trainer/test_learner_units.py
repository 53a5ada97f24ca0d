"""The learner's pure pieces: warmup, slowdown, submission ids, command-line checks, the unit group of one,
and the Prometheus endpoint."""

import argparse
import random
import subprocess
import sys
import urllib.request

import pytest
import torch

from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.model.optimizer import inner_lr
from diloco_trainer.learner.loop import step_sleep
from diloco_trainer.learner.outer_sync import submission_id
from diloco_trainer.learner.exporter import serve_metrics
from diloco_trainer.learner.main import configure, options_from_args
from diloco_trainer.protocol.wire import SubmissionMeta


def test_inner_lr_warms_up_linearly_then_stays_constant():
    assert inner_lr(1, 1e-3, 10) == pytest.approx(1e-4)
    assert inner_lr(5, 1e-3, 10) == pytest.approx(5e-4)
    assert inner_lr(10, 1e-3, 10) == inner_lr(10_000, 1e-3, 10) == pytest.approx(1e-3)
    assert inner_lr(1, 1e-3, 0) == 1e-3


def test_slowdown_sleeps_the_rest_of_f_times_the_compute_time():
    rng = random.Random(0)
    assert step_sleep(0.1, 1.0, 0.0, rng) == 0.0
    assert step_sleep(0.1, 3.0, 0.0, rng) == pytest.approx(0.2)
    sleeps = [step_sleep(0.1, 2.0, 0.5, rng) for _ in range(2000)]
    assert min(sleeps) >= 0.0 and max(sleeps) <= 0.1 * (2.0 * 1.5 - 1) + 1e-9
    assert sum(sleeps) / len(sleeps) == pytest.approx(0.1, rel=0.1)  # mean factor F = 2
    assert all(step_sleep(0.1, 1.0, 0.9, rng) >= 0.0 for _ in range(100)), "never faster than the hardware"


def test_submission_ids_are_shared_by_a_base_and_distinct_across_bases_fragments_and_lives():
    sid = submission_id("learner-0", "ab12cd34", 3, 7)
    assert sid == submission_id("learner-0", "ab12cd34", 3, 7), "a superseding Δ from the same base reuses the id"
    others = {submission_id("learner-0", "ab12cd34", 3, 8), submission_id("learner-0", "ab12cd34", 2, 7),
              submission_id("learner-0", "ffff0000", 3, 7), submission_id("learner-1", "ab12cd34", 3, 7)}
    assert sid not in others and len(others) == 4
    SubmissionMeta("learner-0", sid, 3, 7, 1, 1)  # valid on the wire


def _args(*argv):
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["--syncer", "http://127.0.0.1:8470", "--learner-id", "l0", *argv])


def test_learner_options_need_the_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    with pytest.raises(ValueError, match="DILOCO_TOKEN"):
        options_from_args(_args())
    monkeypatch.setenv("OTHER_TOKEN", "s3cret")
    assert options_from_args(_args("--token-env", "OTHER_TOKEN")).token == "s3cret"


@pytest.mark.parametrize("argv,message", [
    (["--unit", "2"], "needs --units"),
    (["--unit", "4", "--units", "4"], "--unit must be in 0..UNITS-1"),
    (["--slowdown", "0.5"], "--slowdown must be >= 1"),
    (["--jitter", "1.5"], "--jitter must be < 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--drain-s", "-1"], "--drain-s"),
])
def test_bad_learner_flags_are_value_errors_naming_the_flag(monkeypatch, argv, message):
    monkeypatch.setenv("DILOCO_TOKEN", "t")
    with pytest.raises(ValueError, match=message):
        options_from_args(_args(*argv))


def test_a_learner_id_that_cannot_travel_on_the_wire_is_refused(monkeypatch):
    monkeypatch.setenv("DILOCO_TOKEN", "t")
    args = _args()
    args.learner_id = "bad id/with spaces"
    with pytest.raises(ValueError, match="learner_id"):
        options_from_args(args)


def test_unit_zero_alone_is_shard_one_of_one(monkeypatch):
    monkeypatch.setenv("DILOCO_TOKEN", "t")
    opts = options_from_args(_args())
    assert (opts.unit, opts.units) == (0, 1)
    opts = options_from_args(_args("--unit", "2", "--units", "3", "--slowdown", "2", "--jitter", "0.2"))
    assert (opts.unit, opts.units, opts.slowdown, opts.jitter) == (2, 3, 2.0, 0.2)


def test_a_unit_of_one_process_needs_no_collectives():
    group = UnitGroup()
    assert group.is_main and group.world_size == 1 and group.device is None
    assert group.broadcast_json({"a": [1, 2]}) == {"a": [1, 2]}
    assert group.step_header(True, [(1, 5)], slots=4) == (True, [(1, 5)])
    assert group.mean(torch.tensor(1.5)) == 1.5


def test_prometheus_endpoint_serves_the_latest_learner_figures():
    record = {"learner_id": "l7", "step": 42, "loss": 2.5, "tokens": 1000, "acked_tokens": 640,
              "syncer_up": True, "versions": {"0": 3, "1": 4}}
    server = serve_metrics(0, lambda: record)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    assert 'diloco_learner_step{learner_id="l7"} 42.0' in text
    assert 'diloco_learner_acked_tokens_total{learner_id="l7"} 640.0' in text
    assert 'diloco_learner_fragment_version{fragment="1",learner_id="l7"} 4.0' in text


def test_every_link_counter_reaches_the_metrics_record_and_the_exported_ones_reach_metrics():
    from diloco_trainer.learner.client import SyncerClient
    from diloco_trainer.protocol.messages import LearnerRecord, LinkCounters

    client = SyncerClient("http://127.0.0.1:9", "t", "l7")  # never bootstrapped: only its counters are read
    try:
        assert set(client.snapshot()) == set(LinkCounters.model_fields)
    finally:
        client.close()
    assert set(LinkCounters.model_fields) <= set(LearnerRecord.model_fields)
    record = LearnerRecord(time=1.0, learner_id="l7", sent=3, bytes_down_full=7.0, tokens=5).model_dump()
    server = serve_metrics(0, lambda: record)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    for line in ('diloco_learner_sent_total{learner_id="l7"} 3.0', 'diloco_learner_bytes_down_full_total'
                 '{learner_id="l7"} 7.0', 'diloco_learner_tokens_total{learner_id="l7"} 5.0',
                 'diloco_learner_pending{learner_id="l7"} 0.0', 'diloco_learner_xla_compiles_total'):
        assert line in text


def test_the_single_and_the_sharded_client_are_both_a_syncer_link():
    import inspect

    from diloco_trainer.learner.client import SyncerClient
    from diloco_trainer.learner.link import SyncerLink
    from diloco_trainer.learner.sharded_client import ShardedSyncerClient

    methods = [n for n, f in vars(SyncerLink).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert {"bootstrap", "submit", "take_updates", "take_answers", "report", "pending", "snapshot", "close"} <= set(methods)
    for cls in (SyncerClient, ShardedSyncerClient):
        for name in methods:
            assert list(inspect.signature(getattr(cls, name)).parameters) == \
                list(inspect.signature(getattr(SyncerLink, name)).parameters), (cls.__name__, name)


def test_the_outer_step_bookkeeping_imports_no_network_client():
    code = "import sys, diloco_trainer.learner.outer_sync; assert 'aiohttp' not in sys.modules, 'aiohttp imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
