"""Exec wrapper for supervised children: dies with its supervisor, so no process is ever orphaned.

`python -m diloco_trainer.runtime.guard PARENT_PID ARGV...` asks the kernel for SIGTERM when the parent
dies (Linux prctl PR_SET_PDEATHSIG, kept across exec) and then execs ARGV in place, so the child's PID is the
real program's PID (what processes.json and chaos tools see).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _ask_for_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own cleanup still applies
        pass


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m diloco_trainer.runtime.guard PARENT_PID PROGRAM [ARGS...]")
    parent, program = int(argv[0]), argv[1:]
    _ask_for_death_signal()
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        raise SystemExit(1)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
