"""The typed contracts of protocol.py: torch-free, strict on requests, tolerant of unknown keys."""

import json
import subprocess
import sys

import pytest

from diloco_trainer.protocol.messages import (FragmentQuery, HeartbeatRequest, MetricsRecord, ProcessesDoc, ProtocolError,
                                     RegisterRequest, SyncerSample, SyncerStatus, parse)


@pytest.mark.parametrize("module", ["diloco_trainer.protocol.messages", "diloco_trainer.goodput", "diloco_chaos.goodput",
                                    "diloco_operator.reconcile.syncer_status"])
def test_the_contracts_and_their_readers_import_without_torch(module):
    code = (f"import json, sys; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("doc,field", [
    ({"learner_id": "a"}, "unit"),
    ({"learner_id": "a", "unit": 0, "world_size": 1}, "device"),
    ({"learner_id": "a", "unit": "0", "world_size": 1, "device": "cpu"}, "unit"),
    ({"learner_id": "a", "unit": 0, "world_size": False, "device": "cpu"}, "world_size"),
    ({"learner_id": "a b", "unit": 0, "world_size": 1, "device": "cpu"}, "learner_id"),
    ({"learner_id": "a", "unit": 2**40, "world_size": 1, "device": "cpu"}, "unit"),
    ({"learner_id": "a", "unit": 0, "world_size": 1, "device": ""}, "device"),
])
def test_register_requires_every_field_and_names_the_bad_one(doc, field):
    with pytest.raises(ProtocolError) as err:
        parse(RegisterRequest, doc)
    assert err.value.reason.startswith(field)


def test_heartbeat_refuses_nan_negative_and_huge_values_and_ignores_unknown_keys():
    ok = parse(HeartbeatRequest, {"learner_id": "a", "step": 3, "tokens": 9, "step_time_s": 1, "later": [1]})
    assert ok.step_time_s == 1.0 and ok.step == 3
    for bad in ({"step_time_s": float("nan")}, {"step_time_s": -0.1}, {"step": -1}, {"tokens": 2**63}):
        with pytest.raises(ProtocolError) as err:
            parse(HeartbeatRequest, {"learner_id": "a", "step": 1, "tokens": 0} | bad)
        assert err.value.reason.startswith(next(iter(bad)))


@pytest.mark.parametrize("query,field", [({"after": "1.5"}, "after"), ({"after": "--1"}, "after"),
                                         ({"after": "9" * 30}, "after"), ({"after": "١٢"}, "after"),
                                         ({"dtype": "fp16"}, "dtype")])
def test_fragment_query_names_the_bad_parameter(query, field):
    with pytest.raises(ProtocolError) as err:
        FragmentQuery.from_query(query)
    assert err.value.reason.startswith(field)
    assert FragmentQuery.from_query({"after": "-1", "dtype": "bf16"}) == FragmentQuery(after=-1, dtype="bf16")


def test_syncer_sample_lines_round_trip_with_the_status_beside_the_time():
    status = SyncerStatus(versions={"0": 2}, outer_steps=2, outer_steps_per_fragment={"0": 2}, merges=2,
                          contributions_merged=3, tokens_merged=10, learners={}, live_learners=0, pending={"0": 1},
                          grace_s=0.0, quorum=1, fragments=1, uptime_s=4.0)
    line = SyncerSample(time=5.0, elapsed_s=1.0, up=True, status=status).to_line()
    assert line["outer_steps"] == 2 and line["time"] == 5.0
    assert SyncerSample.from_line(json.loads(json.dumps(line))).status == status
    assert SyncerSample.from_line({"time": 6.0, "elapsed_s": 2.0, "up": False}).status is None


def test_metrics_records_of_learners_and_baseline_workers_read_alike():
    learner = MetricsRecord.model_validate({"time": 1.0, "learner_id": "l0", "step": 8, "tokens": 64})
    worker = MetricsRecord.model_validate({"time": 1.0, "learner_id": "w0", "step": 30, "resumed_from_step": 20,
                                           "param_sha256": "ab"})
    assert learner.steps_in_incarnation == 8 and worker.steps_in_incarnation == 10


def test_processes_json_keeps_the_supervisors_metadata():
    doc = ProcessesDoc.model_validate({"supervisor_pid": 1, "updated": 2.0, "processes": [
        {"name": "learner-0", "role": "learner", "pid": 7, "alive": True, "state_dir": "/x", "slowdown": 2.0}]})
    assert doc.process("learner-0").slowdown == 2.0 and doc.process("syncer") is None
