"""`diloco pod-learner -- LEARNER-ARGS`: a learner pod's entrypoint, a supervisor that restarts a crashed or killed
learner process in place from a warm spare (runtime/spares.py's zygote), so the kubelet never restarts the container.

A learner that keeps crashing still ends the pod: past `--max-restarts` restarts within `--restart-window-s`, or on an
exit code that says a restart cannot help (a usage error, the syncer's refusal), the supervisor exits with the
learner's code and the operator's own restart limit and the unit's Failed state take over. SIGTERM (preemption, a
drain) is passed to the learner, which hands over its unsent work within its `--drain-s` and exits 0; so does the pod.

A spare pod (`--assignment-file`, the operator's `spares`) starts as nobody: its warm spare imports torch and
transformers and waits until the operator assigns it a unit (runtime/sparepod.py), then it is that unit's learner pod
exactly as above.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from diloco_trainer.protocol.assignment import POD_NAME_ENV, AssignmentError
from diloco_trainer.runtime.procs import Child, StopFlag, Supervisor, child_env, diloco_argv
from diloco_trainer.runtime.sparepod import AssignmentWait
from diloco_trainer.runtime.spares import SparePool

NO_RESTART_CODES = {2: "a usage or configuration error", 3: "the syncer refused this learner"}
POLL_S = 0.05
STOP_MARGIN_S = 5.0  # after --drain-s: the step in progress and the snapshot (objects.py's grace period covers it)
RESTART_DELAY_S = 0.25  # a killed learner's wait; a crash loop doubles it (Child.next_restart_delay)


SPARE_AFTER_S = 120.0  # the latest a cold-started pod starts warming its spare, trained or not


class FirstStep:
    """Whether the learner has trained since `since`: its --state-dir's metrics.jsonl or position.json (written after
    its first steps) changed after then; without a state directory, SPARE_AFTER_S after `since`."""

    def __init__(self, state_dir: str | None, since: float):
        self.paths = [Path(state_dir) / n for n in ("metrics.jsonl", "position.json")] if state_dir else []
        self.since = since

    def seen(self) -> bool:
        if time.time() - self.since >= SPARE_AFTER_S:
            return True
        for path in self.paths:
            try:
                if path.stat().st_mtime >= self.since:
                    return True
            except OSError:
                continue
        return False


def restart_verdict(code: int, restarts_at: list[float], now: float, max_restarts: int,
                    window_s: float) -> tuple[bool, str]:
    """Whether a learner that exited with `code` is restarted in place, and why (for the log).

    `restarts_at`: the times of the restarts so far. A signal (negative code: SIGKILL, the OOM killer) or a crash is
    restarted while fewer than `max_restarts` restarts happened within the last `window_s` seconds."""
    if code == 0:
        return False, "finished"
    if code in NO_RESTART_CODES:
        return False, f"exit code {code}: {NO_RESTART_CODES[code]}, a restart cannot help"
    recent = [t for t in restarts_at if now - t < window_s]
    if len(recent) >= max_restarts:
        return False, f"{len(recent)} restarts within {window_s:g} s already (--max-restarts {max_restarts})"
    how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else \
        f"exit code {code}"
    return True, f"{how}: restart {len(recent) + 1} of at most {max_restarts} within {window_s:g} s"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restart the learner process in place at most this often within --restart-window-s; "
                             "past it the pod fails with the learner's exit code")
    parser.add_argument("--restart-window-s", type=float, default=600.0)
    parser.add_argument("--spares", type=int, default=1, help="warm spares kept ready (0: restart from scratch)")
    parser.add_argument("--assignment-file", default=None, metavar="FILE",
                        help="a spare pod: wait, warm, until FILE (the pod's downward-API view of its "
                             "diloco.dev/assignment annotation) names the unit to become; the learner arguments then "
                             "leave out --learner-id, --unit, --units and --token-file")
    parser.add_argument("--spare-key-file", default=None, metavar="FILE",
                        help="with --assignment-file: the job's spare key, which opens the assignment's token")
    parser.add_argument("--work-dir", default=None,
                        help="the supervisor's spares and events.jsonl (default: a new directory under $TMPDIR)")
    parser.add_argument("learner_args", nargs=argparse.REMAINDER,
                        help="-- then the `diloco learner` arguments (its --syncer, --learner-id, --drain-s, ...)")


ASSIGNED_FLAGS = ("--learner-id", "--unit", "--units", "--token-file", "--token-env")


def _learner_args(args: argparse.Namespace) -> tuple[list[str], argparse.Namespace]:
    """The learner's own arguments, checked by its parser now (a bad one fails the pod at once, clearly). A spare
    pod's are checked as they will be once assigned."""
    from diloco_trainer.learner.main import configure as learner_configure

    rest = list(args.learner_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.restart_window_s > 0:
        raise ValueError(f"--restart-window-s must be > 0, got {args.restart_window_s}")
    if args.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {args.spares}")
    if args.assignment_file:
        if not args.spare_key_file:
            raise ValueError("--assignment-file needs --spare-key-file (the key that opens the assignment's token)")
        if given := [a for a in rest if a.split("=", 1)[0] in ASSIGNED_FLAGS]:
            raise ValueError(f"a spare pod's learner arguments leave out {', '.join(given)}: the assignment gives them")
        if not os.environ.get(POD_NAME_ENV):
            raise ValueError(f"a spare pod needs its own name in ${POD_NAME_ENV} (the downward API's metadata.name)")
        _, parsed = _check(learner_configure, [*rest, "--learner-id", "spare", "--unit", "0", "--units", "1"])
        return rest, parsed
    return _check(learner_configure, rest)


def _check(learner_configure, rest: list[str]) -> tuple[list[str], argparse.Namespace]:
    """`rest` parsed by the learner's own parser, or ValueError (argparse exits 2 on an unknown flag)."""
    parser = argparse.ArgumentParser(prog="diloco pod-learner -- (learner arguments)")
    learner_configure(parser)
    parsed = parser.parse_args(rest)  # an unknown or malformed one: argparse's message naming it, exit 2
    if parsed.standby or parsed.zygote or parsed.process_restarts:
        raise ValueError("learner arguments: --standby, --zygote and --process-restarts are the supervisor's own")
    if not parsed.syncer or not parsed.learner_id:
        raise ValueError("learner arguments: --syncer and --learner-id are required")
    return rest, parsed


def _wait_for_assignment(args: argparse.Namespace, learner_argv: list[str], work: Path, sup: Supervisor,
                         flag: StopFlag) -> tuple[list[str] | None, argparse.Namespace | None]:
    """A spare pod: keep the warm spare warm until the operator's assignment arrives, then the learner's full
    arguments (its token written to a file of this supervisor's own). (None, None): stopped before that."""
    from diloco_trainer.learner.main import configure as learner_configure

    wait = AssignmentWait(Path(args.assignment_file), Path(args.spare_key_file), os.environ[POD_NAME_ENV])
    _say(f"spare pod {wait.pod}: warming up, waiting for an assignment in {args.assignment_file}")
    started = time.monotonic()
    while not flag:
        sup.poll()  # starts and keeps the warm spare
        if (assignment := wait.poll()) is not None:
            token_file = work / "token"
            token_file.touch(mode=0o600)
            token_file.write_text(assignment.token)
            argv = [*learner_argv, *assignment.learner_args(str(token_file))]
            _say(f"spare pod {wait.pod} assigned learner {assignment.learner_id} (unit {assignment.unit} of "
                 f"{assignment.units}) after {time.monotonic() - started:.1f} s warm "
                 f"({sup.spares.ready() if sup.spares else 0} spare process(es) ready)")
            return _check(learner_configure, argv)
        time.sleep(POLL_S)
    return None, None


def _say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pod-learner: {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        learner_argv, parsed = _learner_args(args)
    except ValueError as exc:
        print(f"diloco pod-learner: {exc}", flush=True)
        return 2
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="diloco-pod-learner-"))
    work.mkdir(parents=True, exist_ok=True)
    stdout = Path(f"/proc/{os.getpid()}/fd/1")  # every process's output goes to the container's log
    if not stdout.exists():
        stdout = work / "learner.log"
    prefix = diloco_argv("learner")
    env = child_env()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the pod's thread settings as they are, not one per learner
        if var not in os.environ:
            env.pop(var, None)
    restarts_at: list[float] = []
    flag = StopFlag()
    with flag.installed(), Supervisor(processes_json=work / "processes.json",
                                      events_jsonl=work / "events.jsonl") as sup:
        pool = None
        if args.spares or args.assignment_file:
            # The model comes from the syncer: warm transformers too (a Llama learner started ~6 s sooner in a pod).
            pool = SparePool(work / "spares", max(args.spares, 1 if args.assignment_file else 0), prefix, env,
                             sup.spawn, zygote_args=("--warm-hf",))
        if args.assignment_file:
            sup.spares = pool  # a spare pod warms up first: that is what it is for
            try:
                learner_argv, parsed = _wait_for_assignment(args, learner_argv, work, sup, flag)
            except AssignmentError as exc:
                _say(f"the assignment cannot be read: {exc}")
                return 2
            if learner_argv is None:
                _say(f"{flag.requested} before any assignment: exiting 0")
                return 0
        child = sup.add(Child("learner", "learner", [*prefix, *learner_argv], env, stdout,
                              restart_delay=RESTART_DELAY_S))

        def should_restart(c: Child) -> bool:
            yes, why = restart_verdict(c.exits[-1], restarts_at, time.time(), args.max_restarts,
                                       args.restart_window_s)
            _say(f"learner {parsed.learner_id} (pid {c.proc.pid}) exited: {why}")
            if yes:
                restarts_at.append(time.time())
                # The learner exports it (diloco_learner_process_restarts); a spare takes any argv after the prefix.
                c.argv = [*prefix, *learner_argv, "--process-restarts", str(len(restarts_at))]
            return yes

        sup.should_restart = should_restart
        _say(f"starting learner {parsed.learner_id} ({args.spares} warm spare(s), at most {args.max_restarts} "
             f"restarts in place within {args.restart_window_s:g} s)")
        sup.start("learner", warm=bool(args.assignment_file))
        if not args.spares and sup.spares is not None:
            sup.spares.size = 0  # the spare pod's own warm process became the learner; keep none behind it
        # A cold start's learner imports torch and builds its model first; a spare warming up beside it would halve
        # its CPU on a small node. The spare starts once the learner has trained a step (or SPARE_AFTER_S passed).
        first_step = FirstStep(parsed.state_dir, time.time())
        while not flag:
            if sup.spares is None and pool is not None and (first_step.seen() or not child.alive):
                sup.spares = pool
            for event in sup.poll():
                if event.event == "start" and child.restarts:
                    _say(f"learner {parsed.learner_id} restarted in place (pid {event.pid}, "
                         f"{'warm spare' if event.spare else 'cold start'}; restart {child.restarts})")
            if child.finished or child.down:
                break
            time.sleep(POLL_S)
        if flag and child.alive:
            _say(f"{flag.requested}: draining learner {parsed.learner_id} (pid {child.proc.pid}, "
                 f"--drain-s {parsed.drain_s:g})")
            sup.stopping = True  # no restart, no new spare: the pod is going away
            if sup.spares is not None:
                sup.spares.close()
            sup.stop(["learner"], timeout=parsed.drain_s + STOP_MARGIN_S)
        code = child.exits[-1] if child.exits else 0
    code = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    _say(f"exiting {code} after {child.restarts} restart(s) in place")
    sys.stdout.flush()
    return code
