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
import time
from pathlib import Path

from diloco_trainer.fsutil import atomic_write, atomic_write_json
from diloco_trainer.runtime.zygote import Adopted, become_subreaper, request

READY = "ready"
WARM = "warm.json"
ASSIGNMENT = "assignment.json"
POLL_S = 0.02
ZYGOTE_RESPAWN_S = 10.0  # a zygote that keeps dying is started again at most this often


# ---------------------------------------------------------------------- spare side


def wait_for_assignment(directory: Path, warm_up) -> tuple[list[str], str]:
    """Run `warm_up()` (the heavy imports), say ready, then wait for the supervisor's assignment.

    Returns (the learner's argv after `learner`, its log path). Exits when the supervisor goes away first.
    """
    parent = os.getppid()
    wall, cpu = time.monotonic(), time.process_time()
    warm_up()
    # What the warm-up cost (the bench charges a spare's CPU to the kills that made the pool refill it).
    atomic_write_json(directory / WARM, {"pid": os.getpid(), "wall_s": time.monotonic() - wall,
                                         "cpu_s": time.process_time() - cpu, "ready_at": time.time()})
    atomic_write(directory / READY, str(os.getpid()).encode())
    path = directory / ASSIGNMENT
    while not path.exists():
        if os.getppid() != parent:
            raise SystemExit(0)  # the supervisor is gone: nobody will ever assign this spare
        time.sleep(POLL_S)
    doc = json.loads(path.read_text())
    return list(doc["args"]), str(doc["log"])


# ---------------------------------------------------------------------- supervisor side


class SparePool:
    """Keeps `size` warm spares of `diloco learner` for one run; `take` turns one into a given learner.

    `spawn(argv, env, log_path)` starts a process the way the supervisor starts its children (guarded, own session) and
    returns its Popen. Only children whose argv is `prefix + [...]` and whose environment equals `env` can take a
    spare: a spare was started with exactly that interpreter and environment.

    With `fork` (the default, where the kernel allows it) the spares are forked from one warm zygote
    (runtime/zygote.py): the pool's refills then cost no CPU to speak of. Otherwise each spare is a
    `diloco learner --standby DIR` of its own that imports and warms up by itself.
    """

    def __init__(self, root: Path, size: int, prefix: list[str], env: dict[str, str], spawn, fork: bool = True,
                 zygote_args: tuple[str, ...] = ()):
        self.root, self.size, self.prefix, self.env, self.spawn = root, size, list(prefix), dict(env), spawn
        self.zygote_args = list(zygote_args)  # e.g. --warm-config: warm up on the run's own model size
        self.spares: list[tuple[Path, subprocess.Popen | Adopted | None]] = []  # None: asked of the zygote
        self.started = 0
        self.taken = 0
        self.fork = fork and become_subreaper()
        self.zygote_dir = root / "zygote"
        self.zygote: subprocess.Popen | None = None
        self.zygote_started = -ZYGOTE_RESPAWN_S

    def refill(self) -> None:
        """Start (or ask the zygote for) spares until `size` are alive or coming; dead ones are dropped."""
        self._adopt()
        self.spares = [(d, p) for d, p in self.spares if p is None or p.poll() is None]
        if self.fork and (self.zygote is None or self.zygote.poll() is not None) \
                and time.monotonic() >= self.zygote_started + ZYGOTE_RESPAWN_S:
            # A new zygote serves the requests a dead one left behind (they stay in its directory).
            self.zygote_started = time.monotonic()
            self.zygote_dir.mkdir(parents=True, exist_ok=True)
            (self.zygote_dir / READY).unlink(missing_ok=True)
            self.zygote = self.spawn([*self.prefix, "--zygote", str(self.zygote_dir), *self.zygote_args],
                                     self.env, self.root / "zygote.log")
        while len(self.spares) < self.size:
            self.started += 1
            directory = self.root / f"spare-{self.started}"
            directory.mkdir(parents=True, exist_ok=True)
            log_path = self.root / f"spare-{self.started}.log"
            if self.fork:
                request(self.zygote_dir, self.started, directory, log_path)
                self.spares.append((directory, None))
            else:
                self.spares.append((directory, self.spawn([*self.prefix, "--standby", str(directory)], self.env,
                                                          log_path)))

    def _adopt(self) -> None:
        """Handles for the spares the zygote has forked since the last look (they said ready)."""
        for i, (directory, proc) in enumerate(self.spares):
            if proc is None and (directory / READY).exists():
                self.spares[i] = (directory, Adopted(int((directory / READY).read_text()), ["spare", str(directory)]))

    def ready(self) -> int:
        self._adopt()
        return sum(1 for d, p in self.spares if p is not None and p.poll() is None and (d / READY).exists())

    def fits(self, argv: list[str], env: dict[str, str]) -> bool:
        return argv[: len(self.prefix)] == self.prefix and env == self.env

    def take(self, argv: list[str], env: dict[str, str],
             log_path: Path) -> tuple[subprocess.Popen | Adopted, str] | None:
        """A spare now running `argv` (its output appended to `log_path`) and what its command line contains for the
        rest of its life (`--standby DIR`, or the zygote's `--zygote DIR`); None if no spare process exists.

        A ready spare first; else the one that has warmed up longest: it becomes the learner as soon as its warm-up
        is done, which is sooner than a cold start and leaves the CPU to it instead of to a second torch import."""
        if not self.fits(argv, env):
            return None
        self._adopt()
        alive = [(i, d, p) for i, (d, p) in enumerate(self.spares) if p is not None and p.poll() is None]
        ready = [x for x in alive if (x[1] / READY).exists()]
        if not (ready or alive):
            return None
        i, directory, proc = (ready or alive)[0]
        del self.spares[i]
        atomic_write_json(directory / ASSIGNMENT, {"args": argv[len(self.prefix):], "log": str(log_path)})
        self.taken += 1
        self.refill()
        tag = f"--zygote {self.zygote_dir}" if isinstance(proc, Adopted) else f"--standby {directory}"
        return proc, tag

    def close(self) -> None:
        """Stop every spare still waiting (they hold no state), and the zygote."""
        self._adopt()
        procs = [p for _, p in self.spares if p is not None] + ([self.zygote] if self.zygote is not None else [])
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session (as every supervised child)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.spares, self.zygote = [], None
