"""The learner's client of a sharded syncer: one SyncerClient per shard (`--syncer URL0,URL1,...`, in shard order),
each with its own outbox, retries, poller and heartbeat, so a dead shard holds up only the fragments it owns.

Submissions go to the shard that owns their fragment (shardmap.py); updates, answers and counters are merged.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .client import Answer, Bootstrap, FragmentUpdate, Submission, SyncerClient, SyncerRefused
from .shardmap import shard_of


class ShardedSyncerClient:
    """The SyncerClient interface the learner uses, over N syncer shards."""

    def __init__(self, urls: list[str], token: str, learner_id: str, **kwargs):
        self.shards = [SyncerClient(url, token, learner_id, shard=i, shards=len(urls), **kwargs)
                       for i, url in enumerate(urls)]
        self.num_fragments = 0  # known after bootstrap

    def bootstrap(self, stop_flag: threading.Event | None = None) -> Bootstrap:
        """Register with every shard at once and pull the fragments each owns; returns the union. Waits for every
        shard: a learner cannot start without all of Θ."""
        stop_flag = stop_flag or threading.Event()
        boots = [f.result() for f in [c.start_bootstrap(stop_flag) for c in self.shards]]
        first = boots[0]
        for i, b in enumerate(boots[1:], start=1):
            if b.config != first.config or b.plan != first.plan:
                raise SyncerRefused(f"syncer shards 0 and {i} serve different runs (config or fragment plan differ): "
                                    "start every shard with the same --config")
        self.num_fragments = len(first.plan)
        theta, versions = {}, {}
        for b in boots:
            theta |= b.theta
            versions |= b.versions
        assert sorted(versions) == list(range(self.num_fragments)), versions
        return Bootstrap(first.config, first.plan, dict(sorted(versions.items())),
                         min(b.heartbeat_s for b in boots), theta)

    def _client_of(self, fragment: int) -> SyncerClient:
        return self.shards[shard_of(fragment, self.num_fragments, len(self.shards))]

    def submit(self, sub: Submission) -> None:
        self._client_of(sub.fragment).submit(sub)

    def take_updates(self) -> list[FragmentUpdate]:
        return sorted((u for c in self.shards for u in c.take_updates()), key=lambda u: u.fragment)

    def take_answers(self) -> list[Answer]:
        return [a for c in self.shards for a in c.take_answers()]

    def report(self, step: int, step_time_s: float, tokens: int) -> None:
        for c in self.shards:
            c.report(step, step_time_s, tokens)

    def pending(self) -> int:
        return sum(c.pending() for c in self.shards)

    def snapshot(self) -> dict:
        """Counters summed over the shards; syncer_up only while every shard answers (shards_up counts them)."""
        snaps = [c.snapshot() for c in self.shards]
        total = {k: sum(s[k] for s in snaps) for k, v in snaps[0].items() if not isinstance(v, bool)}
        total["syncer_up"] = all(s["syncer_up"] for s in snaps)
        total["shards_up"] = sum(s["syncer_up"] for s in snaps)
        return total

    def close(self, drain_s: float = 0.0) -> bool:
        """Wait up to `drain_s` (in all) for every shard's queued submissions to be answered, then stop them all."""
        deadline = time.monotonic() + drain_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        drained = [c.close(0.0) for c in self.shards]
        return all(drained)


def make_client(urls: list[str], token: str, learner_id: str, *, ca: Path | None = None,
                **kwargs) -> SyncerClient | ShardedSyncerClient:
    """A SyncerClient for one syncer, a ShardedSyncerClient for several shards."""
    if len(urls) == 1:
        return SyncerClient(urls[0], token, learner_id, ca=ca, **kwargs)
    return ShardedSyncerClient(urls, token, learner_id, ca=ca, **kwargs)
