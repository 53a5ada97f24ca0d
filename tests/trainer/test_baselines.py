"""Baseline smoke tests: 2 real gloo processes on loopback, a few steps of the tiny model each."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_trainer.protocol.runfiles import read_events, starts_by_name
from diloco_trainer.runtime.procs import child_env
from diloco_trainer.runtime.rundir import read_jsonl, split_incarnations

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _command(mode: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "diloco_trainer.cli", "baseline", mode, "--config", str(ROOT / "configs/tiny.yaml"),
            "--learners", "2", "--run-dir", str(run_dir), "--plain", "--log-every", "2", "--snapshots", "1",
            "--eval-batches", "4", *extra]


def _baseline(mode: str, run_dir: Path, *extra: str) -> dict:
    out = subprocess.run(_command(mode, run_dir, *extra), env=child_env(), capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _kill_worker_after(mode: str, run_dir: Path, victim: str, step: int, committed: int | None, *extra: str):
    """Run a baseline and SIGKILL one worker once it logged `step` (and, if given, step `committed` is the
    committed checkpoint). Returns the finished process (output captured)."""
    proc = subprocess.Popen(_command(mode, run_dir, *extra), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            recs = read_jsonl(run_dir / "learners" / victim / "metrics.jsonl")
            ckpt = run_dir / "checkpoint.json"
            ready = committed is None or (ckpt.exists() and json.loads(ckpt.read_text())["step"] >= committed)
            if recs and recs[-1]["step"] >= step and ready:
                procs = json.loads((run_dir / "processes.json").read_text())["processes"]
                os.kill(next(p["pid"] for p in procs if p["name"] == victim and p["role"] == "learner"), signal.SIGKILL)
                break
            assert proc.poll() is None, "the run ended before the kill"
            time.sleep(0.05)
        else:
            raise AssertionError("the victim never reached the kill step")
        out, _ = proc.communicate(timeout=100)
    finally:
        proc.kill()
    return proc.returncode, out


def _incarnations(run_dir: Path, name: str) -> list[list[dict]]:
    """A worker's metrics lines, one list per process incarnation (the supervisor's start events)."""
    starts = starts_by_name(read_events(run_dir))[name]
    return split_incarnations(read_jsonl(run_dir / "learners" / name / "metrics.jsonl"), starts)


def _assert_resumed_from_the_checkpoint(run_dir: Path, summary: dict, steps: int, every: int) -> int:
    """One whole-job restart from a committed multiple of `every`; totals count the work done twice.
    Returns the checkpoint step."""
    (restart,) = [e for e in read_events(run_dir) if e.event == "job_restart"]
    resume = restart.checkpoint_step
    assert restart.failed == "learner-1" and restart.code == -signal.SIGKILL
    assert resume > 0 and resume % every == 0
    assert summary["restarts"] == 1 and summary["lost_steps"] == restart.lost_steps > 0
    lost = 0
    for name in ("learner-0", "learner-1"):
        first, second = _incarnations(run_dir, name)
        lost += first[-1]["step"] - resume
        # The resumed incarnation continues from the checkpoint step (its first line is the next logged step).
        assert all(r["resumed_from_step"] == resume for r in second)
        assert second[0]["step"] == resume + 2 and second[-1]["step"] == steps
        assert [r["step"] for r in second] == sorted({r["step"] for r in second})
    assert lost == summary["lost_steps"]
    # Re-done work counts as trained; the useful part is what the final model holds.
    assert summary["steps_trained"] == 2 * steps + summary["lost_steps"]
    assert summary["tokens_trained"] == summary["steps_trained"] * 8 * 64  # tiny.yaml: batch 8 × seq_len 64
    assert summary["merged_fraction"] == pytest.approx(2 * steps / summary["steps_trained"])
    assert 0 < summary["goodput"] < summary["merged_fraction"]  # start-up and restarts are allocated, not useful
    assert len({v["param_sha256"] for v in summary["per_learner"].values()}) == 1, "replicas diverged"
    assert all(math.isfinite(v["final_loss"]) for v in summary["per_learner"].values())
    assert summary["val_loss"] is not None and math.isfinite(summary["val_loss"])
    files = [e["file"] for e in read_jsonl(run_dir / "snapshots" / "index.jsonl")]
    assert len(files) == len(set(files)) == 2  # Θ₀ and one snapshot, none taken twice
    return resume


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[Path, dict]:
    """One finished 24-step DDP baseline (run directory, summary), read by the tests below: each process start
    costs seconds of CPU, and what they check of a run does not depend on which one it is."""
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    return run_dir, _baseline("ddp", run_dir, "--steps", "24")


def test_ddp_replicas_stay_identical_and_the_loss_decreases(ddp_run):
    run_dir, summary = ddp_run
    digests = {v["param_sha256"] for v in summary["per_learner"].values()}
    assert len(digests) == 1, "DDP replicas diverged"
    for name in ("learner-0", "learner-1"):
        losses = [r["loss"] for r in read_jsonl(run_dir / "learners" / name / "metrics.jsonl")]
        assert len(losses) >= 10 and losses[-1] < losses[0] - 0.5
    evals = summary["global_evals"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0  # vs Θ₀ (≈ ln 256)
    assert summary["steps_trained"] == 48 and summary["merged_fraction"] == 1.0
    # DDP sends what its own formula says, every step.
    assert summary["bytes"]["sent_per_learner_step"] == pytest.approx(summary["bytes"]["ddp_per_learner_step"])
    assert (run_dir / "plot.png").stat().st_size > 10_000


def test_chaos_goodput_of_a_baseline_run_is_the_goodput_its_summary_reports(ddp_run):
    run_dir, summary = ddp_run
    out = subprocess.run([sys.executable, "-m", "diloco_trainer.cli", "chaos", "goodput", str(run_dir),
                          "--json"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    g = json.loads(out.stdout)
    assert g["goodput"] == pytest.approx(summary["goodput"]) and g["merged_fraction"] == 1.0
    assert {n: v["steps"] for n, v in g["learners"].items()} == {"learner-0": 24, "learner-1": 24}


def test_sync_diloco_workers_share_theta_after_each_outer_step_and_wait_for_the_slowest(tmp_path):
    summary = _baseline("sync-diloco", tmp_path / "run", "--steps", "24", "--slowdown", "1,4")
    assert len({v["param_sha256"] for v in summary["per_learner"].values()}) == 1
    recs = {n: read_jsonl(tmp_path / "run" / "learners" / n / "metrics.jsonl") for n in ("learner-0", "learner-1")}
    # tiny.yaml: H = 4, so 24 steps are 6 outer steps for everyone.
    assert all(r[-1]["versions"] == {"all": 6} for r in recs.values())
    # The fast worker is held back by the slow one: both finish at (nearly) the same moment.
    assert abs(recs["learner-0"][-1]["time"] - recs["learner-1"][-1]["time"]) < 1.0
    losses = [r["loss"] for r in recs["learner-0"]]
    assert losses[-1] < losses[0] - 0.5
    assert summary["bytes"]["sent_per_learner_step"] == pytest.approx(summary["bytes"]["ddp_per_learner_step"] / 4)


def test_baseline_rejects_a_slowdown_list_of_the_wrong_length(tmp_path):
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "baseline", "ddp", "--config", str(ROOT / "configs/tiny.yaml"),
           "--learners", "2", "--slowdown", "1,1,1", "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--slowdown has 3 factors for 2 learners" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(180)  # the workers start twice (~20 s each at load 8 on 2 cores)
def test_ddp_restarts_every_worker_from_the_last_checkpoint_when_one_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _kill_worker_after("ddp", run_dir, "learner-1", 12, 10, "--steps", "30", "--slowdown", "2",
                                   "--max-restarts", "2", "--checkpoint-every", "10")
    assert code == 0, out[-3000:]
    assert "worker learner-1 failed (exit -9): restarting all 2 workers from the checkpoint at step" in out
    _assert_resumed_from_the_checkpoint(run_dir, json.loads((run_dir / "summary.json").read_text()), 30, 10)


@pytest.mark.timeout(180)  # the workers start twice (~20 s each at load 8 on 2 cores)
def test_sync_diloco_resumes_after_an_outer_step_when_a_worker_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _kill_worker_after("sync-diloco", run_dir, "learner-1", 10, 8, "--steps", "24", "--slowdown", "2",
                                   "--max-restarts", "1", "--checkpoint-every", "8")
    assert code == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    _assert_resumed_from_the_checkpoint(run_dir, summary, 24, 8)  # tiny.yaml: H = 4, checkpoints every 2 H
    for name in ("learner-0", "learner-1"):  # the restored counters: 24 / H outer steps in the final model
        assert read_jsonl(run_dir / "learners" / name / "metrics.jsonl")[-1]["versions"] == {"all": 6}


def test_without_max_restarts_a_synchronous_job_stops_at_the_first_failure(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _kill_worker_after("ddp", run_dir, "learner-1", 6, None, "--steps", "200", "--slowdown", "2")
    assert code != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "a worker failed; a synchronous job cannot continue without it"
    assert summary["restarts"] == 0 and summary["val_loss"] is None
    assert not (run_dir / "checkpoint.json").exists()  # no restarts: no checkpoints to pay for


def test_sync_diloco_rejects_a_checkpoint_period_that_is_not_a_multiple_of_h(tmp_path):
    out = subprocess.run(_command("sync-diloco", tmp_path / "run", "--max-restarts", "1", "--checkpoint-every", "6"),
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--checkpoint-every 6 is not a multiple of the outer period H = 4" in out.stderr
    assert not (tmp_path / "run").exists()
