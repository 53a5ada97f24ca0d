"""A stop request a signal handler can raise safely: the learner's SIGTERM/SIGINT flag.

Why not `threading.Event`: its `set()` takes the lock of its condition, and so does `wait()`. Python runs a signal
handler in the main thread between two bytecodes, so a SIGTERM that lands while the main thread is inside
`Event.wait` (the learner waits on its flag every step) makes the handler wait for a lock its own thread holds: the
process hangs for good. Seen in CI: a learner SIGTERMed mid-step never logged its hand-over and was killed after
60 s; a loop of `Event.wait(0)` with a 0.5 ms timer calling `set()` hangs within its first few hundred rounds
(tests/trainer/test_stop_flag.py). The Python docs say it too: locks must not be used within signal handlers.

This flag takes no lock: `set()` stores a bool and writes one byte to a pipe (os.write is async-signal-safe),
`wait()` selects on the pipe's other end, which stays readable once written, for every waiter, in any thread.
"""

from __future__ import annotations

import os
import select


class StopFlag:
    """`set` (also from a signal handler), `is_set`, `wait(timeout)`: the subset of `threading.Event` the learner uses,
    with the reason of the first `set` kept for the log (the handler itself must not log: logging takes locks)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # one byte is ever written; never block a signal handler regardless
        self._set = self._closed = False
        self.reason: str | None = None

    def set(self, reason: str | None = None) -> None:
        if self._set:
            return
        self.reason = reason
        self._set = True
        if self._closed:  # its descriptors' numbers may belong to another file by now
            return
        try:
            os.write(self._write, b"x")
        except OSError:  # full (cannot be: one byte is ever written): the bool is what counts
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or `timeout` seconds have passed; returns whether it is set."""
        if self._set:
            return True
        if timeout is not None and timeout <= 0:
            return False
        if not self._closed:
            select.select([self._read], [], [], timeout)
        return self._set

    def close(self) -> None:
        """Release the pipe (a handler still installed may `set` afterwards: only the bool changes then)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
