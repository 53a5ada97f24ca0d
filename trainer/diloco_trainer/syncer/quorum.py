"""When the syncer merges a fragment: minimum quorum K, then an adaptive grace window sized from the
learners' step time (a median, clamped to what the syncer observes) and EMAs of quorum and sync times. Torch-free,
and every time is passed in, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math


def _seconds(x: float, what: str) -> float:
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be a finite, non-negative number of seconds, got {x}")
    return x


def robust_step_time(learners: list[tuple[float, float | None]]) -> float | None:
    """The learners' inner-step time from (reported, observed) per learner: the lower median over learners of
    min(reported, observed), observed None while unknown. None without learners.

    Decision: a median, not an average, so one learner's report cannot move it beyond the honest ones' (the lower
    median: with two learners, the smaller); clamped to what the syncer observed between that learner's
    submissions, so a learner alone cannot claim to be slower than it submits."""
    values = sorted(min(_seconds(r, "step time"), math.inf if o is None else _seconds(o, "observed step time"))
                    for r, o in learners)
    return values[(len(values) - 1) // 2] if values else None


class Ema:
    """Exponential moving average; the first observation initializes it."""

    def __init__(self, alpha: float):
        if not 0 < alpha <= 1:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> float:
        """Fold in one observation and return the new average."""
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"EMA observation must be finite, got {x}")
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value


class MergePolicy:
    """Quorum + grace-window decisions for one syncer (the EMAs are shared by all fragments).

    Times: ξ_step = learner inner-step time (from heartbeats), ξ_quorum = time from a fragment's first pending
    contribution to its quorum, ξ_sync = merge + publish time. The grace window after quorum is
    γ · max(0, τ·ξ_step − (ξ_quorum + ξ_sync)): the slack the overlap τ leaves before learners expect the
    merged fragment back. Until all three have a value the window is 0 (merge at quorum); it is never longer than
    max_grace_s. The syncer sets ξ_step from the learners' heartbeats with set_step_time (robust_step_time).
    """

    def __init__(self, quorum: int, grace: float, overlap: int, alpha: float = 0.2, max_grace_s: float = math.inf):
        if not isinstance(quorum, int) or quorum < 1:
            raise ValueError(f"quorum (K) must be an integer >= 1, got {quorum!r}")
        if not 0 <= grace < 1:
            raise ValueError(f"grace (gamma) must be in [0, 1), got {grace}")
        if not isinstance(overlap, int) or overlap < 0:
            raise ValueError(f"overlap (tau) must be an integer >= 0, got {overlap!r}")
        self.quorum = quorum
        self.grace = grace
        self.overlap = overlap
        if not max_grace_s > 0:
            raise ValueError(f"max_grace_s must be > 0, got {max_grace_s}")
        self.max_grace_s = max_grace_s
        self.step_time = Ema(alpha)
        self.quorum_time = Ema(alpha)
        self.sync_time = Ema(alpha)

    def observe_step_time(self, seconds: float) -> None:
        self.step_time.update(_seconds(seconds, "step time"))

    def set_step_time(self, seconds: float) -> None:
        """Set ξ_step to a value computed over the learners (robust_step_time), replacing the average."""
        self.step_time.value = _seconds(seconds, "step time")

    def observe_quorum_time(self, seconds: float) -> None:
        """Record quorum_reached_at − first_pending_at of one fragment when it reaches quorum."""
        self.quorum_time.update(_seconds(seconds, "quorum time"))

    def observe_sync_time(self, seconds: float) -> None:
        """Record how long one merge + publish took."""
        self.sync_time.update(_seconds(seconds, "sync time"))

    def grace_seconds(self) -> float:
        """Length of the grace window after quorum: γ·max(0, τ·ξ_step − (ξ_quorum + ξ_sync)), at most max_grace_s;
        0 while unknown."""
        step, quorum, sync = self.step_time.value, self.quorum_time.value, self.sync_time.value
        if self.grace == 0 or step is None or quorum is None or sync is None:
            return 0.0
        return min(self.max_grace_s, self.grace * max(0.0, self.overlap * step - (quorum + sync)))

    def decide(self, n_pending_learners: int, first_pending_at: float | None, quorum_reached_at: float | None,
               now: float, n_live: int | None = None) -> float | None:
        """None: no quorum yet, keep collecting; 0.0: merge now; > 0: seconds left in the grace window.

        n_live: learners currently alive, counting every learner with a pending contribution as alive
        (pass |live ∪ pending|), or None when unknown.

        Edge cases (decisions):
        - When every known live learner already has a contribution pending (n_pending >= n_live), merge at
          once: nobody else can join, so the grace window would only add latency. This also holds when fewer
          than K learners are alive, so a dead learner never stops merging (effective quorum = min(K, n_live)).
        - quorum_reached_at None with quorum met means quorum is reached at this call: the window starts now
          (the caller records `now` as quorum time and calls again when the returned seconds have passed).
        """
        if n_pending_learners < 0:
            raise ValueError(f"n_pending_learners must be >= 0, got {n_pending_learners}")
        if n_live is not None and n_live < 0:
            raise ValueError(f"n_live must be >= 0, got {n_live}")
        if n_pending_learners == 0:
            return None
        if first_pending_at is None:
            raise ValueError("first_pending_at is required when contributions are pending")
        if first_pending_at > now:
            raise ValueError(f"first_pending_at ({first_pending_at}) is later than now ({now})")
        if n_live is not None and n_pending_learners >= n_live:
            return 0.0
        if n_pending_learners < self.quorum:
            return None
        start = now if quorum_reached_at is None else quorum_reached_at
        if start < first_pending_at:
            raise ValueError(f"quorum_reached_at ({start}) is earlier than first_pending_at ({first_pending_at})")
        remaining = start + self.grace_seconds() - now
        return remaining if remaining > 0 else 0.0

    def state_dict(self) -> dict[str, float | None]:
        """JSON-able EMA values (None while unknown)."""
        return {"step_time": self.step_time.value, "quorum_time": self.quorum_time.value,
                "sync_time": self.sync_time.value}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        values = {}
        for key in ("step_time", "quorum_time", "sync_time"):
            v = state.get(key)
            values[key] = None if v is None else _seconds(v, key)
        for key, v in values.items():
            getattr(self, key).value = v
