"""`diloco pod-learner`, a learner pod's entrypoint (runtime/podsup.py), run as a real process against a real syncer:
a SIGKILLed learner process is restarted in place from a warm spare, and SIGTERM still drains it and exits 0."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from learner_kit import ROOT, SyncerProcess, child_env, free_port, metrics, write_config
from polling import alive, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DRAIN_S = 10.0
KILLS = 3


def start_pod_learner(work: Path, url: str, state: Path, log_path: Path, *sup_args: str,
                      learner_args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "pod-learner", "--work-dir", str(work), *sup_args, "--",
           "--syncer", url, "--learner-id", "l0", "--state-dir", str(state), "--device", "cpu", "--log-every", "1",
           "--poll-s", "0.1", "--drain-s", str(DRAIN_S), *learner_args]
    state.mkdir(parents=True, exist_ok=True)
    env = child_env()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # as in a pod: torch picks its threads (more than one here)
        env.pop(var)
    return subprocess.Popen(cmd, env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, cwd=ROOT)


def learner_pid(work: Path) -> int | None:
    try:
        (entry,) = json.loads((work / "processes.json").read_text())["processes"]
    except (OSError, ValueError):
        return None
    return entry["pid"] if entry["alive"] else None


def spare_ready(work: Path) -> bool:
    return any((d / "ready").exists() and alive(int((d / "ready").read_text()))
               for d in (work / "spares").glob("spare-*"))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_a_sigkilled_learner_trains_again_in_place_from_a_warm_spare_and_sigterm_still_drains_it(tmp_path):
    syncer = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log")
    work, state, log = tmp_path / "sup", tmp_path / "l0", tmp_path / "pod.log"
    port = free_port()
    try:
        syncer.start()
        pod = start_pod_learner(work, syncer.url, state, log, learner_args=("--metrics-port", str(port)))
        try:
            recovery_s = []
            for kill in range(KILLS):
                # Past a first send of every fragment (4 fragments staggered over H=8), with a warm spare waiting.
                wait_for(lambda: pod.poll() is None and spare_ready(work)
                         and (metrics(state) or [{}])[-1].get("step", 0) >= 10, 240,
                         f"10 steps trained and a spare ready before kill {kill + 1}", 0.05)
                victim = learner_pid(work)
                acknowledged = syncer.status()["learners"]["l0"]["steps_merged"]
                killed = time.time()
                os.kill(victim, signal.SIGKILL)
                first = wait_for(lambda: next((r for r in metrics(state) if r["time"] > killed and r["step"] <= 3),
                                              None), 120, f"a step of the learner restarted after kill {kill + 1}",
                                 0.02)
                recovery_s.append(first["time"] - killed)
                assert learner_pid(work) not in (None, victim)
                # Nothing the syncer acknowledged is lost: this learner's merged work only grows.
                assert syncer.status()["learners"]["l0"]["steps_merged"] >= acknowledged
            print(f"\nkill -> next step of the restarted learner: {', '.join(f'{s:.2f}' for s in recovery_s)} s "
                  f"(median {statistics.median(recovery_s):.2f} s)")
            text = log.read_text()
            assert text.count("restarted in place") == KILLS and "warm spare" in text, text[-3000:]
            assert pod.poll() is None, "the supervisor itself never exits on a kill under its limit"
            events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
            assert [e.get("spare", False) for e in events if e["event"] == "start"] == [False] + [True] * KILLS
            assert f'diloco_learner_process_restarts_total{{learner_id="l0"}} {float(KILLS)}' in \
                wait_for(lambda: _try_scrape(port), 60, "the restarted learner's /metrics")

            # SIGTERM (preemption): the learner hands its unsent work over and exits 0, and so does the pod.
            wait_for(lambda: (metrics(state) or [{}])[-1].get("step", 0) >= 12, 120, "the last life trains on")
            signalled = time.monotonic()
            pod.send_signal(signal.SIGTERM)
            assert pod.wait(timeout=DRAIN_S + 30) == 0, log.read_text()[-3000:]
            assert time.monotonic() - signalled < DRAIN_S + 5
        finally:
            if pod.poll() is None:
                pod.kill()
                pod.wait()
        final = metrics(state)[-1]
        assert final["final"], final
        text = log.read_text()
        assert "received SIGTERM" in text and "handed over in" in text and "exiting 0" in text, text[-3000:]
        wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge everything pending")
        mine = syncer.status()["learners"]["l0"]
        lives = mine["incarnations"]
        assert len(lives) == KILLS + 1
        # The drained last life lost nothing: every fragment of every step it trained is merged.
        assert lives[-1]["steps_merged"] == 4 * lives[-1]["steps"] - lives[-1]["steps_discarded"], lives[-1]
        assert mine["steps_merged"] == sum(life["steps_merged"] for life in lives)
        assert not [p for p in (learner_pid(work),) if p], "no learner left behind"
    finally:
        syncer.stop()


def _try_scrape(port: int) -> str | None:
    try:
        return scrape(port)
    except OSError:
        return None


def test_a_learner_killed_past_the_restart_limit_fails_the_pod_with_its_code(tmp_path):
    # No syncer listens on port 9: the learner waits for it (bootstrap retries) until killed.
    work, state, log = tmp_path / "sup", tmp_path / "l0", tmp_path / "pod.log"
    pod = start_pod_learner(work, "http://127.0.0.1:9", state, log, "--max-restarts", "1", "--spares", "0")
    try:
        first = wait_for(lambda: learner_pid(work), 60, "the learner")
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: learner_pid(work) not in (None, first) and learner_pid(work), 120,
                          "the learner restarted in place")
        os.kill(second, signal.SIGKILL)
        assert pod.wait(timeout=60) == 128 + signal.SIGKILL, log.read_text()[-3000:]
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
    text = log.read_text()
    assert "restarts within 600 s already (--max-restarts 1)" in text, text[-3000:]


def test_a_spare_pod_waits_warm_and_becomes_the_learner_its_sealed_assignment_names(tmp_path):
    """A spare pod's entrypoint (`--assignment-file`, what the operator's spares run): warm and idle until the
    downward-API file holds an assignment; one sealed for another pod's name is refused with exit 2 and no learner
    started; the right one becomes learner `l1` of shard 1 with the unit's own token (the
    syncer books it as l1), trains, and SIGTERM still drains it and exits 0."""
    from diloco_trainer.protocol.assignment import Assignment, encode_key, seal, spare_key
    from diloco_trainer.protocol.tokens import learner_token
    from learner_kit import TOKEN

    syncer = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log")
    key = spare_key(TOKEN, "job")
    (tmp_path / "key").write_text(encode_key(key))
    assignment = Assignment("l1", 1, 2, learner_token(TOKEN, "l1", 3))

    def spare(name: str, pod: str) -> tuple[subprocess.Popen, Path, Path]:
        work, state, log, file = (tmp_path / f"{name}-sup", tmp_path / f"{name}-state", tmp_path / f"{name}.log",
                                  tmp_path / f"{name}-assignment")
        file.write_text("")  # the downward-API file of a pod without the annotation: empty
        state.mkdir(parents=True, exist_ok=True)
        env = child_env(DILOCO_POD_NAME=pod)
        env.pop("DILOCO_TOKEN")  # a spare pod holds no token until its assignment
        cmd = [sys.executable, "-m", "diloco_trainer.cli", "pod-learner", "--work-dir", str(work),
               "--assignment-file", str(file), "--spare-key-file", str(tmp_path / "key"), "--",
               "--syncer", syncer.url, "--state-dir", str(state), "--device", "cpu", "--log-every", "1",
               "--poll-s", "0.1", "--drain-s", str(DRAIN_S)]
        return subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT), file, state

    try:
        syncer.start()
        wrong, wrong_file, _ = spare("wrong", "spare-b")
        wait_for(lambda: "waiting for an assignment" in (tmp_path / "wrong.log").read_text(), 120, "spare waiting")
        wrong_file.write_text(seal(key, "spare-a", assignment))  # sealed for another pod
        assert wrong.wait(60) == 2
        assert "does not open" in (tmp_path / "wrong.log").read_text()

        pod, file, state = spare("right", "spare-a")
        wait_for(lambda: spare_ready(tmp_path / "right-sup"), 240, "the spare pod's warm process ready", 0.1)
        time.sleep(1.0)
        assert pod.poll() is None and not metrics(state), "a spare trains nothing before its assignment"
        assigned = time.time()
        file.write_text(seal(key, "spare-a", assignment))
        first = wait_for(lambda: next((r for r in metrics(state) if r["step"] >= 1), None), 120,
                         "the assigned learner's first step", 0.02)
        print(f"\nassignment -> first step {first['time'] - assigned:.2f} s", file=sys.stderr)
        wait_for(lambda: (syncer.status()["learners"].get("l1") or {}).get("steps_merged", 0) > 0, 180,
                 "the syncer merging learner l1's work")
        log = (tmp_path / "right.log").read_text()
        assert "assigned learner l1 (unit 1 of 2)" in log
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(DRAIN_S + 30) == 0
    finally:
        syncer.stop()
