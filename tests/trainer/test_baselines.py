"""Baseline smoke tests: 2 real gloo processes on loopback, a few steps of the tiny model each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_trainer.runtime.procs import child_env
from diloco_trainer.runtime.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _baseline(mode: str, run_dir: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "baseline", mode, "--config", str(ROOT / "configs/tiny.yaml"),
           "--learners", "2", "--run-dir", str(run_dir), "--plain", "--log-every", "2", "--snapshots", "1",
           "--eval-batches", "4", *extra]
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_ddp_replicas_stay_identical_and_the_loss_decreases(tmp_path):
    summary = _baseline("ddp", tmp_path / "run", "--steps", "24")
    digests = {v["param_sha256"] for v in summary["per_learner"].values()}
    assert len(digests) == 1, "DDP replicas diverged"
    for name in ("learner-0", "learner-1"):
        losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "learners" / name / "metrics.jsonl")]
        assert len(losses) >= 10 and losses[-1] < losses[0] - 0.5
    evals = summary["global_evals"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0  # vs Θ₀ (≈ ln 256)
    assert summary["steps_trained"] == 48 and summary["goodput"] == 1.0
    # DDP sends what its own formula says, every step.
    assert summary["bytes"]["sent_per_learner_step"] == pytest.approx(summary["bytes"]["ddp_per_learner_step"])
    assert (tmp_path / "run" / "plot.png").stat().st_size > 10_000


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
