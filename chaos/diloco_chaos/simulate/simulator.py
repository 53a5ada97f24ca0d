"""Event-driven goodput simulator: chip failures at scale for data-parallel, elastic data-parallel and
Decoupled DiLoCo. Pure (numpy only). Chips are grouped into slices (failure domains) and failures are one
Poisson process over the whole pool, so millions of chips cost no more than their failure count."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

HOUR = 3600.0
YEAR = 365.0 * 24.0 * HOUR
METHODS = ("dp", "elastic", "decoupled")

# Paper Table 1 (chip MTBI 1 year), for comparison only: the model below never reads it.
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_GOODPUT: dict[tuple[str, int], tuple[float, ...]] = {
    ("dp", 1): (0.72, 0.57, 0.38, 0.27, 0.18),
    ("elastic", 1): (0.88, 0.80, 0.69, 0.58, 0.40),
    ("decoupled", 2): (0.94, 0.88, 0.80, 0.70, 0.54),
    ("decoupled", 4): (0.96, 0.93, 0.89, 0.82, 0.73),
    ("decoupled", 8): (0.98, 0.96, 0.94, 0.88, 0.80),
    ("decoupled", 16): (0.99, 0.98, 0.96, 0.93, 0.86),
}


@dataclass(frozen=True)
class FailureModel:
    """Physical parameters of the cluster and of each method's recovery (defaults: docs/simulator.md)."""

    mtbi_years: float = 1.0          # mean time between interruptions of one chip
    slice_chips: int = 64            # failure domain: one failed chip takes its whole slice out
    return_hours: float = 0.5        # mean (exponential) time until a failed slice is back in service
    detect_s: float = 10.0           # failure -> noticed (collective timeout / missed heartbeats)
    restart_s: float = 64.0          # data-parallel: reschedule on spares + reload in-memory checkpoint
    step_s: float = 1.0              # one training step; a failure loses the step in flight
    checkpoint_steps: int = 1        # data-parallel: steps between (in-memory) checkpoints it restarts from
    downscale_s: float = 8.5         # elastic: rebuild the mesh without the failed slice
    upscale_s: float = 16.0          # elastic: rebuild the mesh with returned slices (no detection)
    upscale_interval_s: float = 180.0  # elastic: returned slices are re-added at this cadence, batched
    spare_fraction: float = 0.02     # data-parallel: hot spare slices, as a fraction of the job's slices
    speed_sigma: float = 0.0         # log-normal spread of slice speed; a synchronous group runs at its min
    quorum: int = 1                  # decoupled: the global model advances while >= quorum learners train

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        positive = ("mtbi_years", "slice_chips", "return_hours", "step_s", "checkpoint_steps",
                    "upscale_interval_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("detect_s", "restart_s", "downscale_s", "upscale_s", "spare_fraction", "speed_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("slice_chips", "checkpoint_steps", "quorum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated run (rates are over the measured window, after warm-up)."""

    method: str
    chips: int           # chips actually simulated (a whole number of slices)
    learners: int
    hours: float         # measured window
    goodput: float       # useful chip-time / allocated chip-time
    uptime: float        # fraction of time the global model advanced
    failures: int        # failures that hit in-service chips in the window
    stalls: int          # recoveries / reconfigurations started in the window


ACTIVE, REPAIR, PENDING, SPARE = 0, 1, 2, 3      # slice status
UP, STALLED, STARVED = 0, 1, 2                   # group status (STARVED: not enough capacity to run)
_RETURN, _RESUME, _UPSCALE = 0, 1, 2             # event kinds


class _Stream:
    """Values of one distribution drawn from the generator in batches (a per-event numpy call is slow)."""

    def __init__(self, draw: Callable[[int], np.ndarray]):
        self._draw, self._buf, self._i = draw, [], 0

    def next(self) -> float:
        if self._i == len(self._buf):
            self._buf, self._i = self._draw(4096).tolist(), 0
        self._i += 1
        return self._buf[self._i - 1]


class _Group:
    """One synchronous job: the whole data-parallel job, or one Decoupled DiLoCo learner."""

    __slots__ = ("idx", "target", "active", "pending", "state", "epoch", "up_since", "last", "speed", "heap",
                 "upscale_due")

    def __init__(self, idx: int, target: int):
        self.idx = idx
        self.target = target      # slices the group was allocated
        self.active = target
        self.pending: set[int] = set()   # returned slices waiting to be re-added (elastic)
        self.state = UP
        self.epoch = 0            # invalidates RESUME events of superseded stalls
        self.up_since = 0.0
        self.last = 0.0
        self.speed = 1.0
        self.heap: list[tuple[float, int, int]] = []
        self.upscale_due = False


class _Sim:
    def __init__(self, method: str, n_slices: int, learners: int, m: FailureModel, horizon: float,
                 warmup: float, seed: int, progress: Callable[[float], None] | None):
        self.m, self.method, self.elastic = m, method, method != "dp"
        self.T, self.w, self.progress = horizon, warmup, progress
        rng = np.random.default_rng(seed)
        n_spares = math.ceil(m.spare_fraction * n_slices) if method == "dp" else 0
        total = n_slices + n_spares
        fail_rate = total * m.slice_chips / (m.mtbi_years * YEAR)   # superposed pool, candidates/s
        self.gaps = _Stream(lambda k: rng.exponential(1.0 / fail_rate, k))
        self.victims = _Stream(lambda k: rng.integers(0, total, k))
        self.repairs = _Stream(lambda k: rng.exponential(m.return_hours * HOUR, k))
        sig = m.speed_sigma
        self.speeds = _Stream(lambda k: np.exp(rng.normal(-sig * sig / 2, sig, k)))  # mean 1
        self.status = [ACTIVE] * n_slices + [SPARE] * n_spares
        self.owner = [s % learners for s in range(n_slices)] + [0] * n_spares
        self.gen = [0] * total
        self.speed = [self.speeds.next() if sig > 0 else 1.0 for _ in range(total)]
        self.spares = set(range(n_slices, total))
        self.groups = [_Group(g, len(range(g, n_slices, learners))) for g in range(learners)]
        if sig > 0:
            for s in range(n_slices):
                self.groups[self.owner[s]].heap.append((self.speed[s], s, 0))
            for g in self.groups:
                heapq.heapify(g.heap)
                g.speed = self._min_speed(g)
        self.events: list[tuple[float, int, int, int, int]] = []   # (time, seq, kind, a, b)
        self.seq = 0
        self.work = 0.0
        self.n_up, self.up_time, self.up_last = learners, 0.0, 0.0
        self.failures = self.stalls = 0
        self.allocated = n_slices * m.slice_chips

    # -- accounting -------------------------------------------------------------------------------
    def _span(self, a: float, b: float) -> float:
        """Length of [a, b] inside the measured window [warmup, horizon]."""
        return max(0.0, min(b, self.T) - max(a, self.w))

    def _advance(self, g: _Group, t: float) -> None:
        if g.state == UP:
            self.work += g.active * self.m.slice_chips * g.speed * self._span(g.last, t)
        g.last = t

    def _set_state(self, g: _Group, state: int, t: float) -> None:
        was_up, now_up = g.state == UP, state == UP
        if was_up != now_up:
            if self.n_up >= self.m.quorum:
                self.up_time += self._span(self.up_last, t)
            self.up_last = t
            self.n_up += 1 if now_up else -1
        g.state = state

    def _min_speed(self, g: _Group) -> float:
        while g.heap:   # lazy deletion: drop entries of slices that left the group since they were pushed
            speed, s, gen = g.heap[0]
            if self.status[s] == ACTIVE and self.gen[s] == gen:
                return speed
            heapq.heappop(g.heap)
        return 1.0

    def _activate(self, g: _Group, s: int) -> None:
        self.status[s] = ACTIVE
        g.active += 1
        if self.m.speed_sigma > 0:
            self.gen[s] += 1
            heapq.heappush(g.heap, (self.speed[s], s, self.gen[s]))

    # -- transitions ------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _stall(self, g: _Group, t: float, duration: float) -> None:
        self._advance(g, t)
        self._set_state(g, STALLED, t)
        g.epoch += 1
        self.stalls += t >= self.w
        self._push(t + duration, _RESUME, g.idx, g.epoch)

    def _fail(self, t: float, s: int) -> None:
        st = self.status[s]
        if st == REPAIR:     # thinning: chips already out for repair cannot fail again
            return
        self.failures += t >= self.w
        self.status[s] = REPAIR
        self._push(t + self.repairs.next(), _RETURN, s)
        if st == SPARE:
            self.spares.discard(s)
            return
        g = self.groups[self.owner[s]]
        if st == PENDING:
            g.pending.discard(s)
            return
        self._advance(g, t)
        if g.state == UP:
            # The failed group loses the work since its last consistent point, on every chip it had.
            period = self.m.step_s * (1 if self.elastic else self.m.checkpoint_steps)
            lost_since = t - (t - g.up_since) % period
            self.work -= g.active * self.m.slice_chips * g.speed * self._span(lost_since, t)
            recovery = self.m.downscale_s if self.elastic else self.m.restart_s
            self._stall(g, t, self.m.detect_s + recovery)
        # A failure while the group is already stalled is absorbed: the recovery in progress excludes it.
        g.active -= 1

    def _resume(self, t: float, gi: int, epoch: int) -> None:
        g = self.groups[gi]
        if epoch != g.epoch:
            return
        self._advance(g, t)
        if self.elastic:
            for s in g.pending:
                self._activate(g, s)
            g.pending.clear()
            ok = g.active > 0
        else:
            while g.active < g.target and self.spares:
                self._activate(g, self.spares.pop())
            ok = g.active == g.target
        if not ok:
            self._set_state(g, STARVED, t)
            return
        g.speed = self._min_speed(g) if self.m.speed_sigma > 0 else 1.0
        g.up_since = t
        self._set_state(g, UP, t)

    def _return(self, t: float, s: int) -> None:
        if self.m.speed_sigma > 0:
            self.speed[s] = self.speeds.next()   # a repaired slice is new hardware
        if not self.elastic:
            self.status[s] = SPARE
            self.spares.add(s)
            g = self.groups[0]
            if g.state == STARVED and len(self.spares) >= g.target - g.active:
                self._stall(g, t, self.m.restart_s)   # enough capacity again: restart on it
            return
        g = self.groups[self.owner[s]]
        self.status[s] = PENDING
        g.pending.add(s)
        if g.state == STARVED:
            self._stall(g, t, self.m.upscale_s)
        elif g.state == UP and not g.upscale_due:
            g.upscale_due = True
            tick = self.m.upscale_interval_s
            self._push((math.floor(t / tick) + 1) * tick, _UPSCALE, self.owner[s])

    def _upscale(self, t: float, gi: int) -> None:
        g = self.groups[gi]
        g.upscale_due = False
        if g.state == UP and g.pending:   # planned at a step boundary: nothing is lost
            self._stall(g, t, self.m.upscale_s)
        # If the group is stalled, its pending slices join when that recovery ends.

    def run(self) -> tuple[float, float]:
        t_fail = self.gaps.next()
        report_every, next_report = self.T / 50, self.T / 50
        while True:
            t_event = self.events[0][0] if self.events else math.inf
            t = min(t_fail, t_event)
            if t >= self.T:
                break
            if t_fail <= t_event:
                self._fail(t_fail, self.victims.next())
                t_fail += self.gaps.next()
            else:
                _, _, kind, a, b = heapq.heappop(self.events)
                if kind == _RETURN:
                    self._return(t, a)
                elif kind == _RESUME:
                    self._resume(t, a, b)
                else:
                    self._upscale(t, a)
            if self.progress is not None and t >= next_report:
                self.progress(t / self.T)
                next_report += report_every
        for g in self.groups:
            self._advance(g, self.T)
        if self.n_up >= self.m.quorum:
            self.up_time += self._span(self.up_last, self.T)
        window = self.T - self.w
        return self.work / (self.allocated * window), self.up_time / window


def simulate(method: str, chips: int, learners: int = 1, *, model: FailureModel | None = None,
             hours: float = 200.0, warmup_hours: float = 2.0, seed: int = 0,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Simulate one method on `chips` chips for `hours` (after warm-up); same seed, same result."""
    m = model or FailureModel()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(learners, int) or learners < 1 or (method != "decoupled" and learners != 1):
        raise ValueError(f"learners must be 1 for {method!r} and >= 1 for 'decoupled', got {learners!r}")
    if not isinstance(chips, int) or chips < m.slice_chips * learners:
        raise ValueError(f"chips must be an integer >= slice_chips * learners "
                         f"({m.slice_chips * learners}), got {chips!r}")
    if not (hours > 0 and warmup_hours >= 0 and math.isfinite(hours + warmup_hours)):
        raise ValueError(f"hours must be > 0 and warmup_hours >= 0, got {hours!r}, {warmup_hours!r}")
    if m.quorum > learners:
        raise ValueError(f"quorum ({m.quorum}) cannot exceed learners ({learners})")
    n_slices = max(learners, round(chips / m.slice_chips))
    code = METHODS.index(method)
    cell_seed = np.random.SeedSequence([seed, code, n_slices, learners]).generate_state(1)[0]
    sim = _Sim(method, n_slices, learners, m, (warmup_hours + hours) * HOUR, warmup_hours * HOUR,
               int(cell_seed), progress)
    goodput, uptime = sim.run()
    return SimResult(method, n_slices * m.slice_chips, learners, hours, goodput, uptime, sim.failures,
                     sim.stalls)
