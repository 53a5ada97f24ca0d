"""Helpers for the learner tests: a real `diloco syncer` process, `diloco learner` processes, metrics readers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

from polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token"
DATA_CACHE = Path(tempfile.gettempdir()) / "diloco-test-data-cache"  # keyed by content: safe to share


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "trainer"), env.get("PYTHONPATH", "")) if p)
    env.update(DILOCO_TOKEN=TOKEN, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               DILOCO_DATA_CACHE=str(DATA_CACHE))
    env.update(extra)
    return env


def write_config(path: Path, **outer) -> Path:
    """A tiny run: ~0.1M parameters, 200 kB of stdlib source, 4 fragments every 8 steps."""
    cfg = {"model": "tiny", "data": {"max_bytes": 200_000},
           "inner": {"batch_size": 8, "warmup_steps": 5},
           "outer": {"fragments": 4, "sync_every": 8, "compression": "int4", **outer}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SyncerProcess:
    """`diloco syncer` on loopback; restartable on the same port and state directory."""

    def __init__(self, config: Path, state_dir: Path, log_path: Path, port: int = 0, args: tuple[str, ...] = ()):
        self.config, self.state_dir, self.log_path, self.port = config, state_dir, log_path, port
        self.args = tuple(args)  # more `diloco syncer` flags
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        scheme = "https" if "--tls-cert" in self.args else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> "SyncerProcess":
        endpoint = self.state_dir / "endpoint.json"
        endpoint.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(self.config),
               "--host", "127.0.0.1", "--port", str(self.port), "--state-dir", str(self.state_dir),
               "--heartbeat-s", "0.5", "--checkpoint-every-s", "1", "--log-every-s", "0", *self.args]
        self.proc = subprocess.Popen(cmd, env=child_env(), stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, cwd=ROOT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> "SyncerProcess":
        """Wait for the started process to serve (its endpoint.json); takes the port from it."""
        doc = wait_for(lambda: self._endpoint(self.state_dir / "endpoint.json"), 120, "the syncer's endpoint.json")
        self.port = int(doc["port"])
        return self

    def _endpoint(self, path: Path):
        assert self.proc.poll() is None, f"syncer exited early:\n{self.log_path.read_text()[-3000:]}"
        return json.loads(path.read_text()) if path.exists() else None

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def status(self) -> dict:
        return self.get("/v1/status")

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_all(syncers: list[SyncerProcess]) -> None:
    """Start syncer processes (shards, each on its own fixed port) side by side, then wait until every one serves:
    their imports overlap instead of queueing one behind the other."""
    for s in syncers:
        s.start(wait=False)
    for s in syncers:
        s.wait_ready()


def start_learner(url: str, learner_id: str, state_dir: Path, steps: int, *args: str, env: dict | None = None,
                  log_path: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "learner", "--syncer", url, "--learner-id", learner_id,
           "--state-dir", str(state_dir), "--steps", str(steps), "--device", "cpu", "--log-every", "5",
           "--poll-s", "0.1", *args]
    log_path = log_path or state_dir.parent / f"{learner_id}.log"
    state_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, env=env or child_env(), stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            cwd=ROOT)


def metrics(state_dir: Path) -> list[dict]:
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step(state_dir: Path) -> int:
    recs = metrics(state_dir)
    return recs[-1]["step"] if recs else 0


def finish(proc: subprocess.Popen, log_path: Path, timeout: float = 180) -> None:
    """Wait for a learner to exit and assert it exited 0 (its log in the message otherwise)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"learner did not finish in {timeout} s:\n{log_path.read_text()[-3000:]}")
    assert code == 0, f"learner exited {code}:\n{log_path.read_text()[-3000:]}"
