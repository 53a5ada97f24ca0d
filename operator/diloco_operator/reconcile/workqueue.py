"""A keyed work queue for reconciles (no Kubernetes in it): one pass per key at a time, duplicates coalesce, a key
added during its own pass runs once more after it, a failed pass is retried with backoff, every known key is
re-run each resync (fed at a bounded rate), and a key something happened to goes ahead of the resync's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from diloco_operator import metrics

Key = tuple[str, str, str]  # (kind, namespace, name): the kind labels the metrics
log = logging.getLogger("diloco_operator")
BACKOFF_FIRST_S = 0.5  # a failed pass is retried after this, doubled each failure in a row ...
BACKOFF_MAX_S = 30.0  # ... up to this
# A resync feeds the known units to the routine lane at most this many a second, so their period grows with them
# (5,000 units: every one looked at every ~250 s instead of every resync_s). Measured at 5,000 units, resync 5 s
# (issue 19, docs/operator.md "Scale benchmark"): queueing all of them at once kept 0.317 cores of the operator on
# passes with nothing to do, the feed 0.105, and up to 5,029 such passes ran while 20 deleted pods were replaced
# instead of 73-100. Watches drive the work; the resync is a safety net (controller-runtime's default: 10 hours).
RESYNC_PASSES_PER_S = 20.0
FEED_TICK_S = 1.0  # the feed adds a tick's worth of keys at once: up to 20 objects go in one batch, as before


def backoff(failures: int) -> float:
    """Seconds before the retry after `failures` failed passes in a row."""
    return min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)


class WorkQueue:
    """Runs `process(key)` for queued keys on `workers` tasks. `gives_up(key, exc)`: an error after which the key is
    forgotten rather than retried. `on_resync()` runs before each resync re-queues every known key: the jobs at once
    (and every resync_s while the feed lasts), the units at most `resync_rate` a second; the next resync starts
    `resync_s` after this one started or once its feed ended, whichever is later.

    Two lanes: keys added for a reason (a watch event, a requeue, a retry) are urgent and taken first; the resync's
    are routine. At thousands of units a resync queues every one of them, and a deleted pod's unit must not wait
    behind passes that find nothing to do (issue 19: healing at 5,000 units). An urgent add of a key waiting in
    the routine lane moves it to the urgent one."""

    def __init__(self, process: Callable[[Key], Awaitable[None]], workers: int = 4, resync_s: float = 30.0,
                 gives_up: Callable[[Key, Exception], bool] = lambda key, exc: False,
                 on_resync: Callable[[], None] = lambda: None, resync_rate: float = RESYNC_PASSES_PER_S):
        self.process, self.gives_up, self.on_resync = process, gives_up, on_resync
        self.workers = workers
        self.resync_s, self.resync_rate = resync_s, resync_rate
        self.lanes: dict[bool, deque[Key]] = {True: deque(), False: deque()}  # urgent?; may hold stale entries
        self.entries = asyncio.Semaphore(0)  # one per entry in the lanes, stale ones included
        self.queued: dict[Key, bool] = {}  # waiting, and in which lane (True: urgent)
        self.active: set[Key] = set()  # being processed
        self.dirty: set[Key] = set()  # added while being processed: run again once that pass ends
        self.known: set[Key] = set()  # re-queued by every resync until forgotten
        self.failures: dict[Key, int] = {}  # failed passes in a row

    def add(self, key: Key, delay: float = 0.0, urgent: bool = True) -> None:
        """Ask for a pass over `key` (now or after `delay` seconds); duplicates coalesce. `urgent`: something
        happened to it (the resync's own adds are not)."""
        self.known.add(key)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.add, key)
            return
        if key in self.active:
            self.dirty.add(key)  # re-run once the current pass ends: it may have read stale state
        elif key not in self.queued or (urgent and not self.queued[key]):
            self.queued[key] = urgent  # a routine entry left behind by a move to the urgent lane is skipped
            self.lanes[urgent].append(key)
            self.entries.release()
        metrics.QUEUE_DEPTH.set(len(self.queued))

    def depth(self) -> int:
        """Keys waiting for a pass."""
        return len(self.queued)

    async def _next(self) -> Key:
        """The next key to process: urgent ones first, each in the order added."""
        while True:
            await self.entries.acquire()
            urgent = bool(self.lanes[True])
            key = self.lanes[urgent].popleft()
            if self.queued.get(key) is urgent:
                del self.queued[key]
                return key

    def forget(self, key: Key) -> None:
        """No more resyncs of `key` (until it is added again)."""
        self.known.discard(key)

    def known_of(self, kind: str) -> list[Key]:
        return [k for k in self.known if k[0] == kind]

    async def run(self) -> None:
        """Run the workers and the resync loop until cancelled."""
        tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        tasks.append(asyncio.create_task(self._resync()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _resync(self) -> None:
        # A safety net: even if a watch went quiet, every known key is looked at every resync_s (units: or as fast as
        # the rate lets a resync feed them all; jobs, a few, every resync_s regardless). The count goes up once a
        # resync has queued every key.
        fed_s = 0.0
        while True:
            await asyncio.sleep(max(0.0, self.resync_s - fed_s))
            started = time.monotonic()
            self.on_resync()
            await self._feed([k for k in self.known if k[0] != "job"])
            metrics.RESYNCS.inc()
            fed_s = time.monotonic() - started

    async def _feed(self, keys: list[Key]) -> None:
        """The jobs, then `keys` a tick's worth (`resync_rate` × FEED_TICK_S) at a time, into the routine lane; the
        jobs again every resync_s while it lasts. A key forgotten meanwhile is skipped."""
        jobs_at = time.monotonic()
        self._add_routine(self.known_of("job"))
        batch = max(1, int(self.resync_rate * FEED_TICK_S))
        for i in range(0, len(keys), batch):
            if i:
                await asyncio.sleep(FEED_TICK_S)
                if time.monotonic() - jobs_at >= self.resync_s:
                    jobs_at = time.monotonic()
                    self._add_routine(self.known_of("job"))
            self._add_routine(k for k in keys[i:i + batch] if k in self.known)

    def _add_routine(self, keys) -> None:
        for key in keys:
            self.add(key, urgent=False)

    async def _worker(self) -> None:
        while True:
            key = await self._next()
            metrics.QUEUE_DEPTH.set(len(self.queued))  # it stayed at the last add's size until the next one
            self.active.add(key)
            started = time.monotonic()
            try:
                await self.process(key)
                self.failures.pop(key, None)
                metrics.RECONCILES.labels(key[0], "ok").inc()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed pass is retried with backoff, never fatal
                if self.gives_up(key, exc):
                    self.forget(key)
                    continue
                n = self.failures[key] = self.failures.get(key, 0) + 1
                delay = backoff(n)
                log.warning("reconcile %s failed (%r), retry %d in %.1fs", key, exc, n, delay)
                metrics.RECONCILES.labels(key[0], "error").inc()
                self.add(key, delay)
            finally:
                metrics.RECONCILE_SECONDS.labels(key[0]).observe(time.monotonic() - started)
                self.active.discard(key)
                if key in self.dirty:
                    self.dirty.discard(key)
                    self.add(key)
