"""A warm standby syncer for the local runtime: `diloco syncer ... --standby`, started ahead with the same command line.

It imports and warms up, then blocks on the state directory's lock (syncer/takeover.py). When the serving syncer dies,
the kernel releases the lock and the standby serves within a fraction of a second, with no help from the supervisor:
the supervisor only learns of it afterwards (`take`, when it would restart the syncer). The standby that took over
forks its own successor (a fork instead of a Python start and torch import, which took 17-30 s of wall time on a
2-core machine busy with learners: longer than the 15 s between two kills); the supervisor adopts it from
STATE_DIR/standby.json, or starts a standby from scratch if none appears.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from diloco_trainer.syncer.takeover import SUCCESSOR, StateLock
from diloco_trainer.runtime.zygote import Adopted, become_subreaper

RESPAWN_AFTER_S = 2.0  # after a takeover: how long to wait for the forked successor before starting one from scratch


class SyncerStandby:
    """Keeps one `argv + --standby` process waiting; `spawn(argv, env, log_path)` starts it as a supervised child."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, spawn, state_dir: Path,
                 respawn_after_s: float = RESPAWN_AFTER_S, fork: bool = True, hold_file: Path | None = None):
        self.argv, self.env, self.log_path, self.spawn = list(argv), dict(env), log_path, spawn
        # A chaos downtime's restart hold (the supervisor's hold file for the syncer): the standby waits it out.
        self.standby_args = ["--standby"] + (["--hold-file", str(hold_file)] if hold_file is not None else [])
        self.state_dir, self.respawn_after_s = state_dir, respawn_after_s
        self.fork = fork and become_subreaper()  # a forked successor must be re-parented to this process
        self.proc: subprocess.Popen | Adopted | None = None
        self.due = 0.0  # monotonic time a standby is started from scratch if none was forked
        self.known: set[int] = set()  # PIDs of standbys this pool has had (standby.json may name an old one)
        self.started = 0  # standbys started from scratch
        self.adopted = 0  # forked successors adopted
        self.taken = 0

    def refill(self) -> None:
        """Adopt the successor a takeover forked; else, once the wait for it is over, start a standby from scratch."""
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None  # died waiting (killed by hand): replaced
        if self.proc is None and self.fork:
            self.proc = self._successor()
        if self.proc is None and time.monotonic() >= self.due:
            self.started += 1
            extra = [] if self.fork else ["--no-fork-successor"]
            self.proc = self.spawn([*self.argv, *self.standby_args, *extra], self.env, self.log_path)
            self.known.add(self.proc.pid)

    def _successor(self) -> Adopted | None:
        try:
            pid = int(json.loads((self.state_dir / SUCCESSOR).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if pid in self.known:
            return None
        proc = Adopted(pid, [*self.argv, "--standby"])
        if proc.poll() is not None:  # not a child of this process (or gone): nothing to adopt
            return None
        self.known.add(pid)
        self.adopted += 1
        return proc

    def take(self, argv: list[str]) -> subprocess.Popen | Adopted | None:
        """The standby process, now the syncer (it takes over by itself as soon as the lock is free), or None if no
        standby of this command line is alive. Its successor is adopted by the next `refill`s."""
        if argv != self.argv or self.proc is None or self.proc.poll() is not None:
            return None
        proc, self.proc = self.proc, None
        self.taken += 1
        self.due = time.monotonic() + self.respawn_after_s
        return proc

    def close(self) -> None:
        """Stop the waiting standby (before the syncer is stopped: it would take over from a clean stop too), and a
        successor forked so recently that it was not adopted yet."""
        self.due = float("inf")
        if self.proc is None and self.fork:
            self.proc = self._successor()
        proc, self.proc = self.proc, None
        stray = self._unadopted_successor()
        if stray is not None:
            _kill_group(stray)
        if proc is None or proc.poll() is not None:
            return
        _kill_group(proc.pid)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _unadopted_successor(self) -> int | None:
        """The PID in standby.json if it is a waiting standby of this state directory this pool never had (not the
        serving syncer, which holds the lock; not a reused PID: its command line is checked)."""
        try:
            pid = int(json.loads((self.state_dir / SUCCESSOR).read_text())["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if pid in self.known or pid == StateLock(self.state_dir).holder():
            return None
        ours = b"--standby" in cmdline and str(self.state_dir).encode() in cmdline
        return pid if ours else None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # its own session, as every supervised child; a standby holds no state
    except (ProcessLookupError, PermissionError):
        pass
