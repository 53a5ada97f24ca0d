"""The learner's client of a sharded syncer: one SyncerClient per shard (`--syncer URL0,URL1,...`, in shard order),
each with its own outbox, retries, poller and heartbeat, so a dead shard holds up only the fragments it owns.

Submissions go to the shard that owns their fragment (shardmap.py); updates, answers and counters are merged. A
restarted learner that saved Θ for a dead shard's fragments starts without that shard (docs/protocol.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from pathlib import Path

from torch import Tensor

from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.learner.link import Answer, Bootstrap, FragmentUpdate, HeldFn, Submission, SyncerLink, SyncerRefused
from diloco_trainer.learner.stop_flag import StopFlag
from diloco_trainer.protocol.shardmap import owned_fragments, shard_of

log = logging.getLogger(__name__)

POLL_S = 0.2
LOG_FIRST_S, LOG_EVERY_S = 3.0, 15.0  # the first "waiting for shard" line, then one every so often
# A shard that has not answered within this long counts as away even if its first attempt has not failed yet (a
# connection to a gone pod may hang until its connect timeout).
ANSWER_GRACE_S = 5.0


class ShardedSyncerClient:
    """The learner's SyncerLink over N syncer shards."""

    def __init__(self, urls: list[str], token: str, learner_id: str, **kwargs):
        self.shards = [SyncerClient(url, token, learner_id, shard=i, shards=len(urls), **kwargs)
                       for i, url in enumerate(urls)]
        self.num_fragments = 0  # known after bootstrap
        self._lock = threading.Lock()
        self._failure: Exception | None = None  # why such a shard cannot be used (raised in the learner's loop)

    def bootstrap(self, stop_flag: StopFlag | threading.Event | None = None, held: HeldFn | None = None) -> Bootstrap:
        """Register with every shard at once and pull the fragments each owns; returns the union.

        Waits for every shard, logging which ones it waits for, unless `held` (called once with the first answer's
        config and plan) returns the learner's saved {p: (version, Θ_p)} for every fragment of each shard still
        away: then it returns at once with those values, and each such shard is registered with in the background
        when it answers; its versions then come as updates (`take_updates`). At least one shard must answer: the
        config and plan come from the syncer."""
        stop_flag = stop_flag or threading.Event()
        futures = [c.start_bootstrap(stop_flag) for c in self.shards]
        started, next_log, saved = time.monotonic(), time.monotonic() + LOG_FIRST_S, None
        while True:
            done = [i for i, f in enumerate(futures) if f.done()]
            if len(done) == len(futures):
                break
            if done and saved is None:
                first = futures[done[0]].result()
                saved = held(first.config, first.plan) if held is not None else {}
                self.num_fragments = len(first.plan)
            away = [i for i in range(len(futures)) if i not in done]
            if done and self._covered(away, saved) and all(
                    self.shards[i].bootstrap_failures or time.monotonic() - started > ANSWER_GRACE_S for i in away):
                boot = self._start_without(away, futures, saved)
                if boot is not None:
                    return boot
                continue
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + LOG_EVERY_S
                self._log_waiting(away, saved)
            if stop_flag.is_set():
                raise InterruptedError("stopped while waiting for the syncer")
            concurrent.futures.wait([futures[i] for i in away], timeout=POLL_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        boots = [f.result() for f in futures]
        self.num_fragments = len(boots[0].plan)
        return self._union(boots)

    def _union(self, boots: list[Bootstrap], saved: dict[int, tuple[int, dict[str, Tensor]]] | None = None
               ) -> Bootstrap:
        """One Bootstrap of the shards' answers `boots` and the `saved` values of the fragments no answer has."""
        self._check_same_run(boots)
        theta, versions, published = {}, {}, {}
        for b in boots:
            theta |= b.theta
            versions |= b.versions
            published |= b.published_at
        for p, (version, tensors) in (saved or {}).items():
            theta |= tensors
            versions[p] = version
        assert sorted(versions) == list(range(self.num_fragments)), versions
        return Bootstrap(boots[0].config, boots[0].plan, dict(sorted(versions.items())),
                         min(b.heartbeat_s for b in boots), theta, published,
                         next((b.step_s for b in boots if b.step_s), None))

    def _owned(self, shard: int) -> list[int]:
        return owned_fragments(shard, self.num_fragments, len(self.shards))

    def _covered(self, away: list[int], saved: dict | None) -> bool:
        return saved is not None and all(p in saved for i in away for p in self._owned(i))

    def _log_waiting(self, away: list[int], saved: dict | None) -> None:
        """One line naming the shards (and URLs) the learner waits for, and why it cannot start without them."""
        names = ", ".join(f"{i} ({self.shards[i].url})" for i in away)
        if saved is None:
            why = "no shard has answered yet (the run's config and plan come from the syncer)"
        else:
            missing = sorted(p for i in away for p in self._owned(i) if p not in saved)
            why = (f"this learner holds no saved values of fragment(s) {missing} (a learner cannot train without "
                   "them)" if missing else "its saved values will be used once the shard has had a moment to answer")
        log.warning("waiting for syncer shard%s %s of %d: %s", "s" if len(away) > 1 else "", names,
                    len(self.shards), why)

    def _start_without(self, away: list[int], futures: list[concurrent.futures.Future],
                       saved: dict[int, tuple[int, dict[str, Tensor]]]) -> Bootstrap | None:
        """The Bootstrap of the shards that answered plus the saved values of the fragments of those `away`; each
        shard away hands its versions over as updates when its bootstrap completes (SyncerClient.hold). None when
        one of them completed meanwhile (the caller looks again)."""
        held = {i: {p: saved[p][0] for p in self._owned(i)} for i in away}
        holding = [i for i in away if self.shards[i].hold(held[i])]
        if len(holding) < len(away):
            for i in holding:
                self.shards[i].hold(None)
            return None
        boots = [futures[i].result() for i in range(len(futures)) if i not in away]
        for i in away:
            log.warning("syncer shard %d (%s) is away: training fragment(s) %s from the saved version(s) %s; "
                        "registering with it in the background", i, self.shards[i].url, sorted(held[i]), held[i])
            futures[i].add_done_callback(lambda f: self._late_boot(f, boots[0]))
        return self._union(boots, {p: saved[p] for i in away for p in held[i]})

    def _late_boot(self, future: concurrent.futures.Future, first: Bootstrap) -> None:
        """A shard answered after the learner started without it (its versions are in its client's updates): a
        failure, or a shard of another run, is raised in the learner's loop by `take_updates`."""
        try:
            self._check_same_run([first, future.result()])
        except (concurrent.futures.CancelledError, InterruptedError):
            pass  # the learner stopped first
        except Exception as exc:  # noqa: BLE001 - handed to the learner's loop
            with self._lock:
                self._failure = exc

    @staticmethod
    def _check_same_run(boots: list[Bootstrap]) -> None:
        first = boots[0]
        for b in boots[1:]:
            if b.config != first.config or b.plan != first.plan:
                raise SyncerRefused("syncer shards serve different runs (config or fragment plan differ): start "
                                    "every shard with the same --config")

    def _client_of(self, fragment: int) -> SyncerClient:
        return self.shards[shard_of(fragment, self.num_fragments, len(self.shards))]

    def submit(self, sub: Submission) -> bool:
        return self._client_of(sub.fragment).submit(sub)

    def take_updates(self) -> list[FragmentUpdate]:
        """Newer versions from every shard (SyncerRefused when a shard that answered late cannot be used)."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
        return sorted((u for c in self.shards for u in c.take_updates()), key=lambda u: u.fragment)

    def take_answers(self) -> list[Answer]:
        return [a for c in self.shards for a in c.take_answers()]

    def report(self, step: int, step_time_s: float, tokens: int, incarnation: str | None = None,
               steps_discarded: int = 0) -> None:
        for c in self.shards:
            c.report(step, step_time_s, tokens, incarnation, steps_discarded)

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


def make_client(urls: list[str], token: str, learner_id: str, *, ca: Path | None = None, **kwargs) -> SyncerLink:
    """A SyncerClient for one syncer, a ShardedSyncerClient for several shards."""
    if len(urls) == 1:
        return SyncerClient(urls[0], token, learner_id, ca=ca, **kwargs)
    return ShardedSyncerClient(urls, token, learner_id, ca=ca, **kwargs)
