"""A keyed work queue for reconciles (no Kubernetes in it): one pass per key at a time, duplicates coalesce, a key
added during its own pass runs once more after it, a failed pass is retried with backoff, every known key is
re-run each resync."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from diloco_operator import metrics

Key = tuple[str, str, str]  # (kind, namespace, name): the kind labels the metrics
log = logging.getLogger("diloco_operator")
BACKOFF_FIRST_S = 0.5  # a failed pass is retried after this, doubled each failure in a row ...
BACKOFF_MAX_S = 30.0  # ... up to this


def backoff(failures: int) -> float:
    """Seconds before the retry after `failures` failed passes in a row."""
    return min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)


class WorkQueue:
    """Runs `process(key)` for queued keys on `workers` tasks. `gives_up(key, exc)`: an error after which the key is
    forgotten rather than retried. `on_resync()` runs before each resync re-queues every known key."""

    def __init__(self, process: Callable[[Key], Awaitable[None]], workers: int = 4, resync_s: float = 30.0,
                 gives_up: Callable[[Key, Exception], bool] = lambda key, exc: False,
                 on_resync: Callable[[], None] = lambda: None):
        self.process, self.gives_up, self.on_resync = process, gives_up, on_resync
        self.workers = workers
        self.resync_s = resync_s
        self.queue: asyncio.Queue[Key] = asyncio.Queue()
        self.queued: set[Key] = set()  # waiting in `queue`
        self.active: set[Key] = set()  # being processed
        self.dirty: set[Key] = set()  # added while being processed: run again once that pass ends
        self.known: set[Key] = set()  # re-queued by every resync until forgotten
        self.failures: dict[Key, int] = {}  # failed passes in a row

    def add(self, key: Key, delay: float = 0.0) -> None:
        """Ask for a pass over `key` (now or after `delay` seconds); duplicates coalesce."""
        self.known.add(key)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.add, key)
            return
        if key in self.active:
            self.dirty.add(key)  # re-run once the current pass ends: it may have read stale state
        elif key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)
        metrics.QUEUE_DEPTH.set(self.queue.qsize())

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
        # A safety net: even if a watch went quiet, every known key is looked at every resync_s.
        while True:
            await asyncio.sleep(self.resync_s)
            metrics.RESYNCS.inc()
            self.on_resync()
            for key in list(self.known):
                self.add(key)

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            metrics.QUEUE_DEPTH.set(self.queue.qsize())  # it stayed at the last add's size until the next one
            self.queued.discard(key)
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
