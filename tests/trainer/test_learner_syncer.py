"""Learner processes against a real `diloco syncer` process on loopback (tiny model, CPU)."""

import json
import re
import signal
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from polling import wait_for
from learner_kit import SyncerProcess, child_env, finish, free_port, last_step, metrics, start_learner, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def syncer(tmp_path):
    proc = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log")
    yield proc
    proc.stop()


def _versions_never_decrease(records):
    for before, after in zip(records, records[1:]):
        for p, v in before["versions"].items():
            assert after["versions"][p] >= v, f"fragment {p} went back from {v} to {after['versions'][p]}"


def test_learner_trains_and_every_acknowledged_token_is_merged_then_a_restart_resumes_its_shard(tmp_path, syncer):
    syncer.start()
    state = tmp_path / "l0"
    log = tmp_path / "l0.log"
    finish(start_learner(syncer.url, "l0", state, 48, log_path=log), log)

    recs = metrics(state)
    final = recs[-1]
    assert final["final"] and final["step"] == 48 and final["tokens"] == 48 * 8 * 64
    # Each of the 4 fragments goes out H=8 steps after the version it adopted, and adoption follows its own send by
    # a step or two (the clock restarts at adoption), so 48 steps carry 3 to 5 sends per fragment.
    assert final["queued"] == final["sent"] >= 12, "with the syncer up, every Δ is delivered, none superseded"
    assert final["acked"] == final["sent"] and final["rejected"] == 0 and final["pending"] == 0
    assert final["adoptions"] > 0 and all(v > 0 for v in final["versions"].values())
    _versions_never_decrease(recs)
    assert recs[-2]["loss"] < recs[0]["loss"] - 0.5, "training must reduce the loss"
    wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge everything pending")
    mine = syncer.status()["learners"]["l0"]
    assert mine["tokens_merged"] == final["acked_tokens"] > 0
    assert mine["steps_merged"] == final["acked_steps"]
    assert mine["submissions_merged"] == final["acked"]

    first = json.loads((state / "position.json").read_text())
    assert first == {"shard": 0, "num_shards": 1, "offset": 48 * 8, "epoch": 0}
    finish(start_learner(syncer.url, "l0", state, 10, log_path=log), log)
    assert json.loads((state / "position.json").read_text())["offset"] == first["offset"] + 10 * 8
    assert "resuming shard 0/1 at epoch 0, offset 384" in log.read_text()
    second_run = metrics(state)[len(recs):]
    assert second_run[-1]["step"] == 10, "counters restart with the process"
    assert all(second_run[0]["versions"][p] >= v for p, v in final["versions"].items()), \
        "a restarted learner starts from the current Θ, never from older versions"


def test_learner_waits_for_a_late_syncer_keeps_stepping_while_it_is_away_and_loses_no_acknowledged_update(
        tmp_path):
    port = free_port()
    syncer = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log", port)
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    learner = start_learner(f"http://127.0.0.1:{port}", "l0", state, 1_000_000, "--drain-s", "30", log_path=log)
    try:
        # The learner is up and retrying its registration against nothing (the syncer starts only after that).
        wait_for(lambda: "waiting for the syncer at" in log.read_text() or learner.poll() is not None, 120,
                 "the learner's first failed registration")
        assert learner.poll() is None, log.read_text()
        assert last_step(state) == 0, "no step before the initial pull of Θ"
        syncer.start()
        wait_for(lambda: metrics(state) and metrics(state)[-1]["acked"] >= 3, 120, "the first acknowledgements")

        syncer.send(signal.SIGSTOP)  # the syncer hangs: requests get no answer
        before = last_step(state)
        wait_for(lambda: last_step(state) >= before + 10, 60, "the learner to step on while the syncer is stopped")
        acked_at_stop = metrics(state)[-1]["acked"]
        syncer.send(signal.SIGCONT)
        wait_for(lambda: metrics(state)[-1]["acked"] >= acked_at_stop + 3, 60, "syncing again")
        syncer.send(signal.SIGKILL)  # crash: acknowledged submissions must survive via the spool
        syncer.proc.wait()
        before = last_step(state)
        wait_for(lambda: not metrics(state)[-1]["syncer_up"], 30, "the learner to notice the syncer is gone")
        wait_for(lambda: last_step(state) >= before + 10, 60, "the learner to step on while the syncer is dead")
        acked_while_dead = metrics(state)[-1]["acked"]
        syncer.start()  # same port, same state directory: resumes from checkpoint + spool
        wait_for(lambda: metrics(state)[-1]["acked"] > acked_while_dead + 3 and metrics(state)[-1]["syncer_up"],
                 60, "acknowledgements from the restarted syncer")
        learner.send_signal(signal.SIGTERM)  # a clean stop: drain, last metrics line, exit 0
        finish(learner, log, timeout=90)

        final = metrics(state)[-1]
        # Versions published after the syncer's last checkpoint died with it: Δs based on them are refused as
        # stale (409) and the learner re-adopts. Nothing else may be refused.
        assert final["final"] and final["pending"] == 0 and final["rejected"] == final["stale"]
        assert final["superseded"] > 0 and final["queued"] > final["sent"], \
            "Δs due while the syncer was away must supersede the unanswered ones, not pile up"
        wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge what is pending")
        mine = syncer.status()["learners"]["l0"]
        assert mine["tokens_merged"] == final["acked_tokens"], "acknowledged tokens lost or double counted"
        assert mine["submissions_merged"] == final["acked"]
        _versions_never_decrease(metrics(state))
    finally:
        if learner.poll() is None:
            learner.kill()
        syncer.stop()


def test_two_process_unit_all_reduces_inside_and_only_rank_0_talks_to_the_syncer(tmp_path, syncer):
    syncer.start()
    state, dump = tmp_path / "u0", tmp_path / "params"
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        logs.append(tmp_path / f"u0-rank{rank}.log")
        procs.append(start_learner(syncer.url, "u0", state, 32, "--save-params", str(dump), env=env,
                                   log_path=logs[-1]))
    for proc, log in zip(procs, logs):
        finish(proc, log)

    syncer_log = (tmp_path / "syncer.log").read_text()
    assert syncer_log.count("learner u0 registered") == 1 and "world size 2" in syncer_log
    assert "syncer reachable" not in logs[1].read_text(), "rank 1 must not talk to the syncer"
    final = metrics(state)[-1]
    assert final["world_size"] == 2 and final["tokens"] == 32 * 2 * 8 * 64, "the unit trains 2 x batch per step"
    assert final["acked"] > 0 and final["adoptions"] > 0

    rank0, rank1 = (load_file(str(dump / f"params-rank{r}.safetensors")) for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0), "ranks of one unit must hold identical parameters"
    meta = [safe_open(str(dump / f"params-rank{r}.safetensors"), "pt").metadata() for r in (0, 1)]
    assert meta[0]["versions"] == meta[1]["versions"] and meta[0]["step"] == meta[1]["step"] == "32"
    assert json.loads(meta[0]["versions"]) == final["versions"]
    assert json.loads((state / "position.json").read_text())["offset"] == 32 * 2 * 8, "one unit-wide position"


def test_a_stopping_learner_waits_only_drain_s_for_an_unresponsive_syncer(tmp_path, syncer):
    syncer.start()
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    learner = start_learner(syncer.url, "l0", state, 1_000_000, "--drain-s", "2", log_path=log)
    try:
        wait_for(lambda: metrics(state) and metrics(state)[-1]["acked"] >= 2, 120, "the first acknowledgements")
        syncer.send(signal.SIGSTOP)
        time.sleep(1.0)  # fragments fall due; their submissions cannot be answered
        stopped = time.monotonic()
        learner.send_signal(signal.SIGTERM)
        finish(learner, log, timeout=60)
        assert time.monotonic() - stopped < 20, "the drain must be bounded by --drain-s"
    finally:
        if learner.poll() is None:
            learner.kill()
    final = metrics(state)[-1]
    assert final["final"] and final["pending"] >= 1
    assert "submission(s) unanswered after 2 s of drain" in log.read_text()


def test_a_bf16_downlink_halves_the_bytes_of_every_adopted_version_and_training_still_converges(tmp_path):
    from diloco_trainer.config import MODEL_PRESETS
    from diloco_trainer.protocol.fragments import plan_fragments
    from diloco_trainer.model.gpt import build_model

    syncer = SyncerProcess(write_config(tmp_path / "run.yaml", downlink="bf16"), tmp_path / "syncer",
                           tmp_path / "syncer.log")
    try:
        syncer.start()
        state = tmp_path / "l0"
        finish(start_learner(syncer.url, "l0", state, 32, log_path=tmp_path / "l0.log"), tmp_path / "l0.log")
    finally:
        syncer.stop()
    recs = metrics(state)
    final = recs[-1]
    assert final["adoptions"] > 0 and final["rejected"] == 0 and final["acked"] == final["sent"] > 0
    assert recs[-2]["loss"] < recs[0]["loss"] - 0.5, "training must reduce the loss"
    sizes = [(n, p.numel()) for n, p in build_model(MODEL_PRESETS["tiny"]).named_parameters()]
    n_params = sum(s for _, s in sizes)
    by_fragment = [sum(dict(sizes)[n] for n in names) for names in plan_fragments(sizes, 4)]
    fragments_down = final["bytes_down"] - (4 * n_params + 65_536)  # less the initial fp32 pull of all of Θ
    # Every adopted version came as bf16: 2 bytes a value (an fp32 down-link would need 4 × the smallest).
    assert 4 * min(by_fragment) > 2 * max(by_fragment) + 4096
    assert fragments_down <= final["adoptions"] * (2 * max(by_fragment) + 4096), (fragments_down, final)


def test_a_restarted_learner_resumes_its_adamw_state_and_learning_rate_instead_of_warming_up_again(tmp_path, syncer):
    syncer.start()
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    finish(start_learner(syncer.url, "l0", state, 20, log_path=log), log)
    assert (state / "inner-state.safetensors").exists(), "a snapshot every 10 steps"
    lr = metrics(state)[-1]["lr"]

    first = len(metrics(state))
    finish(start_learner(syncer.url, "l0", state, 5, "--log-every", "1", "--restore-inner-state", log_path=log), log)
    resumed = metrics(state)[first:]
    assert "resumed AdamW and error feedback after 20 steps" in log.read_text()
    assert resumed[0]["lr"] == pytest.approx(lr), "no second warm-up: the schedule continues at step 21"

    first = len(metrics(state))
    finish(start_learner(syncer.url, "l0", state, 5, "--log-every", "1", "--no-restore-inner-state", log_path=log),
           log)
    afresh = metrics(state)[first:]
    assert afresh[0]["lr"] == pytest.approx(lr / 5), "without the snapshot: step 1 of a 5-step warm-up"


def _kill_mid_snapshot_interval(state, proc):
    """SIGKILL the learner once it has logged a step whose last digit is 4 to 6 (the old 10-step snapshots were
    then 4 to 6 steps behind); its last logged step. Its steps are slowed so that the kill lands within a step."""
    try:
        wait_for(lambda: (m := metrics(state)) and m[-1]["step"] >= 14 and m[-1]["step"] % 10 in (4, 5, 6), 180,
                 "a step 4 to 6 steps past a multiple of 10", interval=0.02)
    finally:
        proc.kill()
        proc.wait()
    return metrics(state)[-1]["step"]


def test_a_sigkilled_learner_loses_at_most_its_last_step_and_resumes_its_data_right_after_the_work_it_resends(
        tmp_path, syncer):
    syncer.start()
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    first = start_learner(syncer.url, "l0", state, 1_000_000, "--log-every", "1", "--slowdown", "4", log_path=log)
    try:
        wait_for(lambda: metrics(state), 120, "the first metrics line")
        syncer.stop()  # cleanly, at the versions the learner holds: its unsent work stays resendable
    except BaseException:
        first.kill()
        raise
    stopped_at = metrics(state)[-1]["step"] + 2  # an update fetched just before the stop lands a step or two later
    trained = _kill_mid_snapshot_interval(state, first)
    syncer.start()
    before = syncer.status()["learners"].get("l0", {}).get("steps_merged", 0)

    lines = len(metrics(state))
    finish(start_learner(syncer.url, "l0", state, 3, log_path=log), log)
    text = log.read_text()
    resumed = re.findall(r"resuming shard 0/1 at epoch 0, offset (\d+)", text)
    # The snapshot after each step (written in the background) is at most a step behind the last logged one, and
    # the data resumes exactly after the steps its resent work covers.
    assert resumed and int(resumed[-1]) >= 8 * (trained - 1), (trained, resumed, text[-3000:])
    snapshot_steps = int(resumed[-1]) // 8
    found = re.search(r"resending the unsent work of the previous start: (\d+) of (\d+) fragment\(s\).*\((\d+) steps\)",
                      text)
    assert found and int(found.group(1)) >= 1, text[-3000:]
    # Each fragment's Δ covers its steps from the version it last adopted (by `stopped_at`) to the snapshot.
    assert int(found.group(3)) >= int(found.group(1)) * (snapshot_steps - stopped_at)
    second = metrics(state)[lines:][-1]
    assert second["rejected"] == 0 and second["acked"] == second["sent"]
    assert second["snapshots"] >= 1 and second["snapshot_write_s"] > 0
    wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge the resent work")
    assert syncer.status()["learners"]["l0"]["steps_merged"] - before == second["acked_steps"]


def test_a_killed_learners_unsent_work_is_resent_by_its_next_start_and_counted_once(tmp_path, syncer):
    syncer.start()
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    first = start_learner(syncer.url, "l0", state, 1_000_000, log_path=log)
    try:
        wait_for(lambda: metrics(state), 120, "the first metrics line")
        syncer.stop()  # cleanly: its checkpoint holds every version the learner may have adopted
        # The learner trains on with the syncer away; nothing it sends from here on can be delivered.
        wait_for(lambda: metrics(state) and metrics(state)[-1]["step"] >= 25, 180, "25 steps with the syncer away")
    finally:
        first.kill()  # SIGKILL: everything since its last acknowledged sends dies with it (but the snapshot)
        first.wait()
    syncer.start()
    before = syncer.status()["learners"].get("l0", {}).get("steps_merged", 0)

    lines = len(metrics(state))
    finish(start_learner(syncer.url, "l0", state, 5, log_path=log), log)
    text = log.read_text()
    found = re.search(r"resending the unsent work of the previous start: (\d+) of (\d+) fragment\(s\)", text)
    assert found and int(found.group(1)) >= 1, text[-3000:]
    second = metrics(state)[lines:][-1]
    assert second["rejected"] == 0 and second["acked"] == second["sent"]
    # 5 steps of its own cover at most 4 fragments x 5 steps: the rest is the first start's work, merged.
    assert second["acked_steps"] > 4 * 5
    wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge the resent work")
    # Exactly once: what the syncer merged since the restart is what the second start booked as acknowledged.
    assert syncer.status()["learners"]["l0"]["steps_merged"] - before == second["acked_steps"]
