"""Warm spares: learner processes started ahead of need, that have imported torch and wait for an identity.

A learner restarted from scratch spends most of its recovery starting Python and importing torch (measured: ~6 s of
the ~12 s from kill to training again on a busy 2-core machine). A spare has done that already: when a learner dies,
the supervisor hands the spare that learner's command line (`assignment.json` in the spare's directory) and the
spare becomes the learner — same PID for the rest of its life, output appended to the learner's log, state
directory and data position taken over — while a new spare starts in the background.

The spare side is `diloco learner --standby DIR` (`wait_for_assignment` below); the supervisor side is `SparePool`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..fsutil import atomic_write_json

READY = "ready"
ASSIGNMENT = "assignment.json"
POLL_S = 0.02


# ---------------------------------------------------------------------- spare side


def wait_for_assignment(directory: Path, warm_up) -> tuple[list[str], str]:
    """Run `warm_up()` (the heavy imports), say ready, then wait for the supervisor's assignment.

    Returns (the learner's argv after `learner`, its log path). Exits when the supervisor goes away first.
    """
    parent = os.getppid()
    warm_up()
    (directory / READY).write_text(str(os.getpid()))
    path = directory / ASSIGNMENT
    while not path.exists():
        if os.getppid() != parent:
            raise SystemExit(0)  # the supervisor is gone: nobody will ever assign this spare
        time.sleep(POLL_S)
    doc = json.loads(path.read_text())
    return list(doc["args"]), str(doc["log"])


def redirect_output(log_path: str) -> None:
    """From now on stdout and stderr append to the learner's own log (the spare was started with its own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# ---------------------------------------------------------------------- supervisor side


class SparePool:
    """Keeps `size` warm spares of `diloco learner` running for one run; `take` turns one into a given learner.

    `spawn(argv, env, log_path)` starts a process the way the supervisor starts its children (guarded, own session) and
    returns its Popen. Only children whose argv is `prefix + [...]` and whose environment equals `env` can take a
    spare: a spare was started with exactly that interpreter and environment.
    """

    def __init__(self, root: Path, size: int, prefix: list[str], env: dict[str, str], spawn):
        self.root, self.size, self.prefix, self.env, self.spawn = root, size, list(prefix), dict(env), spawn
        self.spares: list[tuple[Path, subprocess.Popen]] = []
        self.started = 0
        self.taken = 0

    def refill(self) -> None:
        """Start spares until `size` are alive (dead ones are dropped)."""
        self.spares = [(d, p) for d, p in self.spares if p.poll() is None]
        while len(self.spares) < self.size:
            self.started += 1
            directory = self.root / f"spare-{self.started}"
            directory.mkdir(parents=True, exist_ok=True)
            proc = self.spawn([*self.prefix, "--standby", str(directory)], self.env,
                              self.root / f"spare-{self.started}.log")
            self.spares.append((directory, proc))

    def ready(self) -> int:
        return sum(1 for d, p in self.spares if p.poll() is None and (d / READY).exists())

    def fits(self, argv: list[str], env: dict[str, str]) -> bool:
        return argv[: len(self.prefix)] == self.prefix and env == self.env

    def take(self, argv: list[str], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, Path] | None:
        """A ready spare now running `argv` (its output appended to `log_path`) and its directory (its command line
        says `--standby DIR` for the rest of its life), or None if none is ready."""
        if not self.fits(argv, env):
            return None
        for i, (directory, proc) in enumerate(self.spares):
            if proc.poll() is None and (directory / READY).exists():
                del self.spares[i]
                atomic_write_json(directory / ASSIGNMENT, {"args": argv[len(self.prefix):], "log": str(log_path)})
                self.taken += 1
                self.refill()
                return proc, directory
        return None

    def close(self) -> None:
        """Stop every spare still waiting (they hold no state)."""
        for _, proc in self.spares:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session (as every supervised child)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for _, proc in self.spares:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.spares = []
