"""What runs beside a benchmark's training run: `diloco chaos` against it, once its learners train."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from diloco_trainer.runtime import procs

from . import report


def training_started(run_dir: Path) -> bool:
    """True once some learner of the run wrote a metrics record."""
    return any(p.stat().st_size > 0 for p in (run_dir / "learners").glob("*/metrics.jsonl"))


class ChaosCompanion:
    """Runs `diloco chaos run EXPERIMENT --run-dir RUN` once the learners train; stops it when the run ends."""

    def __init__(self, exp_path: Path, record: Path, log: Path):
        self.exp_path, self.record, self.log = exp_path, record, log
        self.proc: subprocess.Popen | None = None

    def tick(self, run_dir: Path) -> None:
        if self.proc is None and (run_dir / "processes.json").exists() and training_started(run_dir):
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    procs.diloco_argv("chaos", "run", str(self.exp_path), "--run-dir", str(run_dir), "--plain",
                                      "--record", str(self.record)),
                    stdout=log, stderr=subprocess.STDOUT, env=procs.child_env(), cwd=report.REPO)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # stop injecting; it waits (bounded) for open recoveries
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # second Ctrl+C: quit now
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
