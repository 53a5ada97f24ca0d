"""Writes a learner's snapshots (data position, inner state, unsent work) on a background thread, one at a time, so
a snapshot costs the step only the copy of its tensors; what each costs is counted for the metrics record."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


# The snapshots' copies on the step may take at most this share of the training time: with a small model a snapshot
# after every step costs under 1% (docs/benchmarks.md, "Harsh failures"); a large one's copy of its unsent fragments (on a
# GPU, device to host) would cost far more per step, and is then taken only every few steps.
CAPTURE_BUDGET = 0.03


def within_budget(capture_s: float, train_s: float, budget: float = CAPTURE_BUDGET) -> bool:
    """Whether another snapshot may be captured on the step: the seconds spent capturing so far are within `budget`
    of the seconds trained so far."""
    return capture_s <= budget * train_s


class SnapshotWriter:
    """One background writer thread. `submit(write)` hands it a captured snapshot's write (a callable doing the
    encoding and the atomic file replacements); `busy()` says one is still being written, and the learner captures
    the next only when it is not, so snapshots never queue up and the newest one on disk is at most one write old.
    `wait()` blocks until everything submitted is on disk. A failed write is logged and counted, never raised: a
    snapshot is best effort (the next one replaces it)."""

    def __init__(self) -> None:
        self._job: Callable[[], None] | None = None
        self._writing = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.failed = 0
        self.capture_s = 0.0  # on the step: copying the tensors (the caller adds it, `captured`)
        self.write_s = 0.0  # in the background: encoding and writing

    def busy(self) -> bool:
        with self._cond:
            return self._job is not None or self._writing

    def captured(self, seconds: float) -> None:
        """Count `seconds` the step spent capturing a snapshot."""
        self.capture_s += seconds

    def submit(self, write: Callable[[], None]) -> None:
        """Write in the background (replacing a submitted write not yet started: the newer snapshot wins)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the snapshot writer is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
                self._thread.start()
            self._job = write
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is submitted or being written (True), or `timeout` seconds (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._job is None and not self._writing, timeout)

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> dict:
        """Snapshots written by this incarnation and their mean seconds on the step and in the background."""
        n = self.written + self.failed
        return {"snapshots": self.written, "snapshot_capture_s": self.capture_s / n if n else None,
                "snapshot_write_s": self.write_s / n if n else None}

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                job, self._job, self._writing = self._job, None, True
            started = time.monotonic()
            try:
                job()
                ok = True
            except Exception:  # noqa: BLE001 - best effort: logged, and the next snapshot replaces it
                log.exception("writing a snapshot failed")
                ok = False
            with self._cond:
                self.write_s += time.monotonic() - started
                self.written += ok
                self.failed += not ok
                self._writing = False
                self._cond.notify_all()
