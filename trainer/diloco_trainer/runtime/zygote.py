"""Warm spares forked from one warm process (a "zygote", as Android's): importing torch and a first AdamW step are
paid once per run, not once per kill.

Measured (issue 11, 2 cores at load ~6): a spare started from scratch burned ~3 s of CPU to warm up, on cores the
learners train on, and the pool starts one after every kill. A spare forked from the zygote shares its memory
copy-on-write and is ready in milliseconds.

The zygote is `diloco learner --zygote DIR`, a child of the supervisor: it warms up, then forks a spare for every
`DIR/fork-*.json` request. Each spare forks once more and lets the middle process exit, so the kernel re-parents it
to the supervisor (a child subreaper, `become_subreaper`); the supervisor then waits for it like any child of its
own (`Adopted`), and it dies with the supervisor (PR_SET_PDEATHSIG), as every supervised child does.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco_trainer.fsutil import atomic_write, atomic_write_json

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
READY = "ready"
WARM = "warm.json"
POLL_S = 0.02
REPARENT_TIMEOUT_S = 5.0


def redirect_output(log_path: str) -> None:
    """From now on stdout and stderr append to the learner's own log (the spare was started with its own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); False where that is not possible."""
    return sys.platform.startswith("linux") and _prctl(PR_SET_CHILD_SUBREAPER, 1)


def request(directory: Path, n: int, spare_dir: Path, log_path: Path) -> None:
    """Ask the zygote in `directory` for a spare that waits in `spare_dir`, its output in `log_path`."""
    atomic_write_json(directory / f"fork-{n:06d}.json", {"dir": str(spare_dir), "log": str(log_path)})


# ---------------------------------------------------------------------- zygote side


def serve(directory: Path, warm_up) -> Path:
    """Warm up once, then fork a spare for each request until the supervisor goes away.

    Returns only in a forked spare, re-parented to the supervisor, with its output redirected: the spare's directory.
    """
    supervisor = os.getppid()
    wall, cpu = time.monotonic(), time.process_time()
    warm_up()
    atomic_write_json(directory / WARM, {"pid": os.getpid(), "wall_s": time.monotonic() - wall,
                                         "cpu_s": time.process_time() - cpu, "ready_at": time.time()})
    atomic_write(directory / READY, str(os.getpid()).encode())
    while True:
        if os.getppid() != supervisor:
            raise SystemExit(0)
        for req in sorted(directory.glob("fork-*.json")):
            doc = json.loads(req.read_text())
            req.unlink()
            pid = os.fork()
            if pid == 0:
                return _become_spare(Path(doc["dir"]), doc["log"], supervisor)
            os.waitpid(pid, 0)  # the middle process exits at once
        time.sleep(POLL_S)


def _become_spare(directory: Path, log_path: str, supervisor: int) -> Path:
    if os.fork() != 0:
        os._exit(0)  # the middle process: its exit hands the spare to the supervisor
    os.setsid()  # its own session and process group, as every supervised child (signals go to the group)
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:  # not re-parented to the supervisor (no subreaper): nobody would reap it
            os._exit(1)
        time.sleep(0.001)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # the supervisor died in between
        os._exit(1)
    redirect_output(log_path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# ---------------------------------------------------------------------- supervisor side


class Adopted:
    """A Popen-like handle (`pid`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`) for a process
    this one did not start but was made the parent of (see `become_subreaper`)."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its exit code unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
