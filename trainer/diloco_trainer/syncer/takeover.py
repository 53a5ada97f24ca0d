"""One serving syncer per state directory, and a fast takeover when it dies.

A syncer serves only while it holds an exclusive flock on STATE_DIR/serve.lock. The kernel drops that lock the
moment its holder dies (kill -9 included), so a warm standby blocked on it (`diloco syncer --standby`: Python started,
torch and the syncer imported) wakes at once, loads the checkpoint and spool and binds the same port. Two syncers
never serve the same state directory: the second one waits, whatever started it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diloco_trainer.fsutil import read_jsonl

LOCK_FILE = "serve.lock"
INCARNATIONS = "incarnations.jsonl"
SUCCESSOR = "standby.json"  # {"pid": ...} of the standby a takeover forked, for the supervisor to adopt
REPARENT_TIMEOUT_S = 5.0


class StateLock:
    """The exclusive, kernel-released lock that says who serves a state directory."""

    def __init__(self, state_dir: Path):
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def holder(self) -> int | None:
        """The PID the current (or last) holder wrote into the lock file, if any."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; never blocks."""
        return self._lock(blocking=False)

    def acquire(self) -> float:
        """Block until this process holds the lock (a dead holder releases it at once); returns the seconds waited."""
        t0 = time.monotonic()
        self._lock(blocking=True)
        return time.monotonic() - t0

    def _lock(self, blocking: bool) -> bool:
        assert self._fd is None, "already held"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return True

    def forget(self) -> None:
        """Close this process's descriptor without unlocking: a forked child's copy (the parent keeps the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Incarnation:
    """How one syncer process came to serve (one line of STATE_DIR/incarnations.jsonl)."""

    pid: int
    standby: bool  # started ahead as a warm standby
    started_at: float  # unix time the process started
    warm_s: float  # imports and warm-up before waiting for the lock
    locked_at: float  # unix time it got the lock (the previous holder was gone)
    load_s: float  # checkpoint + spool (+ merge journal) load
    serving_at: float  # unix time it listened
    previous_pid: int | None = None

    @property
    def takeover_s(self) -> float:
        """From the lock's release (the previous holder's death, or this start) to serving."""
        return self.serving_at - self.locked_at

    def to_json(self) -> dict:
        return {**asdict(self), "takeover_s": round(self.takeover_s, 4)}


def record_incarnation(state_dir: Path, inc: Incarnation) -> None:
    """Append one line to STATE_DIR/incarnations.jsonl (diagnostics; not needed to resume)."""
    with open(state_dir / INCARNATIONS, "a") as f:
        f.write(json.dumps(inc.to_json()) + "\n")


def read_incarnations(state_dir: Path) -> list[dict]:
    """Every recorded incarnation, oldest first (a torn last line is skipped)."""
    return read_jsonl(state_dir / INCARNATIONS)


def fork_successor(state_dir: Path, lock: StateLock, supervisor: int) -> bool:
    """Fork the next warm standby from this one, which just took over: it costs a fork instead of a Python start and a
    torch import (seconds of CPU the learners need). False in this process; True in the successor, which then runs in
    its own session, re-parented to `supervisor` (a child subreaper, runtime/zygote.py), dies with it, and has written
    its PID to STATE_DIR/standby.json. Without a subreaper (the successor is not re-parented in time) it exits and the
    supervisor starts a standby of its own."""
    from diloco_trainer.fsutil import atomic_write_json
    from diloco_trainer.runtime.zygote import PR_SET_PDEATHSIG, _prctl

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        os.waitpid(pid, 0)  # the middle process exits at once
        return False
    lock.forget()
    if os.fork() != 0:
        os._exit(0)  # its exit hands the successor to the supervisor
    os.setsid()  # its own process group: a kill of the serving syncer's group must not reach it
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # the supervisor died in between
        os._exit(1)
    atomic_write_json(state_dir / SUCCESSOR, {"pid": os.getpid(), "forked_at": time.time()})
    return True


def wait_out_hold(path: Path, poll_s: float = 0.05) -> float:
    """Block while the restart hold at `path` (protocol.RestartHold, written by `diloco chaos` for a downtime) is in
    force: a standby that took over must not serve before the downtime ends. Returns the seconds waited; a missing,
    expired or unreadable hold does not hold anything (a broken outside tool must not keep the syncer down)."""
    from diloco_trainer.protocol.messages import RestartHold

    t0 = time.monotonic()
    while True:
        try:
            until = RestartHold.model_validate_json(path.read_bytes()).until
        except (OSError, ValueError):
            return time.monotonic() - t0
        left = until - time.time()
        if left <= 0:
            return time.monotonic() - t0
        time.sleep(min(poll_s, left))
