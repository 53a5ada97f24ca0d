"""Process supervision for the local runtime: start children, restart the ones that die, stop in order.

Every child runs in its own session (Ctrl+C in the terminal reaches only the supervisor, which then stops
learners before the syncer) and under `runtime.guard` (the kernel stops it if the supervisor dies), and
`Supervisor.close()` kills whatever is still alive, so no child outlives the run, also on errors.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import diloco_trainer
from diloco_trainer.fsutil import atomic_write_json
from diloco_trainer.protocol.messages import ProcessEntry, ProcessesDoc, RestartHold
from diloco_trainer.protocol.runfiles import RunEvent, append_event

from diloco_trainer.runtime.spares import SparePool
from diloco_trainer.runtime.standby import SyncerStandby

PACKAGE_ROOT = str(Path(diloco_trainer.__file__).resolve().parent.parent)


def diloco_argv(*args: str) -> list[str]:
    """A `diloco ...` command line that works without the console script being installed."""
    return [sys.executable, "-m", "diloco_trainer.cli", *args]


def child_env(extra: dict[str, str] | None = None, threads: int = 1) -> dict[str, str]:
    """The environment for a child: this one, the package importable, and one BLAS thread each
    (N learners share a few cores; oversubscribed threads slow everyone down)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(threads))
    env.update(extra or {})
    return env


QUICK_CRASH_S = 20.0
MAX_RESTART_DELAY_S = 60.0


@dataclass
class Child:
    """One supervised program; `restart` says whether a crash (non-zero exit) is restarted."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    restart: bool = True
    restart_delay: float = 1.0  # before the first restart; doubled for each crash within QUICK_CRASH_S of a start
    meta: dict = field(default_factory=dict)  # shown in processes.json (state_dir, url, ...)
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)  # wall-clock start of every incarnation
    exits: list[int] = field(default_factory=list)  # return codes (negative: killed by that signal)
    finished: bool = False  # exited 0: done, not restarted
    restart_at: float | None = None  # monotonic time of a scheduled restart
    stop_requested: bool = False  # stopped on purpose: an exit now is not a crash to restart
    quick_crashes: int = 0  # consecutive crashes soon after a start (a crash loop backs off)
    held_until: float | None = None  # the restart hold last seen (Supervisor.held_until), for its event
    # What the running incarnation's command line contains that no other process's does, for tools that check a PID
    # before signalling it (None: the child's own argv; a warm spare that took over still shows its --standby DIR).
    cmdline_tag: str | None = None

    def next_restart_delay(self, now_wall: float, code: int = 1) -> float:
        """Back-off: `restart_delay` after a crash of a process that ran a while; doubling while it keeps crashing
        within QUICK_CRASH_S of its start (at most MAX_RESTART_DELAY_S), as Kubernetes' CrashLoopBackOff.

        A process killed by a signal (`code` < 0: a chaos tool, an operator) did not fail at start by itself: it
        gets the base delay and leaves the count alone. Measured (issue 11): with a kill every ~20 s pooled, a
        learner killed twice within 20 s waited 4 s instead of 2 before its restart."""
        if code < 0:
            return self.restart_delay
        ran = now_wall - self.starts[-1] if self.starts else 0.0
        self.quick_crashes = self.quick_crashes + 1 if ran < QUICK_CRASH_S else 0
        return min(MAX_RESTART_DELAY_S, self.restart_delay * 2 ** min(self.quick_crashes, 10))

    @property
    def restarts(self) -> int:
        return max(0, len(self.starts) - 1)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive else None

    @property
    def down(self) -> bool:
        """Exited, that exit seen by `Supervisor.poll` (which decides on a restart), and no restart due: it stays
        down. Not merely `not alive`: a process that died since the last poll has had no restart decided yet."""
        return bool(self.starts) and len(self.exits) == len(self.starts) and self.restart_at is None


class Supervisor:
    """Owns the children of one run. Use as a context manager: leaving it kills every child."""

    def __init__(self, processes_json: Path | None = None, events_jsonl: Path | None = None,
                 hold_dir: Path | None = None):
        self.children: dict[str, Child] = {}
        self.hold_dir = hold_dir  # restart holds asked for by outside tools (protocol.RestartHold)
        # Asked on every crash (non-zero exit) of a restartable child; False marks it finished instead.
        self.should_restart: Callable[[Child], bool] = lambda child: True
        self.processes_json = processes_json
        self.events_jsonl = events_jsonl
        self.stopping = False
        self.events: list[RunEvent] = []  # start / exit / kill / hold records, for the run directory
        self.spares: SparePool | None = None  # warm spares that restarted learners take over (optional)
        self.syncer_standby: SyncerStandby | None = None  # a warm syncer that takes over a dead one (optional)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, child: Child) -> Child:
        assert child.name not in self.children, child.name
        self.children[child.name] = child
        return child

    def start(self, name: str, warm: bool = False) -> Child:
        """Start (or restart) a child now; its output is appended to its log file. `warm`: a first start may take a
        warm spare too (a spare pod's learner: its pool warmed up before anyone knew which learner it would be)."""
        child = self.children[name]
        assert not child.alive, f"{name} is already running"
        child.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A restarted learner becomes a warm spare when one is ready (see spares.py): no interpreter start, no import.
        spare = None
        if self.spares is not None and (child.starts or warm) and child.role == "learner":
            spare = self.spares.take(child.argv, child.env, child.log_path)
        # A restarted syncer is the warm standby, which took over the state directory by itself (runtime/standby.py).
        standby = None
        if self.syncer_standby is not None and child.starts and child.role == "syncer":
            standby = self.syncer_standby.take(child.argv)
        with open(child.log_path, "ab") as log:
            how = f"warm spare pid {spare[0].pid} takes over" if spare is not None else " ".join(child.argv)
            if standby is not None:
                how = f"warm standby pid {standby.pid} took over"
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start #{len(child.starts) + 1}: {how}\n".encode())
            log.flush()
        if spare is not None:
            child.proc, child.cmdline_tag = spare
        elif standby is not None:
            child.proc, child.cmdline_tag = standby, None
        else:
            child.proc, child.cmdline_tag = self.spawn(child.argv, child.env, child.log_path), None
        child.starts.append(time.time())
        child.restart_at = None
        child.stop_requested = False
        self._event(child, "start", pid=child.proc.pid, spare=spare is not None, standby=standby is not None)
        self.write_processes_json()
        return child

    @staticmethod
    def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        """Start a guarded program in its own session, output appended to `log_path`."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "diloco_trainer.runtime.guard", str(os.getpid()), *argv],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def poll(self) -> list[RunEvent]:
        """Reap exited children, schedule restarts for crashed ones, start those that are due.

        Returns the events of this poll (exits and starts) for the caller's log.
        """
        before = len(self.events)
        now = time.monotonic()
        if self.spares is not None and not self.stopping:
            self.spares.refill()  # a spare that died waiting is replaced; forked ones are adopted
        if self.syncer_standby is not None and not self.stopping:
            self.syncer_standby.refill()
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is not None and len(child.exits) < len(child.starts):
                code = child.proc.returncode
                child.exits.append(code)
                self._event(child, "exit", code=code)
                if code == 0:
                    child.finished = True
                elif child.restart and not self.stopping and not child.stop_requested:
                    if self.should_restart(child):
                        child.restart_at = now + child.next_restart_delay(time.time(), code)
                    else:
                        child.finished = True
                self.write_processes_json()
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                held_until = self.held_until(child)
                if held_until is None:
                    self.start(child.name)
                else:  # asked to stay down: look again when the hold ends (or is lifted earlier)
                    if held_until != child.held_until:
                        self._event(child, "held", until=held_until)
                    child.held_until = held_until
                    child.restart_at = now + min(0.2, max(0.0, held_until - time.time()))
        return self.events[before:]

    def wait(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, but wake as soon as a child exits or a restart falls due: a supervisor that
        polled on a fixed tick saw a learner's exit, and restarted it, up to a tick late (0.25 s each in `diloco
        local`, ~0.25 s of every kill's dead time). Linux pidfds; a plain sleep where there are none."""
        now = time.monotonic()
        due = [c.restart_at for c in self.children.values() if c.restart_at is not None]
        if due:
            timeout = min(timeout, max(0.0, min(due) - now))
        fds = []
        try:
            for c in self.children.values() if hasattr(os, "pidfd_open") else ():
                if c.alive:
                    with contextlib.suppress(ProcessLookupError):  # exited since: the next poll reaps it
                        fds.append(os.pidfd_open(c.proc.pid))
            if fds:
                select.select(fds, [], [], timeout)
            else:
                time.sleep(timeout)
        except OSError:  # no pidfds here (old kernel, a sandbox): the fixed tick
            time.sleep(timeout)
        finally:
            for fd in fds:
                os.close(fd)

    def held_until(self, child: Child) -> float | None:
        """The wall-clock time before which `child` may not be restarted, if a tool asked for one that is still on.

        An unreadable hold file is ignored (with an event): a broken outside tool must not keep a learner down."""
        if self.hold_dir is None:
            return None
        try:
            hold = RestartHold.model_validate_json((self.hold_dir / f"{child.name}.json").read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._event(child, "hold-ignored", reason=str(exc).splitlines()[0][:200])
            return None
        return hold.until if hold.until > time.time() else None

    def send(self, name: str, sig: int) -> None:
        """Send a signal to a child's whole process group (a multi-process learner unit included)."""
        child = self.children[name]
        if child.alive:
            try:
                os.killpg(child.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, names: list[str], timeout: float, sig: int = signal.SIGTERM) -> None:
        """Ask the children to stop, wait up to `timeout` seconds, then SIGKILL what is left."""
        if self.syncer_standby is not None and any(self.children[n].role == "syncer" for n in names):
            self.syncer_standby.close()  # else it takes the state directory over from the syncer's clean stop
        for name in names:
            self.children[name].restart_at = None
            self.children[name].stop_requested = True
            self.send(name, sig)
            self.send(name, signal.SIGCONT)  # a child paused by a chaos tool (SIGSTOP) must see the signal now
        deadline = time.monotonic() + timeout
        for name in names:
            child = self.children[name]
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._event(child, "kill", reason=f"did not stop within {timeout:.0f}s")
                self.send(name, signal.SIGKILL)
                child.proc.wait()
        self.poll()

    def close(self) -> None:
        """Stop everything still running (learners first), never leaving an orphan behind."""
        self.stopping = True
        if self.spares is not None:
            self.spares.close()
        if self.syncer_standby is not None:  # first: it would take over from the syncer's clean stop below
            self.syncer_standby.close()
        for syncer_last in (False, True):  # learners first: they may still hand their last updates over
            names = [c.name for c in self.children.values() if c.alive and (c.role == "syncer") == syncer_last]
            if names:
                self.stop(names, timeout=10.0)
        for child in self.children.values():  # any process-group leftovers (grandchildren)
            if child.proc is not None:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.write_processes_json()

    def running(self, role: str | None = None) -> list[Child]:
        return [c for c in self.children.values() if c.alive and (role is None or c.role == role)]

    def _event(self, child: Child, kind: str, **extra) -> None:
        event = RunEvent(time=time.time(), name=child.name, role=child.role, event=kind, **extra)
        self.events.append(event)
        if self.events_jsonl is not None:
            append_event(self.events_jsonl, event)

    def write_processes_json(self) -> None:
        """Current PIDs and roles, atomically, so an external chaos tool can pick victims."""
        if self.processes_json is None:
            return
        doc = ProcessesDoc(supervisor_pid=os.getpid(), updated=time.time(), stopping=self.stopping,
                           hold_dir=str(self.hold_dir) if self.hold_dir is not None else None, processes=[
            ProcessEntry(name=c.name, role=c.role, pid=c.pid, alive=c.alive, restarts=c.restarts, finished=c.finished,
                         started=c.starts[-1] if c.starts else None, cmdline_tag=c.cmdline_tag, **c.meta)
            for c in self.children.values()])
        atomic_write_json(self.processes_json, doc.model_dump(mode="json"), indent=1)


class StopFlag:
    """First Ctrl+C / SIGTERM: stop cleanly (learners, then the syncer). Second: stop right now."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def __bool__(self) -> bool:
        return self.requested is not None

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt  # the Supervisor context still kills every child on the way out
        self.requested = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGINT and SIGTERM inside the block; the previous handlers come back afterwards."""
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
