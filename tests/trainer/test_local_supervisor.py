"""The local runtime's process supervisor with small real child processes (no torch, seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco_trainer.runtime.procs import Child, Supervisor, child_env

from polling import alive, wait_for

pytestmark = pytest.mark.timeout(60)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _child(tmp_path: Path, name: str, code: str, role: str = "learner", **kw) -> Child:
    return Child(name, role, _py(code), child_env(), tmp_path / "logs" / f"{name}.log", **kw)


def _wait(predicate, timeout: float = 10.0, sup: Supervisor | None = None) -> None:
    """wait_for, with the supervisor polled before each look (it reaps and restarts its children there)."""
    wait_for(lambda: (sup.poll() if sup is not None else None, predicate())[1], timeout, "condition", 0.05)


def test_supervisor_restarts_a_crashed_child_and_counts_restarts(tmp_path):
    marker = tmp_path / "crashed-once"
    code = f"""
        import pathlib, sys, time
        m = pathlib.Path({str(marker)!r})
        if not m.exists():
            m.write_text("x"); sys.exit(3)
        time.sleep(30)
    """
    with Supervisor(tmp_path / "processes.json") as sup:
        sup.add(_child(tmp_path, "learner-0", code, restart_delay=0.2))
        sup.start("learner-0")
        child = sup.children["learner-0"]
        _wait(lambda: child.restarts == 1 and child.alive, sup=sup)
        assert child.exits == [3]
        assert not child.finished
        doc = json.loads((tmp_path / "processes.json").read_text())
        entry = doc["processes"][0]
        assert entry["pid"] == child.proc.pid and entry["restarts"] == 1 and entry["role"] == "learner"
        assert doc["supervisor_pid"] == os.getpid()


def test_a_child_that_keeps_crashing_at_start_is_restarted_with_a_doubling_delay(tmp_path):
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", "import sys; sys.exit(1)", restart_delay=0.2))
        sup.start("learner-0")
        child = sup.children["learner-0"]
        _wait(lambda: child.restarts == 3, timeout=20, sup=sup)
    gaps = [b - a for a, b in zip(child.starts, child.starts[1:])]
    # 0.4 s, 0.8 s, 1.6 s (plus the child's own start-up, well under 0.4 s): each gap at least the delay.
    assert gaps[0] >= 0.4 and gaps[1] >= 0.8 and gaps[2] >= 1.6, gaps
    assert child.quick_crashes == 3


def test_a_child_that_ran_a_while_before_crashing_is_restarted_after_the_base_delay(tmp_path):
    child = Child("learner-0", "learner", ["true"], {}, tmp_path / "log", restart_delay=0.5, quick_crashes=4)
    child.starts.append(time.time() - 3600)
    assert child.next_restart_delay(time.time()) == 0.5 and child.quick_crashes == 0


def test_a_child_killed_by_a_signal_soon_after_its_start_is_restarted_after_the_base_delay(tmp_path):
    child = Child("learner-0", "learner", ["true"], {}, tmp_path / "log", restart_delay=2.0, quick_crashes=1)
    child.starts.append(time.time() - 5)
    assert child.next_restart_delay(time.time(), code=-signal.SIGKILL) == 2.0 and child.quick_crashes == 1
    assert child.next_restart_delay(time.time(), code=1) == 8.0 and child.quick_crashes == 2


def test_supervisor_does_not_restart_a_child_that_finished_cleanly(tmp_path):
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", "print('done')", restart_delay=0.0))
        sup.start("learner-0")
        child = sup.children["learner-0"]
        _wait(lambda: child.finished, sup=sup)
        time.sleep(0.3)
        sup.poll()
        assert child.restarts == 0 and child.exits == [0]
    assert "done" in child.log_path.read_text()


def test_processes_json_pid_is_the_program_itself_so_chaos_can_kill_it(tmp_path):
    with Supervisor(tmp_path / "processes.json") as sup:
        sup.add(_child(tmp_path, "learner-0", "import time; time.sleep(30)", restart_delay=0.1))
        sup.start("learner-0")
        first = json.loads((tmp_path / "processes.json").read_text())["processes"][0]["pid"]
        _wait(lambda: "time.sleep" in Path(f"/proc/{first}/cmdline").read_text().replace("\0", " "))
        os.kill(first, signal.SIGKILL)  # what an external chaos tool does
        child = sup.children["learner-0"]
        _wait(lambda: child.restarts == 1 and child.alive, sup=sup)
        assert child.exits == [-signal.SIGKILL]
        second = json.loads((tmp_path / "processes.json").read_text())["processes"][0]["pid"]
        assert second != first and alive(second)


def test_stop_terminates_learners_before_the_syncer(tmp_path):
    log = tmp_path / "order.log"
    code = f"""
        import signal, sys, time
        def bye(*_):
            time.sleep(0.3)
            with open({str(log)!r}, "a") as f:
                f.write(sys.argv[1] + " " + repr(time.time()) + "\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        open({str(tmp_path)!r} + "/ready-" + sys.argv[1], "w").close()
        while True:
            time.sleep(0.05)
    """
    with Supervisor() as sup:
        for name, role in (("syncer", "syncer"), ("learner-0", "learner"), ("learner-1", "learner")):
            c = _child(tmp_path, name, code, role=role)
            c.argv.append(name)
            sup.add(c)
            sup.start(name)
        _wait(lambda: all((tmp_path / f"ready-{n}").exists() for n in ("syncer", "learner-0", "learner-1")))
    lines = [line.split() for line in log.read_text().splitlines()]
    order = [name for name, _ in sorted(lines, key=lambda x: float(x[1]))]
    assert order[-1] == "syncer" and set(order[:2]) == {"learner-0", "learner-1"}
    assert all(c.exits == [0] for c in sup.children.values())


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    ready = tmp_path / "ready"
    code = f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", code))
        child = sup.start("learner-0")
        _wait(ready.exists)  # its handler is installed
        started = time.monotonic()
        sup.stop(["learner-0"], timeout=1.0)
        assert time.monotonic() - started < 5
        assert not child.alive and child.exits == [-signal.SIGKILL]
        assert any(e.event == "kill" for e in sup.events)
        assert child.restart_at is None, "a child stopped on purpose must not be restarted"


def test_children_die_when_the_supervisor_is_killed(tmp_path):
    """Even a SIGKILLed supervisor (no cleanup code runs) leaves no orphan: the kernel stops the children."""
    pids = tmp_path / "pids.json"
    script = f"""
        import json, sys, time
        from pathlib import Path
        from diloco_trainer.runtime.procs import Child, Supervisor, child_env
        sup = Supervisor()
        for i in range(2):
            sup.add(Child(f"learner-{{i}}", "learner", [sys.executable, "-c", "import time; time.sleep(60)"],
                          child_env(), Path({str(tmp_path)!r}) / f"l{{i}}.log"))
            sup.start(f"learner-{{i}}")
        Path({str(pids)!r}).write_text(json.dumps([c.proc.pid for c in sup.children.values()]))
        time.sleep(60)
    """
    parent = subprocess.Popen(_py(script), env=child_env())
    try:
        _wait(lambda: pids.exists() and pids.read_text())
        children = json.loads(pids.read_text())
        assert all(alive(p) for p in children)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait(lambda: not any(alive(p) for p in children), timeout=10)
    finally:
        parent.kill()


def test_stop_reaches_a_child_paused_with_sigstop(tmp_path):
    ready = tmp_path / "ready"
    code = f"""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        open({str(ready)!r}, "w").close()
        while True:
            time.sleep(0.05)
    """
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", code))
        child = sup.start("learner-0")
        _wait(ready.exists)
        os.kill(child.proc.pid, signal.SIGSTOP)  # what a chaos "pause" does
        started = time.monotonic()
        sup.stop(["learner-0"], timeout=10.0)
        assert child.exits == [0] and time.monotonic() - started < 5, "the paused child was not woken to stop cleanly"


def test_a_crashed_child_the_policy_declines_is_marked_finished_not_restarted(tmp_path):
    with Supervisor() as sup:
        sup.should_restart = lambda child: False
        sup.add(_child(tmp_path, "learner-0", "import sys; sys.exit(1)", restart_delay=0.0))
        child = sup.start("learner-0")
        _wait(lambda: child.exits == [1], sup=sup)
        sup.poll()
        assert child.finished and child.restart_at is None and child.restarts == 0


def test_a_child_that_died_since_the_last_poll_is_not_down_until_a_poll_has_decided_its_restart(tmp_path):
    """`down` (what `diloco pod-learner` and `diloco local` stop on): a learner killed between two polls is dead but
    not down, so the loop does not end the pod before the next poll restarts it (seen in CI: a pod-learner that
    exited with the previous life's code and never decided on the second kill)."""
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", "import time; time.sleep(30)", restart_delay=5.0))
        child = sup.start("learner-0")
        sup.poll()
        child.proc.kill()
        child.proc.wait()
        assert not child.alive and child.restart_at is None, "dead, and no poll has seen it yet"
        assert not child.down
        sup.poll()
        assert child.exits == [-signal.SIGKILL] and child.restart_at is not None and not child.down
        sup.should_restart = lambda c: False  # the next death is declined: that one stays down
        sup.start("learner-0")
        child.proc.kill()
        child.proc.wait()
        assert not child.down
        sup.poll()
        assert child.down and child.finished


def test_a_restart_hold_keeps_a_killed_child_down_until_it_ends_and_a_lifted_hold_frees_it_early(tmp_path):
    holds = tmp_path / "holds"
    holds.mkdir()
    with Supervisor(tmp_path / "processes.json", hold_dir=holds) as sup:
        for name in ("learner-0", "learner-1"):
            sup.add(_child(tmp_path, name, "import time; time.sleep(30)", restart_delay=0.1))
            sup.start(name)
        assert json.loads((tmp_path / "processes.json").read_text())["hold_dir"] == str(holds)
        until = time.time() + 1.5
        for name in ("learner-0", "learner-1"):
            (holds / f"{name}.json").write_text(json.dumps({"until": until if name == "learner-0" else until + 60}))
            os.killpg(sup.children[name].proc.pid, signal.SIGKILL)
        held0, held1 = sup.children["learner-0"], sup.children["learner-1"]
        _wait(lambda: held0.restarts == 1, sup=sup)
        assert time.time() >= until  # not a moment before the hold ended
        assert held1.restarts == 0 and not held1.alive
        (holds / "learner-1.json").unlink()  # the tool lifted its hold: the restart follows at once
        _wait(lambda: held1.restarts == 1, timeout=2.0, sup=sup)
        assert [e.until for e in sup.events if e.event == "held" and e.name == "learner-0"] == [until]


def test_an_unreadable_restart_hold_is_ignored_so_a_broken_tool_cannot_keep_a_child_down(tmp_path):
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / "learner-0.json").write_text("{not json")
    with Supervisor(hold_dir=holds) as sup:
        sup.add(_child(tmp_path, "learner-0", "import time; time.sleep(30)", restart_delay=0.1))
        sup.start("learner-0")
        os.killpg(sup.children["learner-0"].proc.pid, signal.SIGKILL)
        _wait(lambda: sup.children["learner-0"].restarts == 1, timeout=3.0, sup=sup)
        assert any(e.event == "hold-ignored" for e in sup.events)


def test_the_supervisor_wakes_when_a_child_exits_or_its_restart_falls_due_not_a_tick_later(tmp_path):
    with Supervisor() as sup:
        sup.add(_child(tmp_path, "learner-0", "import time; time.sleep(60)", restart_delay=0.3))
        sup.start("learner-0")
        child = sup.children["learner-0"]
        killed = time.monotonic()
        os.kill(child.proc.pid, signal.SIGKILL)
        sup.wait(5.0)  # wakes on the exit
        woke = time.monotonic() - killed
        sup.poll()
        assert child.exits == [-signal.SIGKILL] and child.restart_at is not None
        sup.wait(5.0)  # wakes when the restart is due (0.3 s after the exit was seen)
        sup.poll()
        restarted = time.monotonic() - killed
        assert child.restarts == 1 and child.alive
        assert woke < 1.0 and restarted < 1.5, (woke, restarted)  # not the 5 s either wait allowed
