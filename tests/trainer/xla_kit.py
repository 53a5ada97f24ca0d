"""The XLA environment for the tests: hack/xla-env.sh run by the tests themselves (torch + torch_xla from
requirements-xla.lock, installed once into ~/.cache/diloco and reused), and learners started in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from learner_kit import ROOT, child_env

XLA_ENV_SCRIPT = ROOT / "hack" / "xla-env.sh"


def build_xla_env() -> Path:
    """The .venv-xla directory (installs the cached environment on first use). A failure FAILS the run (never
    skips): CI must exercise the XLA path."""
    out = subprocess.run(["bash", str(XLA_ENV_SCRIPT)], cwd=ROOT, stdout=subprocess.PIPE, stderr=sys.stderr,
                         text=True)
    if out.returncode != 0:
        pytest.fail(f"hack/xla-env.sh failed (exit {out.returncode}); see its output above")
    return Path(out.stdout.strip().splitlines()[-1])


def xla_learner_cmd(env_dir: Path, url: str, learner_id: str, state_dir: Path, steps: int, device: str,
                    *args: str) -> list[str]:
    """`diloco learner` in the XLA environment (its own Python, torch and torch_xla)."""
    return [str(env_dir / "bin" / "python"), "-m", "diloco_trainer.cli", "learner", "--syncer", url,
            "--learner-id", learner_id, "--state-dir", str(state_dir), "--steps", str(steps), "--device", device,
            "--poll-s", "0.1", *args]


def start_xla_learner(env_dir: Path, url: str, learner_id: str, state_dir: Path, steps: int, *args: str,
                      device: str = "xla") -> tuple[subprocess.Popen, Path]:
    """A learner process in the XLA environment on torch_xla's CPU device (PJRT_DEVICE=CPU); returns it and its
    log path."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir.parent / f"{learner_id}.log"
    env = child_env(PJRT_DEVICE="CPU")
    env.pop("PYTHONPATH", None)  # the XLA environment has this checkout's trainer on its path already
    proc = subprocess.Popen(xla_learner_cmd(env_dir, url, learner_id, state_dir, steps, device, *args), env=env,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, log_path


def run_in_xla_env(env_dir: Path, code: str) -> str:
    """Run Python `code` in the XLA environment; its stdout (fails with stderr on a non-zero exit)."""
    env = child_env(PJRT_DEVICE="CPU")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
