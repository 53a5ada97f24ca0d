"""hack/build-wait.sh, which hack/build-helm.sh and hack/build-kueue.sh source: one build at a time, and a build
started in the background at a low priority (hack/test.sh) that a test then waits for runs at priority 0. Real bash
processes and a real flock; the "build" is a sleep holding the lock."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from polling import wait_for

ROOT = Path(__file__).resolve().parents[1]
WAIT = ROOT / "hack" / "build-wait.sh"


def _script(lock: Path, then: str) -> str:
    return f'set -euo pipefail; source "{WAIT}"; wait_for_build "{lock}" test-build; {then}'


def _nice(pid: int) -> int | None:
    """The process's nice value; None once it has ended."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except FileNotFoundError:
        return None


def test_a_second_build_waits_for_the_first_and_raises_it_to_priority_0_meanwhile(tmp_path):
    lock, log, pgid = tmp_path / "tool.lock", tmp_path / "order", tmp_path / "tool.lock.pgid"
    # The background build, as hack/test.sh starts it: its own process group, nice 10, holding the lock.
    first = subprocess.Popen(["setsid", "nice", "-n", "10", "bash", "-c",
                              _script(lock, f'echo first-start >> "{log}"; sleep 3; echo first-end >> "{log}"')])
    try:
        wait_for(lambda: log.exists() and pgid.exists(), timeout=10, what="the first build to hold the lock")
        assert int(pgid.read_text()) == os.getpgid(first.pid)
        assert _nice(first.pid) == 10
        started = time.monotonic()
        second = subprocess.run(["bash", "-c", _script(lock, f'echo second >> "{log}"')],
                                capture_output=True, text=True, timeout=30)
        waited = time.monotonic() - started
        assert second.returncode == 0, second.stderr
        # It ran only once the first build was done, and it said why it waited.
        assert log.read_text().split() == ["first-start", "first-end", "second"]
        assert waited > 1.0
        if os.geteuid() == 0:  # lowering a nice value needs root (CI runs as root)
            assert "raised to priority 0, waiting for it" in second.stderr
        else:
            assert "waiting for it" in second.stderr
    finally:
        first.wait(timeout=30)


def test_a_waiting_build_raises_every_process_of_the_running_build_to_priority_0(tmp_path):
    """What the wait renices is the running build's whole process group: `go` and the compilers it has started. Without
    root (lowering a nice value is root's; CI runs as root) the renice is refused and the wait is the same."""
    lock, ready = tmp_path / "tool.lock", tmp_path / "ready"
    first = subprocess.Popen(["setsid", "nice", "-n", "10", "bash", "-c",
                              _script(lock, f'sleep 3 & child=$!; echo $child > "{ready}"; wait $child')])
    try:
        wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=10, what="the first build's child")
        child = int(ready.read_text())
        assert _nice(child) == 10 and _nice(first.pid) == 10
        waiter = subprocess.Popen(["bash", "-c", _script(lock, "true")], stderr=subprocess.PIPE, text=True)
        if os.geteuid() == 0:
            wait_for(lambda: _nice(child) == 0 and _nice(first.pid) == 0, timeout=10,
                     what="the running build's processes at priority 0")
        else:
            time.sleep(1.0)
            assert _nice(child) == 10 and _nice(first.pid) == 10
        assert waiter.wait(timeout=30) == 0, waiter.stderr.read()
        assert first.poll() is not None  # the waiter got the lock only once the build had ended
    finally:
        first.wait(timeout=30)
