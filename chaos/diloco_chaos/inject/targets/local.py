"""Faults on the processes of a `diloco local` run, found through RUN/processes.json (written by its supervisor).

kill = SIGKILL to the victim's process group; pause = SIGSTOP, then SIGCONT; fail with exit code 128+N = signal N
(how a shell or container runtime reports a death by signal; a process can be made to exit with another code
only by its own cooperation). Progress is read from learners/<id>/metrics.jsonl and syncer.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from diloco_kube.labels import LABEL_COMPONENT, LABEL_UNIT  # the same label keys as the operator's pods
from diloco_trainer.fsutil import atomic_write_json
from diloco_trainer.protocol.messages import MetricsRecord, ProcessEntry, ProcessesDoc, RestartHold, SyncerSample

from diloco_chaos.inject.experiment import Experiment
from diloco_chaos.inject.guards import Candidate
from diloco_chaos.inject.record import UnitObservation
from diloco_chaos.inject.targets import Fault

# Signals whose default action ends a process: usable for `fail` (exit code 128 + signal).
FATAL_SIGNALS = {s for s in signal.Signals if s not in (
    signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCHLD,
    signal.SIGURG, signal.SIGWINCH) and s < 32}


def signal_for_exit_code(code: int) -> signal.Signals:
    """The signal that makes a process end with `code` as a shell reports it (128 + N); ValueError otherwise."""
    try:
        sig = signal.Signals(code - 128)
    except ValueError:
        sig = None
    if sig is None or sig not in FATAL_SIGNALS:
        examples = "137 (SIGKILL), 139 (SIGSEGV), 134 (SIGABRT), 138 (SIGUSR1)"
        raise ValueError(f"action.exitCode {code}: a local process can be made to fail from outside only by a "
                         f"signal, reported as exit code 128+N; use e.g. {examples}")
    return sig


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether the process handles or ignores `sig` (then it would not die with 128+N)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return False
    mask = int(fields.get("SigCgt", "0").strip(), 16) | int(fields.get("SigIgn", "0").strip(), 16)
    return bool(mask >> (int(sig) - 1) & 1)


class _Tail:
    """Reads the complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


class LocalTarget:
    """The learners and the syncer of one `diloco local` run directory."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.processes_json = self.run_dir / "processes.json"
        self.tails: dict[str, _Tail] = {}
        self.syncer_tail = _Tail(self.run_dir / "syncer.jsonl")
        self.stopped: dict[str, set[int]] = {}  # unit -> pids we stopped (pause / downtime hold)
        self.hold_files: dict[str, list[Path]] = {}  # unit -> restart holds we asked the supervisor for

    def describe(self) -> dict:
        return {"kind": "local", "run_dir": str(self.run_dir)}

    # ------------------------------------------------------------------ discovery

    def _doc(self) -> ProcessesDoc:
        try:
            return ProcessesDoc.model_validate_json(self.processes_json.read_text())
        except FileNotFoundError:
            raise ValueError(f"{self.processes_json} not found: pass the run directory of a running "
                             f"`diloco local` (--run-dir)") from None
        except ValueError:  # replaced atomically, so this is a damaged file, not a torn write
            raise ValueError(f"{self.processes_json} is not a valid processes.json") from None

    async def preflight(self, exp: Experiment) -> None:
        self._doc()
        if exp.action.type == "fail":
            signal_for_exit_code(exp.action.exit_code)
        if exp.safety.namespace is not None:
            raise ValueError("safety.namespace scopes Kubernetes targets; a local run has no namespace")

    async def ended(self) -> str | None:
        doc = self._doc()
        if doc.stopping:
            return "the local run is stopping"
        if not _pid_alive(doc.supervisor_pid):
            return "the local run's supervisor is gone"
        return None

    async def candidates(self) -> list[Candidate]:
        out = []
        for p in self._doc().processes:
            if p.role not in ("learner", "syncer"):
                continue
            m = re.search(r"(\d+)$", p.name)
            out.append(Candidate(
                unit=p.name, role=p.role, index=int(m.group(1)) if p.role == "learner" and m else None,
                members=(p.name,), labels={LABEL_COMPONENT: p.role, LABEL_UNIT: p.name},
                alive=p.alive and not p.finished and p.name not in self.stopped))
        return out

    def _process(self, name: str) -> ProcessEntry | None:
        return self._doc().process(name)

    def _verified_pid(self, name: str) -> int | None:
        """The live PID of `name`, checked against its command line (a PID is never signalled after reuse)."""
        p = self._process(name)
        if p is None or not p.alive or not p.pid:
            return None
        pid = p.pid
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        if p.cmdline_tag:  # a warm spare that became this learner (runtime/spares.py)
            expected = p.cmdline_tag.encode()
        else:
            expected = b"--learner-id " + name.encode() if p.role == "learner" else b"syncer --config"
        return pid if expected in b" ".join(argv) else None

    # ------------------------------------------------------------------ actions

    async def inject(self, fault: Fault) -> dict:
        sig = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP}.get(fault.action)
        if fault.action == "fail":
            sig = signal_for_exit_code(fault.exit_code)
        pids = {}
        for name in fault.members:
            pid = self._verified_pid(name)
            if pid is None:
                raise RuntimeError(f"{name} is not running (or its PID no longer matches processes.json)")
            if fault.action == "fail" and _catches(pid, sig):
                raise RuntimeError(f"{name} handles {sig.name}, so it would not exit with code {fault.exit_code}; "
                                   f"pick another exitCode")
            pids[name] = pid
        details = {"signal": sig.name, "pids": pids, "process_group": True}
        if fault.action != "pause" and fault.back_at > fault.at:
            held = self._ask_supervisor_to_hold(fault)  # before the kill: a warm spare takes over within a second
            if held:
                details["restart_held_until"] = fault.back_at
        for name, pid in pids.items():
            if fault.action == "pause":
                self._stop(fault.unit, pid, resume_after=fault.back_at - time.time())
            else:
                _killpg(pid, sig)
        return details

    def _ask_supervisor_to_hold(self, fault: Fault) -> bool:
        """Downtime: ask the run's supervisor not to restart the victim before `back_at` (processes.json names the
        directory; a supervisor too old to have one gets the SIGSTOP hold of `hold` alone)."""
        hold_dir = self._doc().hold_dir
        if hold_dir is None:
            return False
        by = f"{fault.experiment} fault #{fault.id}"
        for name in fault.members:
            path = Path(hold_dir) / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, RestartHold(until=fault.back_at, by=by).model_dump(mode="json"))
            self.hold_files.setdefault(fault.unit, []).append(path)
        return True

    def _lift_holds(self, unit: str) -> None:
        for path in self.hold_files.pop(unit, []):
            path.unlink(missing_ok=True)

    def _stop(self, unit: str, pid: int, resume_after: float) -> None:
        _killpg(pid, signal.SIGSTOP)
        self.stopped.setdefault(unit, set()).add(pid)
        # Dead man's switch: if this tool itself is killed, a detached sleeper still resumes the group.
        subprocess.Popen(["/bin/sh", "-c", f"sleep {max(1.0, resume_after + 2.0):.1f}; kill -CONT -- -{pid}"],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)

    async def hold(self, fault: Fault) -> dict | None:
        """Downtime: a replacement the supervisor started anyway (one without restart holds) is stopped at once
        until the downtime ends."""
        held = []
        for name in fault.members:
            pid = self._verified_pid(name)
            if pid is not None and pid not in self.stopped.get(fault.unit, set()):
                self._stop(fault.unit, pid, resume_after=fault.back_at - time.time())
                held.append(pid)
        return {"held_pids": held} if held else None

    async def release(self, fault: Fault) -> dict | None:
        self._lift_holds(fault.unit)
        pids = sorted(self.stopped.pop(fault.unit, set()))
        for pid in pids:
            _killpg(pid, signal.SIGCONT)
        return {"resumed_pids": pids} if pids else None

    async def close(self) -> None:
        """Never leave a process stopped or held behind."""
        for unit in list(self.hold_files):
            self._lift_holds(unit)
        for unit in list(self.stopped):
            for pid in self.stopped.pop(unit):
                _killpg(pid, signal.SIGCONT)

    # ------------------------------------------------------------------ observation

    async def observe(self) -> dict[str, UnitObservation]:
        doc = self._doc()
        units: dict[str, UnitObservation] = {}
        for p in doc.processes:
            if p.role not in ("learner", "syncer"):
                continue
            units[p.name] = UnitObservation(started=p.started, running=p.alive, lines=[])
            if p.role == "learner":
                tail = self.tails.setdefault(p.name, _Tail(self.run_dir / "learners" / p.name / "metrics.jsonl"))
                records = [MetricsRecord.model_validate(r) for r in tail.new() if "time" in r]
                units[p.name].lines = [(r.time, r.step) for r in records]
        for line in self.syncer_tail.new():
            if not line.get("up"):
                continue
            sample = SyncerSample.from_line(line)
            t, status = sample.time, sample.status
            if "syncer" in units:  # the syncer "trains" when it serves: its progress is the outer step count
                units["syncer"].lines.append((t, status.outer_steps + 1))
                units["syncer"].merged.append((t, status.contributions_merged))
            for shard in range(status.shards if status.shards > 1 else 0):  # syncer-<i>: its own fragments' steps
                if f"syncer-{shard}" in units:
                    steps = sum(n for p, n in status.outer_steps_per_fragment.items() if int(p) % status.shards == shard)
                    units[f"syncer-{shard}"].lines.append((t, steps + 1))
                    units[f"syncer-{shard}"].merged.append((t, steps))  # each outer step merged >= 1 contribution
            for lid, info in status.learners.items():
                if lid in units:
                    units[lid].merged.append((t, info.submissions_merged))
        return units


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each supervised child leads its own session: the group is the whole unit
    except ProcessLookupError:
        pass
