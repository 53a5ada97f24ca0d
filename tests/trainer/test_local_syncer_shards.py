"""`diloco local --syncer-shards 2` with real processes on loopback: two syncer shards, each with its own state
directory and warm standby; one shard SIGKILLed mid-run is taken over by its own standby while the other shard keeps
serving, and no acknowledged update is lost."""

from __future__ import annotations

import json
import os
import signal

import pytest

from diloco_trainer.runtime.rundir import read_jsonl
from test_resilience_local import (LEARNERS, _acked_tokens, _assert_no_orphans, _merged_tokens,  # noqa: F401
                                   _replaced, _why, local_run)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _shard_versions(run, owned: list[int]) -> dict[str, int]:
    """The last versions the supervisor sampled of one shard's fragments (lines written while that shard answered)."""
    for line in reversed(read_jsonl(run.dir / "syncer.jsonl")):
        versions = line.get("versions") or {}
        if all(str(p) in versions for p in owned):
            return {str(p): int(versions[str(p)]) for p in owned}
    return {}


def test_a_sigkilled_syncer_shard_is_taken_over_by_its_own_standby_and_no_acknowledged_update_is_lost(local_run):
    run = local_run("--syncer-shards", "2", "--steps", "2000", "--minutes", "5", "--checkpoint-every-s", "30")
    run.wait(lambda: {"syncer-0", "syncer-1"} <= set(run.processes()), "both shards in processes.json")
    procs = run.processes()
    assert (procs["syncer-0"]["shard"], procs["syncer-1"]["shard"]) == (0, 1)
    assert procs["syncer-0"]["state_dir"] != procs["syncer-1"]["state_dir"]
    run.wait(lambda: all(run.step(n) >= 20 and run.last(n).get("acked", 0) > 5 for n in LEARNERS)
             and all(v > 0 for v in _shard_versions(run, [0, 1, 2, 3]).values()), "the learners to sync a few times",
             timeout=180)
    run.wait(lambda: "standing by" in (run.dir / "logs" / "syncer-1.log").read_text(), "shard 1's standby to wait")
    before = _shard_versions(run, [0, 2])
    victim = run.processes()["syncer-1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    run.wait(lambda: _replaced(run, "syncer-1", victim), "the supervisor to book shard 1's standby")
    new_pid = run.processes()["syncer-1"]["pid"]
    taken = [e for e in read_jsonl(run.dir / "events.jsonl") if e["name"] == "syncer-1" and e["event"] == "start"]
    assert taken[-1]["pid"] == new_pid and taken[-1].get("standby") is True
    run.wait(lambda: json.loads((run.dir / "syncer-1" / "endpoint.json").read_text())["pid"] == new_pid,
             "shard 1's standby to serve")
    after = _shard_versions(run, [1, 3])
    run.wait(lambda: all(v > after[p] + 2 for p, v in _shard_versions(run, [1, 3]).items())
             and all(v > before[p] + 2 for p, v in _shard_versions(run, [0, 2]).items()), "both shards merging")

    assert run.interrupt() == 0, run.log_tail()
    successor = int(json.loads((run.dir / "syncer-1" / "standby.json").read_text())["pid"])
    _assert_no_orphans(run, also=(successor,))
    merged = _merged_tokens(run)  # final/state.json: the two shards' checkpoints, combined
    for name in LEARNERS:
        acked, clean = _acked_tokens(run, name)
        assert clean, f"{name} did not write its final metrics line\n{_why(run, name)}"
        assert merged[name] == acked, f"{name}: shards merged {merged[name]}, learner acked {acked}\n{_why(run, name)}"
    summary = run.summary()
    assert summary["restarts"] == {"syncer-1": 1}
    assert summary["syncer"]["shards"] == 2 and sorted(summary["syncer"]["versions"]) == ["0", "1", "2", "3"]
    assert "syncer-1 pid" in (run.dir.parent / "local.out").read_text(), "the takeover is not in the progress output"
