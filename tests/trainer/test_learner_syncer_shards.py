"""Learner processes against two real `diloco syncer --shard i` processes on loopback: each fragment goes to its own
shard; a shard killed with SIGKILL stops only its fragments while the other keeps merging, and the learners carry on
and re-send to it once it is back, with no acknowledged update lost."""

import signal

import pytest
import yaml

from polling import wait_for
from learner_kit import SyncerProcess, finish, free_port, last_step, metrics, start_all, start_learner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _sharded_config(path, shards: int = 2):
    cfg = {"model": "tiny", "data": {"max_bytes": 200_000}, "inner": {"batch_size": 8, "warmup_steps": 5},
           "outer": {"fragments": 4, "sync_every": 4, "compression": "int4"}, "syncer": {"shards": shards}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _merged(shards, learner: str, key: str) -> int:
    return sum(s.status()["learners"].get(learner, {}).get(key, 0) for s in shards)


def test_a_shard_killed_during_merges_stops_only_its_fragments_and_learners_carry_on_across_its_restart(tmp_path):
    config = _sharded_config(tmp_path / "run.yaml")
    shards = [SyncerProcess(config, tmp_path / f"shard-{i}", tmp_path / f"shard-{i}.log", free_port(),
                            args=("--shard", str(i))) for i in range(2)]
    learners = {}
    try:
        start_all(shards)
        assert [s.status()["owned"] for s in shards] == [[0, 2], [1, 3]]
        urls = ",".join(s.url for s in shards)
        for name in ("l0", "l1"):
            learners[name] = start_learner(urls, name, tmp_path / name, 1_000_000, "--drain-s", "60")

        def acked(name):
            recs = metrics(tmp_path / name)
            return recs[-1]["acked"] if recs else 0

        wait_for(lambda: all(acked(n) >= 6 for n in learners), 240, "acknowledgements from both shards")
        wait_for(lambda: all(v > 0 for s in shards for v in s.status()["versions"].values()), 120,
                 "merges of every fragment on both shards")

        shards[1].send(signal.SIGKILL)  # mid-run: a merge follows nearly every submission
        shards[1].proc.wait()
        steps = {n: last_step(tmp_path / n) for n in learners}
        v0 = shards[0].status()["versions"]
        wait_for(lambda: all(shards[0].status()["versions"][p] >= v0[p] + 2 for p in v0), 120,
                 "shard 0 to keep merging its fragments while shard 1 is dead")
        wait_for(lambda: all(last_step(tmp_path / n) >= steps[n] + 10 for n in learners), 120,
                 "the learners to keep training while shard 1 is dead")
        wait_for(lambda: all(not metrics(tmp_path / n)[-1]["syncer_up"] for n in learners), 120,
                 "the learners to see the dead shard")

        shards[1].start()  # same port and state directory: its checkpoint, spool and journal
        assert shards[1].status()["owned"] == [1, 3], "the map changed across the restart"
        v1 = shards[1].status()["versions"]
        wait_for(lambda: all(shards[1].status()["versions"][p] >= v1[p] + 2 for p in v1), 180,
                 "the restarted shard to merge the learners' work again")
        for name, proc in learners.items():
            proc.send_signal(signal.SIGTERM)  # a clean stop: drain, last metrics line, exit 0
        for name, proc in learners.items():
            finish(proc, tmp_path / f"{name}.log", timeout=180)

        for s in shards:
            wait_for(lambda s=s: not any(s.status()["pending"].values()), 60, "every shard to merge what is pending")
        for name in learners:
            final = metrics(tmp_path / name)[-1]
            assert final["final"] and final["pending"] == 0
            # Versions a dead shard published after its last checkpoint may be gone: a Δ on one is refused as stale
            # (409) and re-adopted. Nothing else may be refused (no 421: every fragment went to its own shard).
            assert final["rejected"] == final["stale"]
            assert _merged(shards, name, "submissions_merged") == final["acked"], "an acknowledged update was lost"
            assert _merged(shards, name, "tokens_merged") == final["acked_tokens"]
    finally:
        for proc in learners.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for s in shards:
            s.stop()
