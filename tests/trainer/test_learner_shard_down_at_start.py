"""A learner (re)starting while a syncer shard is down, with real `diloco syncer --shard i` and `diloco learner`
processes on loopback: a restarted learner trains its dead shard's fragments from the Θ it saved and registers with
the shard when it is back; a new learner, which holds nothing, waits for the shard and says which one."""

import re
import shutil
import signal

import pytest
import yaml

from polling import wait_for
from learner_kit import SyncerProcess, finish, free_port, last_step, metrics, start_all, start_learner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _sharded_config(path):
    cfg = {"model": "tiny", "data": {"max_bytes": 200_000}, "inner": {"batch_size": 8, "warmup_steps": 5},
           "outer": {"fragments": 4, "sync_every": 4, "compression": "int4"}, "syncer": {"shards": 2}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _shards(tmp_path, config):
    return [SyncerProcess(config, tmp_path / f"shard-{i}", tmp_path / f"shard-{i}.log", free_port(),
                          args=("--shard", str(i))) for i in range(2)]


def _stop(learner, shards) -> None:
    """Kill the learner if it still runs, and stop every shard (also after a failed assertion)."""
    if learner is not None and learner.poll() is None:
        learner.kill()
        learner.wait()
    for s in shards:
        s.stop()


def _merged(shard, learner: str) -> int:
    return shard.status()["learners"].get(learner, {}).get("submissions_merged", 0)


def _log(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _records_since(state_dir, count: int) -> list[dict]:
    return metrics(state_dir)[count:]


@pytest.mark.parametrize("state_lost", [False, True], ids=["shard-back-with-its-state", "shard-back-wiped"])
def test_a_learner_restarted_while_a_shard_is_dead_trains_from_its_saved_theta_and_rejoins_the_shard(tmp_path,
                                                                                                     state_lost):
    config = _sharded_config(tmp_path / "run.yaml")
    shards = _shards(tmp_path, config)
    state = tmp_path / "l0"
    learner = None
    try:
        start_all(shards)
        urls = ",".join(s.url for s in shards)
        learner = start_learner(urls, "l0", state, 1_000_000, "--drain-s", "60")
        # Merges on both shards, and a snapshot (every 10 steps) taken after them: the Θ it saves is a merged one.
        wait_for(lambda: all(v > 0 for s in shards for v in s.status()["versions"].values()), 300,
                 "merges of every fragment on both shards")
        wait_for(lambda: (recs := metrics(state)) and all(v > 0 for v in recs[-1]["versions"].values()), 120,
                 "the learner to adopt merged versions of every fragment")
        merged_at = last_step(state)
        wait_for(lambda: last_step(state) >= merged_at + 20, 120, "steps after the adoptions (a snapshot among them)")

        shards[1].send(signal.SIGKILL)
        shards[1].proc.wait()
        learner.kill()  # SIGKILL: no drain, no final line; the state directory is all the next start has
        learner.wait()
        before = len(metrics(state))
        merged0 = _merged(shards[0], "l0")

        learner = start_learner(urls, "l0", state, 1_000_000, "--drain-s", "60")
        line = wait_for(lambda: re.search(r"syncer shard 1 \(\S+\) is away: training fragment\(s\) \[1, 3\] from "
                                          r"the saved version\(s\) \{1: (\d+), 3: (\d+)\}", _log(tmp_path, "l0")),
                        240, "the restarted learner to start from its saved values of shard 1's fragments")
        assert all(int(v) > 0 for v in line.groups()), "the saved versions are the merged ones"
        wait_for(lambda: any(r["step"] >= 20 for r in _records_since(state, before)), 240,
                 "the restarted learner to train while shard 1 is dead")
        wait_for(lambda: _merged(shards[0], "l0") >= merged0 + 3, 240,
                 "shard 0 to merge the restarted learner's submissions")
        assert learner.poll() is None
        assert not _records_since(state, before)[-1]["syncer_up"], "shard 1 is dead: not every shard is up"

        if state_lost:  # it comes back without the versions the learner saved: no Δ may be based on them
            shutil.rmtree(shards[1].state_dir)
        shards[1].start()  # same port (and state directory, unless lost)
        v1 = shards[1].status()["versions"]
        back = wait_for(lambda: re.search(r"syncer shard 1 \(\S+\) is back: registered; fragment versions "
                                          r"\{1: (\d+), 3: (\d+)\} there", _log(tmp_path, "l0")), 240,
                        "the learner to register with shard 1")
        if state_lost:
            assert back.groups() == ("0", "0")
        wait_for(lambda: all(shards[1].status()["versions"][p] >= v1[p] + 2 for p in v1), 240,
                 "shard 1 to merge the restarted learner's work on its fragments")
        wait_for(lambda: _records_since(state, before)[-1]["syncer_up"], 120, "the learner to see every shard up")

        learner.send_signal(signal.SIGTERM)
        finish(learner, tmp_path / "l0.log", timeout=240)
        for s in shards:
            wait_for(lambda s=s: not any(s.status()["pending"].values()), 120, "every shard to merge what is pending")
        final = metrics(state)[-1]
        assert final["final"] and final["pending"] == 0
        # No Δ went out against a base a shard did not know: only stale bases (409, re-adopted) may be refused.
        assert final["rejected"] == final["stale"]
        merged = _merged(shards[0], "l0") + _merged(shards[1], "l0")
        # A resend of the killed life's unsent work that a shard already held is acknowledged as a duplicate: it
        # was merged (or is counted in merged0) once, under the killed life, never twice.
        assert merged >= merged0 + final["acked"] - final["duplicates"], \
            "an acknowledged update of the restarted learner was lost"
    finally:
        _stop(learner, shards)


def test_a_new_learner_waits_for_a_dead_shard_naming_it_and_starts_when_it_is_back(tmp_path):
    config = _sharded_config(tmp_path / "run.yaml")
    shards = _shards(tmp_path, config)
    learner = None
    try:
        shards[0].start()  # shard 1 is not running: its port refuses connections
        urls = ",".join(s.url for s in shards)
        learner = start_learner(urls, "fresh", tmp_path / "fresh", 40, "--drain-s", "60")
        wait_for(lambda: f"waiting for syncer shard 1 ({shards[1].url}) of 2: this learner holds no saved values "
                         "of fragment(s) [1, 3]" in _log(tmp_path, "fresh"), 240,
                 "the new learner to say it waits for shard 1")
        assert learner.poll() is None and metrics(tmp_path / "fresh") == [], "it trained without all of Θ"

        shards[1].start()
        finish(learner, tmp_path / "fresh.log", timeout=300)
        final = metrics(tmp_path / "fresh")[-1]
        assert final["final"] and final["step"] == 40 and final["pending"] == 0
        assert final["rejected"] == 0
    finally:
        _stop(learner, shards)
