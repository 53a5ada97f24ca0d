"""The learner's link to the syncer: what goes over it (Bootstrap, Submission, Answer, FragmentUpdate) and the
`SyncerLink` protocol the learner loop uses, implemented by client.SyncerClient (one syncer) and
sharded_client.ShardedSyncerClient (N shards). No I/O here, and no aiohttp."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from diloco_trainer.learner.stop_flag import StopFlag

# The learner's saved Θ: called with the run's config and plan, returns {p: (version, Θ_p)} (inner_state.read_held).
HeldFn = Callable[[dict, list[list[str]]], "dict[int, tuple[int, dict[str, Tensor]]]"]


class SyncerRefused(RuntimeError):
    """The syncer answered but will never accept this learner as configured (e.g. a wrong token)."""


@dataclass
class Bootstrap:
    """What a (re)starting learner pulls before its first step: the run config, plan and all of Θ."""

    config: dict
    plan: list[list[str]]
    versions: dict[int, int]
    heartbeat_s: float
    theta: dict[str, Tensor]
    # When (this process's monotonic clock) the current version of each fragment was published, where the syncer
    # said, and the syncer's average learner step time: what lines this learner's first sends up with the others'.
    published_at: dict[int, float] = field(default_factory=dict)
    step_s: float | None = None


@dataclass
class Submission:
    """One compressed outer gradient for a fragment; a resend of the same Δ-from-base reuses `submission_id`."""

    fragment: int
    base_version: int
    submission_id: str
    body: bytes
    c_steps: int
    c_tokens: int
    # Built from a previous incarnation's snapshot (its nonce, its base): a "duplicate" answer then means that
    # incarnation's own send got there first, and its counters are that incarnation's to book, not this one's.
    recovered: bool = False


@dataclass
class Answer:
    """The syncer's final answer to a submission: accepted (2xx; `c_steps`/`c_tokens` are the counters it
    holds) or rejected (4xx; 409 = base version too old). Retried failures never produce an Answer."""

    fragment: int
    base_version: int
    submission_id: str
    status: int
    c_steps: int
    c_tokens: int
    duplicate: bool = False
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300


@dataclass
class FragmentUpdate:
    """A newer global version of a fragment, fetched and waiting to be adopted."""

    fragment: int
    version: int
    tensors: dict[str, Tensor]
    # Adopt even if not newer: the learner trained from a saved version its shard no longer has (sharded_client.py)
    rewind: bool = False


class SyncerLink(Protocol):
    """What the learner loop needs of its link to the syncer. Every method is thread-safe and never blocks, except
    `bootstrap` (until the syncer answers or `stop_flag` is set) and `close` (up to `drain_s`)."""

    def bootstrap(self, stop_flag: StopFlag | threading.Event | None = None, held: HeldFn | None = None) -> Bootstrap:
        """Register and pull Θ, then start syncing. `held` gives the learner's saved Θ, which a sharded link may
        train from while a shard is away (a single syncer has nothing to start without)."""

    def submit(self, sub: Submission) -> bool:
        """Queue a submission; a queued, unsent one with the same id is replaced (it is superseded). False, and
        nothing queued, when one with that id may already have reached the syncer, or was acknowledged."""

    def take_updates(self) -> list[FragmentUpdate]:
        """Newer fragment versions fetched since the last call (one per fragment, the newest)."""

    def take_answers(self) -> list[Answer]:
        """The syncer's answers (acknowledgements and rejections) received since the last call."""

    def report(self, step: int, step_time_s: float, tokens: int, incarnation: str | None = None,
               steps_discarded: int = 0) -> None:
        """Progress the next heartbeat carries (the latest values win), with this life's id (the nonce of its
        submission ids) and the fragment-steps its adoptions discarded."""

    def pending(self) -> int:
        """Submissions not yet answered by the syncer."""

    def snapshot(self) -> dict:
        """Counters for metrics.jsonl and /metrics: the fields of protocol.messages.LinkCounters."""

    def close(self, drain_s: float = 0.0) -> bool:
        """Wait up to `drain_s` for queued submissions to be answered, then stop; True if nothing was left."""
