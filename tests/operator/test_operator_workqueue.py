"""The reconcile work queue on its own (no cluster): duplicates coalesce, a key added during its own pass runs once
more after it, a failed pass is retried with backoff, an error it gives up on forgets the key, and a key something
happened to goes ahead of a resync's keys."""

from __future__ import annotations

import asyncio

from diloco_operator.reconcile.workqueue import WorkQueue, backoff

from polling import wait_for_async

A, B = ("job", "ns", "a"), ("unit", "ns", "b")


def run_queue(process, body, **kwargs) -> None:
    async def go() -> None:
        queue = WorkQueue(process, workers=2, resync_s=3600, **kwargs)
        runner = asyncio.create_task(queue.run())
        try:
            await body(queue)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    asyncio.run(go())


def test_keys_added_before_a_worker_runs_are_processed_once_each():
    seen: list = []

    async def process(key):
        seen.append(key)

    async def body(queue: WorkQueue) -> None:
        for key in (A, B, A, A, B):
            queue.add(key)
        assert queue.depth() == 2  # no worker has run yet: the duplicates coalesced
        await wait_for_async(lambda: len(seen) >= 2 and not queue.active, 5, "both keys processed")
        assert sorted(seen) == sorted([A, B]) and queue.depth() == 0
    run_queue(process, body)


def test_a_key_added_during_its_pass_runs_once_more_after_it_never_twice_at_once():
    passes, running, overlap = [], set(), []

    async def body(queue: WorkQueue) -> None:
        gate = asyncio.Event()

        async def process(key):
            overlap.append(key in running)
            running.add(key)
            passes.append(key)
            if len(passes) == 1:
                await gate.wait()
            running.discard(key)
        queue.process = process
        queue.add(A)
        await wait_for_async(lambda: A in queue.active, 5, "the first pass started")
        queue.add(A)
        queue.add(A)  # coalesces with the one before: a single re-run
        gate.set()
        await wait_for_async(lambda: len(passes) == 2 and not queue.active, 5, "the re-run ended")
        assert overlap == [False, False] and not queue.dirty
    run_queue(None, body)


def test_a_failed_pass_is_retried_with_backoff_and_a_given_up_key_is_forgotten():
    calls: list = []

    async def process(key):
        calls.append(key)
        if key == A and len([k for k in calls if k == A]) == 1:
            raise RuntimeError("first pass fails")
        if key == B:
            raise LookupError("namespace going away")

    async def body(queue: WorkQueue) -> None:
        queue.add(A)
        queue.add(B)
        await wait_for_async(lambda: calls.count(A) == 2, 5, "the retry of the failed pass")
        assert A in queue.known and A not in queue.failures  # the retry succeeded: the count starts over
        assert calls.count(B) == 1 and B not in queue.known  # given up on: never retried or resynced
    run_queue(process, body, gives_up=lambda key, exc: isinstance(exc, LookupError))
    assert [backoff(n) for n in (1, 2, 3, 8, 20)] == [0.5, 1.0, 2.0, 30.0, 30.0]


def test_a_key_something_happened_to_goes_ahead_of_a_resyncs_thousand_keys_and_each_key_runs_once():
    seen: list = []
    routine = [("unit", "ns", f"u{i}") for i in range(1000)]
    hurt, new = ("unit", "ns", "u700"), ("job", "ns", "new")  # u700 waits in the resync's lane when its pod is deleted

    async def process(key):
        seen.append(key)
        await asyncio.sleep(0)

    async def go() -> None:
        queue = WorkQueue(process, workers=1, resync_s=3600)
        for key in routine:
            queue.add(key, urgent=False)  # as the resync adds them
        queue.add(hurt)
        queue.add(new)
        queue.add(routine[0], urgent=False)  # a resync's duplicate coalesces
        assert queue.depth() == 1001
        runner = asyncio.create_task(queue.run())  # one worker: the order it takes keys in is the queue's alone
        try:
            await wait_for_async(lambda: len(seen) >= 1001 and not queue.active, 10, "every key processed")
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        assert seen[:2] == [hurt, new], seen[:5]
        assert seen[2:] == [k for k in routine if k != hurt], "each key once, the resync's in the order added"
        assert queue.depth() == 0 and not queue.lanes[True] and not queue.lanes[False]
    asyncio.run(go())


def test_a_resync_feeds_units_at_the_rate_and_jobs_every_period_so_a_large_one_spreads_over_seconds():
    """5,000 units queued at once every resync kept the operator's CPU on passes with nothing to do (issue 19): a
    resync feeds the routine lane `resync_rate` units a second (a tick's worth at a time); its jobs go first, and
    again every resync_s while the feed lasts."""
    seen: list[tuple[float, tuple]] = []
    units = [("unit", "ns", f"u{i:03d}") for i in range(120)]
    job = ("job", "ns", "j")

    async def process(key):
        seen.append((asyncio.get_running_loop().time(), key))

    async def go() -> None:
        queue = WorkQueue(process, workers=2, resync_s=0.05, resync_rate=50)
        for key in units + [job]:
            queue.known.add(key)  # known, as after their first passes; nothing urgent
        runner = asyncio.create_task(queue.run())
        try:
            await wait_for_async(lambda: len([k for _, k in seen if k != job]) >= 120, 10, "one resync's 120 units")
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        unit_passes = [i for i, (_, k) in enumerate(seen) if k != job]
        first_resync = seen[:unit_passes[119] + 1]  # the next resync starts at once: its feed took over resync_s
        t0 = first_resync[0][0]
        assert first_resync[0][1] == job  # the job first, ahead of its units
        ticks = [[k for t, k in first_resync if lo <= t - t0 < hi] for lo, hi in ((0, .5), (.5, 1.5), (1.5, 2.5))]
        assert [len([k for k in tick if k != job]) for tick in ticks] == [50, 50, 20], [len(t) for t in ticks]
        assert all(job in tick for tick in ticks)  # the job again each tick: its resync_s (0.05 s) had passed
        assert sorted(k for _, k in first_resync if k != job) == sorted(units)  # each unit once
    asyncio.run(go())
