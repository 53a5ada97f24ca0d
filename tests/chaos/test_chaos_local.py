"""Chaos against a real `diloco local` run (tiny model, 3 learners): a schedule really kills, pauses and fails
learner processes, training goes on, and the record holds every fault and its recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_chaos.goodput import from_run_dir
from diloco_chaos.inject.experiment import parse_experiment
from diloco_chaos.inject.metrics import ChaosMetrics
from diloco_chaos.inject.record import Record
from diloco_chaos.inject.runner import run_experiment
from diloco_chaos.inject.targets.local import LocalTarget

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _exits(run: Path, since: float) -> list[dict]:
    return [e for e in _read(run / "events.jsonl") if e["event"] == "exit" and e["time"] >= since]


def _outer_steps(run: Path) -> int:
    return max((s.get("outer_steps", 0) for s in _read(run / "syncer.jsonl") if s.get("up")), default=0)


def _pids(run: Path) -> dict[str, int]:
    doc = json.loads((run / "processes.json").read_text())
    return {p["name"]: p["pid"] for p in doc["processes"]}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """`diloco local` with 3 learners training until stopped; yields its run directory once all trained."""
    run = tmp_path_factory.mktemp("chaos") / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("trainer", "operator", "chaos", "kube"))}
    log = open(run.parent / "local.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "local", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--learners", "3", "--steps", "1000000", "--minutes", "8", "--run-dir", str(run), "--plain",
         "--log-every", "1", "--restart-delay", "1", "--snapshots", "0", "--eval-batches", "2"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        steps = [max((r["step"] for r in _read(run / "learners" / f"learner-{i}" / "metrics.jsonl")), default=0)
                 for i in range(3)]
        if min(steps) > 0 and _outer_steps(run) > 0:
            break
        assert proc.poll() is None, (run.parent / "local.log").read_text()[-3000:]
        time.sleep(1)
    else:
        pytest.fail("the local run did not start training within 240 s")
    yield run, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


def _experiment(**spec):
    return parse_experiment({"name": "test", **spec})


def _run(exp, run: Path, record: Path, **kw) -> dict:
    return asyncio.run(run_experiment(exp, LocalTarget(run), Record(record), poll_s=0.2, **kw))


def test_a_dry_run_decides_and_records_but_kills_nothing(local_run, tmp_path):
    run, _ = local_run
    before, since = _pids(run), time.time()
    exp = _experiment(schedule={"every": "1s"}, safety={"minAliveUnits": 1, "maxFaults": 3, "maxDuration": "20s"},
                      dryRun=True)
    summary = _run(exp, run, tmp_path / "dry.jsonl")
    faults = [e for e in _read(tmp_path / "dry.jsonl") if e["event"] == "fault"]
    assert summary["faults"] == 3 and len(faults) == 3 and all(f["dry_run"] for f in faults)
    assert _exits(run, since) == [] and _pids(run) == before


def test_a_resumed_experiment_keeps_its_schedule_and_does_not_fire_missed_ticks(local_run, tmp_path):
    run, _ = local_run
    exp = _experiment(schedule={"every": "10s"}, safety={"minAliveUnits": 1, "maxDuration": "32s"}, dryRun=True)
    began = time.time()
    summary = _run(exp, run, tmp_path / "resume.jsonl", started_at=began - 25)
    entries = _read(tmp_path / "resume.jsonl")
    assert next(e for e in entries if e["event"] == "resumed")["missed_ticks"] == 2  # t+10 s and t+20 s
    (fault,) = [e for e in entries if e["event"] == "fault"]
    assert fault["scheduled_at"] == pytest.approx(began - 25 + 30, abs=0.01)
    assert summary["faults"] == 1 and time.time() - began < 20  # maxDuration counted from the first start


def test_a_schedule_really_kills_and_training_continues(local_run, tmp_path):
    run, proc = local_run
    since, outer_before = time.time(), _outer_steps(run)
    exp = _experiment(schedule={"every": "3s", "seed": 5}, target={"units": [0, 1]}, action={"type": "kill"},
                      safety={"minAliveUnits": 2, "maxConcurrent": 1, "maxFaults": 2, "maxDuration": "3m",
                              "recoveryTimeout": "150s"})
    metrics = ChaosMetrics()
    summary = _run(exp, run, tmp_path / "kill.jsonl", metrics=metrics)
    entries = _read(tmp_path / "kill.jsonl")
    faults = [e for e in entries if e["event"] == "fault"]
    recoveries = [e for e in entries if e["event"] == "recovery"]
    assert summary["faults"] == 2 and {f["unit"] for f in faults} <= {"learner-0", "learner-1"}
    # The supervisor saw each victim die of SIGKILL at the time of its fault, and restarted it.
    exits = _exits(run, since)
    for f in faults:
        assert any(e["name"] == f["unit"] and e["code"] == -signal.SIGKILL and abs(e["time"] - f["time"]) < 5
                   for e in exits), (f, exits)
        assert f["details"]["signal"] == "SIGKILL"
    # One victim down at a time, never fewer than 2 healthy units: the second fault waited for the recovery.
    assert faults[1]["time"] >= recoveries[0]["trained_again_at"] or faults[0]["unit"] != faults[1]["unit"]
    assert [r["fault"] for r in recoveries] == [1, 2] and all(r["recovered"] for r in recoveries)
    for r in recoveries:
        # Merged again may come first: a merge after the replacement started may carry its predecessor's work (resent
        # at its start, or acknowledged just before the kill) before its own first step (a fresh-clone run: trained
        # again 1.62 s, merged again 1.34 s).
        assert 0 < r["trained_again_s"] < 150 and 0 < r["merged_again_s"] < 150
        assert r["injected_at"] < r["replacement_started_at"] < r["merged_again_at"]
    exported = metrics.render().decode()  # a counter on every kill, the recovery times as a histogram
    assert 'diloco_chaos_faults_total{action="kill",dry_run="false",experiment="test",role="learner"} 2.0' in exported
    assert 'diloco_chaos_recovery_seconds_count{experiment="test",until="merged"} 2.0' in exported
    assert proc.poll() is None  # the run itself never stopped
    assert _outer_steps(run) > outer_before  # and the global model kept advancing


def test_a_pause_freezes_a_learner_and_it_trains_again_after(local_run, tmp_path):
    run, _ = local_run
    pid = _pids(run)["learner-2"]
    exp = _experiment(schedule={"every": "1s"}, target={"units": [2]}, action={"type": "pause", "duration": "4s"},
                      safety={"maxFaults": 1, "maxDuration": "1m", "recoveryTimeout": "60s"})
    states = []

    async def main():
        task = asyncio.create_task(run_experiment(exp, LocalTarget(run), Record(tmp_path / "pause.jsonl"),
                                                  poll_s=0.2))
        while not task.done():
            states.append(Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0])
            await asyncio.sleep(0.2)
        return await task

    summary = asyncio.run(main())
    assert "T" in states and states[-1] != "T"  # stopped during the pause, running after it
    assert _pids(run)["learner-2"] == pid  # a straggler, not a death
    rec = next(e for e in _read(tmp_path / "pause.jsonl") if e["event"] == "recovery")
    assert rec["recovered"] and rec["trained_again_s"] >= 4.0
    assert summary["faults"] == 1


def test_fail_with_an_exit_code_ends_the_process_with_that_code(local_run, tmp_path):
    run, _ = local_run
    with pytest.raises(ValueError, match="action.exitCode 1"):
        _run(_experiment(schedule={"every": "1s"}, action={"type": "fail", "exitCode": 1}), run, tmp_path / "x.jsonl")
    since = time.time()
    exp = _experiment(schedule={"every": "1s"}, target={"units": [2]}, action={"type": "fail", "exitCode": 138},
                      safety={"maxFaults": 1, "maxDuration": "1m", "recoveryTimeout": "150s"})
    summary = _run(exp, run, tmp_path / "fail.jsonl")
    assert summary["faults"] == 1 and summary["recovered"] == 1
    exit_codes = [e["code"] for e in _exits(run, since) if e["name"] == "learner-2"]
    assert exit_codes == [-signal.SIGUSR1]  # exit code 138 = 128 + SIGUSR1; Popen reports it as -10


def test_a_killed_victim_is_held_down_for_the_downtime(local_run, tmp_path):
    run, _ = local_run
    exp = _experiment(schedule={"every": "1s", "downtime": "8s"}, target={"units": [2]},
                      safety={"maxFaults": 1, "maxDuration": "1m", "recoveryTimeout": "150s"})
    _run(exp, run, tmp_path / "down.jsonl")
    entries = _read(tmp_path / "down.jsonl")
    fault = next(e for e in entries if e["event"] == "fault")
    released = next(e for e in entries if e["event"] == "released")
    rec = next(e for e in entries if e["event"] == "recovery")
    # The supervisor was asked, before the kill, not to restart the victim until the downtime ends (a warm spare
    # would otherwise take over within a second, before any outside SIGSTOP could catch it) ...
    assert fault["details"]["restart_held_until"] == fault["back_at"] > fault["time"] + 7.9
    victim_events = [e for e in _read(run / "events.jsonl") if e["name"] == "learner-2" and e["time"] >= fault["time"]]
    (held,) = [e for e in victim_events if e["event"] == "held"]
    assert held["until"] == fault["back_at"]
    restart = next(e for e in victim_events if e["event"] == "start")
    assert restart["time"] >= fault["back_at"]  # ... so the replacement started only once it had ended,
    assert released["time"] >= fault["back_at"] and not (run / "holds" / "learner-2.json").exists()  # hold lifted
    assert rec["recovered"] and rec["trained_again_s"] >= 8.0


def test_goodput_of_the_run_counts_the_lost_work(local_run):
    run, proc = local_run
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=180) == 0
    g = from_run_dir(run)
    assert (run / "summary.json").exists()
    assert sum(v["incarnations"] for v in g["learners"].values()) >= 3 + 4  # 2 kills, 1 fail, 1 downtime kill
    assert 0 < g["goodput"] < g["compute_fraction"] <= 1
    assert 0 < g["merged_fraction"] <= 1
    assert g["uptime"] > 0.5  # the global model kept advancing through single-learner faults
