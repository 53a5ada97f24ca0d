"""`diloco` as a container's PID 1 (the syncer and learner pods run it so): SIGTERM ends it even before its command
has installed a handler of its own, where the kernel would otherwise drop the signal and the kubelet wait out the
pod's whole grace period. Run in a PID namespace of its own (`unshare --pid`), as in a container."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# What a command does before its own handler: imports that take long under load (here a sleep of that length).
CHILD = """
import os, sys, time
from diloco_trainer.cli import stop_on_sigterm_as_pid_1
if sys.argv[1] == "cli":
    stop_on_sigterm_as_pid_1()
print(os.getpid(), flush=True)
time.sleep(120)
"""


def _as_pid_1(how: str) -> tuple[subprocess.Popen, int]:
    """`CHILD` as PID 1 of a new PID namespace; returns `unshare` and the child's PID as this host sees it."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    proc = subprocess.Popen(["unshare", *user, "--pid", "--fork", "--kill-child", sys.executable, "-c", CHILD, how],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "1", "the child is not PID 1 of its namespace"
    (child,) = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    return proc, child


def _catches_sigterm(pid: int) -> bool:
    """Whether the kernel delivers SIGTERM to a handler of the process (its SigCgt mask), rather than applying the
    default action, which for PID 1 is to drop it."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return bool(int(fields["SigCgt"], 16) & (1 << (signal.SIGTERM - 1)))


def test_diloco_as_pid_1_ends_on_sigterm_before_its_command_installs_a_handler():
    proc, child = _as_pid_1("cli")
    try:
        assert _catches_sigterm(child)
        os.kill(child, signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_without_it_a_pid_1_python_would_drop_sigterm():
    """The premise: the same process not calling stop_on_sigterm_as_pid_1 has no SIGTERM handler, so the kernel
    drops the kubelet's SIGTERM to it (the pod then waits out its grace period for SIGKILL)."""
    proc, child = _as_pid_1("bare")
    try:
        assert not _catches_sigterm(child)
    finally:
        proc.kill()
        proc.wait()


def test_elsewhere_sigterm_keeps_its_default():
    """Outside a container's PID 1 the default stays: SIGTERM ends the process at once, with no Python code run."""
    code = "from diloco_trainer.cli import stop_on_sigterm_as_pid_1 as f, signal; f(); " \
           "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
