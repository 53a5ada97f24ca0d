"""The syncer's state: global fragments and their versions, outer Nesterov state per fragment, pending
contributions and the learner registry. Merge math is pure (it runs in a worker thread on immutable
snapshots); every mutation happens on the event loop. Durable form: see store.py.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.downlink import Parts, Update, UpdateHistory, fragment_digest, is_quantized, publish, update_nbytes
from diloco_trainer.protocol.fragments import fragment_of, plan_fragments
from diloco_trainer.syncer.limits import WEIGHT_ROUNDS, weighed_counts
from diloco_trainer.syncer.merge import (NesterovOuter, NormHistory, NotFinite, check_finite, late_share,
                                         merge_fragment, reanchor, token_weight)
from diloco_trainer.model.build import build_model, embedding_names, tensor_bytes
from diloco_trainer.syncer.quorum import MergePolicy, robust_step_time
from diloco_trainer.protocol.shardmap import owned_fragments, shard_of
from diloco_trainer.protocol.wire import SubmissionMeta

from diloco_trainer.syncer.journal import JournalEntry, MergeJournal
from diloco_trainer.syncer.lives import Lives
from diloco_trainer.syncer.store import (Checkpoint, Spool, SpoolEntry, VersionReservation, load_checkpoint,
                                         previous_versions, set_aside_damaged, write_checkpoint)

log = logging.getLogger(__name__)


class Rejected(Exception):
    """A request the syncer refuses: HTTP status, a reason for the client, a short label for metrics."""

    def __init__(self, status: int, reason: str, label: str):
        super().__init__(reason)
        self.status, self.reason, self.label = status, reason, label


@dataclass
class Contribution:
    """One acknowledged outer gradient, waiting for its fragment's merge.

    Live submissions keep (anchor = Θ_base, delta = Δ̂); replayed ones keep anchor = θ_m and delta None.
    Holding Θ_base by reference keeps the contribution valid even after that version leaves the history.
    """

    submission_id: str
    learner_id: str
    fragment: int
    base_version: int
    base_step: int  # outer steps of the fragment when base_version was published (for staleness)
    c_steps: int
    c_tokens: int
    anchor: dict[str, Tensor]
    delta: dict[str, Tensor] | None
    received_at: float  # monotonic
    spool_name: str
    # A rider (SubmissionMeta.rider): it joins the fragment's next merge and never makes one alone, unless none
    # comes within RIDER_WAIT_PERIODS sync periods or every live learner has a contribution pending.
    rides: bool = False
    # Its update norm per tensor after the norm bound (merge.bound_update), recorded in the fragment's NormHistory
    # when it is acknowledged; None for one replayed from the spool.
    norms: dict[str, float] | None = None

    def learner_params(self) -> dict[str, Tensor]:
        """θ_m = Θ_base − Δ̂: the learner's fragment as it reported it (what the spool stores)."""
        if self.delta is None:
            return self.anchor
        return {n: self.anchor[n] - self.delta[n] for n in self.anchor}

    def reanchored(self, current: dict[str, Tensor]) -> dict[str, Tensor]:
        """Δ' = Θ_current − θ_m: Δ̂ itself (no copy) when its base is still the current version."""
        if self.delta is None:
            return {n: current[n] - self.anchor[n] for n in current}
        if all(self.anchor[n] is current[n] for n in current):
            return self.delta
        return {n: reanchor(self.anchor[n], current[n], self.delta[n]) for n in current}

    def spool_meta(self) -> dict:
        return {"submission_id": self.submission_id, "learner_id": self.learner_id, "fragment": self.fragment,
                "base_version": self.base_version, "base_step": self.base_step, "c_steps": self.c_steps,
                "c_tokens": self.c_tokens, "accepted_at": time.time(), **({"rides": True} if self.rides else {})}


@dataclass
class LearnerInfo:
    """What the syncer knows of one learner: liveness from its requests, merged work from merges."""

    last_seen: float | None = None  # monotonic; None = not seen since this syncer started
    last_seen_unix: float | None = None
    unit: int | None = None
    world_size: int | None = None
    device: str | None = None
    step: int = 0
    step_time_s: float | None = None  # as it reports it (heartbeats)
    # As this syncer observes it: seconds between its last two acknowledged submissions of one fragment, over the
    # H steps between them (an upper bound: it includes the learner's sends and waits). Clamps step_time_s.
    observed_step_s: float | None = None
    last_submitted_at: dict[int, float] = field(default_factory=dict)  # fragment -> clock
    tokens: int = 0
    tokens_merged: int = 0
    steps_merged: int = 0
    submissions_merged: int = 0
    lives: Lives = field(default_factory=Lives)  # what each of its last few processes trained and got merged


@dataclass
class MergeResult:
    fragment: int
    theta: dict[str, Tensor]  # new Θ_p (fresh tensors)
    outer: NesterovOuter  # new outer state of fragment p (the old one is left untouched)
    contribs: list[Contribution]
    weights: list[float]
    update: Parts | None = None  # quantized down-link: the published update from the current version
    residual: dict[str, Tensor] | None = None  # and the down-link residual after it
    digest: str | None = None  # fragment_digest of the new Θ_p (quantized down-link)


@dataclass
class CheckpointJob:
    checkpoint: Checkpoint


@dataclass
class _Version:
    step: int  # outer steps of the fragment when this version was published
    tensors: dict[str, Tensor]


# Riders (Contribution.rides) wait this many sync periods for their fragment's next merge before merging alone
# (every live learner sends each fragment once a period; a run whose learners all died still takes their work).
RIDER_WAIT_PERIODS = 1.5
RIDER_WAIT_UNKNOWN_S = 30.0


class SyncerState:
    """Global parameters Θ in P fragments with versions, outer state, pending contributions, learners.

    With config.syncer.shards N > 1 this is shard `shard`: it holds, merges and persists only the fragments it owns
    (shardmap.py); per-fragment lists keep all P entries, those of other shards' fragments stay unused."""

    def __init__(self, config: TrainConfig, state_dir: Path, clock=time.monotonic, shard: int = 0):
        self.config, self.clock, self.dir = config, clock, Path(state_dir)
        out = config.outer
        self.shard, self.shards = shard, config.syncer.shards
        model = build_model(config.model, config.seed)
        self.embeddings = embedding_names(model)
        theta = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        self.shapes = {n: tuple(t.shape) for n, t in theta.items()}
        sizes = tensor_bytes(model)
        if out.fragments > len(sizes):  # decidable at apply time only for the built-in GPT (config.tensor_count)
            raise ValueError(f"outer.fragments ({out.fragments}) must not exceed the model's {len(sizes)} parameter "
                             "tensors (tied weights counted once): every fragment holds at least one tensor")
        self.plan = plan_fragments(sizes, out.fragments)
        self.fragment_of = fragment_of(self.plan)
        P = len(self.plan)
        self.owned = owned_fragments(shard, P, self.shards)
        owned_names = {n for p in self.owned for n in self.plan[p]}
        self.theta: dict[str, Tensor] = {n: t for n, t in theta.items() if n in owned_names}
        del theta, model
        self.versions = [0] * P
        self.outer_steps = [0] * P
        self.outer = [NesterovOuter(out.lr, out.momentum) for _ in range(P)]
        self.history: list[OrderedDict[int, _Version]] = [OrderedDict() for _ in range(P)]
        # Merge weight that went into each fragment since this syncer started, and its running total at each outer
        # step (late_share: what a contribution shares its merge with)
        self.weight_merged = [0.0] * P
        self.weight_marks: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(P)]
        # Quantized down-link (outer.downlink int8/int4): the residual of what the published Θ_p lags the exact
        # outer steps by (checkpointed with Θ), and the recent published updates learners rebuild versions from.
        self.residual: list[dict[str, Tensor]] = [{} for _ in range(P)]
        self.updates = [UpdateHistory(out.versions_kept) for _ in range(P)]
        self.pending: list[dict[str, Contribution]] = [{} for _ in range(P)]
        # Merged submission ids -> (fragment, base version), for idempotent retries. Bounded: an id is forgotten
        # once a written checkpoint covers it and its base is more than versions_kept versions behind its fragment
        # (see forget_old_ids); a retry that late is refused as stale (409) instead, never merged twice.
        self.merged_ids: dict[str, tuple[int, int]] = {}
        self.learners: dict[str, LearnerInfo] = {}
        self.tokens_merged = 0
        self.contributions_merged = 0
        self.policy = MergePolicy(out.quorum, out.grace, out.overlap, max_grace_s=out.max_grace_s)
        self.norms = [NormHistory() for _ in range(P)]  # accepted update norms per fragment (the norm bound)
        self.merges_refused = 0  # merges not committed because their result was not finite
        self.first_pending_at: list[float | None] = [None] * P
        self.quorum_reached_at: list[float | None] = [None] * P
        self.published_at: dict[int, float] = {}  # p -> when (clock) this syncer published its current version
        self.dirty = False  # merged since the last checkpoint snapshot
        self.last_checkpoint: float | None = None  # unix time of the last checkpoint written or loaded
        self.checkpoint_fallback: str | None = None  # why the latest checkpoint was passed over at start, if it was
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spool = Spool(self.dir / "spool")
        self.reservation = VersionReservation(self.dir, P)
        self.journal = MergeJournal(self.dir)
        self._load()

    # --- queries -----------------------------------------------------------------------------------

    @property
    def num_fragments(self) -> int:
        return len(self.plan)

    def owner(self, p: int) -> int:
        """The shard that owns fragment p (this one or another)."""
        return shard_of(p, self.num_fragments, self.shards)

    def fragment(self, p: int) -> dict[str, Tensor]:
        """Current Θ_p (tensors are never mutated once published, so callers may keep them)."""
        return {n: self.theta[n] for n in self.plan[p]}

    def fragment_shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: self.shapes[n] for n in self.plan[p]}

    def pending_learners(self, p: int) -> int:
        """Learners with a contribution pending for fragment p that counts towards its quorum (not a rider)."""
        return len({c.learner_id for c in self.pending[p].values() if not c.rides})

    def has_pending(self, learner_id: str, p: int) -> bool:
        """Whether learner `learner_id` has an acknowledged contribution to fragment p waiting for a merge (its
        rider, e.g. the resend of a previous life's work, does not hold its own next Δ back)."""
        return any(c.learner_id == learner_id and not c.rides for c in self.pending[p].values())

    def _first_counted_at(self, p: int) -> float | None:
        return min((c.received_at for c in self.pending[p].values() if not c.rides), default=None)

    def is_known(self, submission_id: str) -> bool:
        """Merged, or acknowledged and pending: a retry of it must not be merged again."""
        return submission_id in self.merged_ids or any(submission_id in pend for pend in self.pending)

    def live_ids(self, timeout_s: float) -> set[str]:
        """Learners seen (any request) within the last `timeout_s` seconds."""
        now = self.clock()
        return {lid for lid, info in self.learners.items()
                if info.last_seen is not None and now - info.last_seen <= timeout_s}

    # --- learners ----------------------------------------------------------------------------------

    def version_ages(self) -> dict[int, float]:
        """Seconds since each owned fragment's current version was published, for those this syncer published."""
        now = self.clock()
        return {p: now - self.published_at[p] for p in self.owned if p in self.published_at}

    def seen(self, learner_id: str) -> LearnerInfo:
        info = self.learners.setdefault(learner_id, LearnerInfo())
        info.last_seen, info.last_seen_unix = self.clock(), time.time()
        return info

    def heartbeat(self, learner_id: str, step: int, step_time_s: float | None, tokens: int,
                  life: str | None = None, steps_discarded: int = 0) -> None:
        info = self.seen(learner_id)
        info.step, info.tokens = step, tokens
        if life is not None:
            info.lives.heartbeat(life, step, tokens, steps_discarded, info.last_seen_unix)
        if step_time_s is not None and step_time_s > 0:
            info.step_time_s = step_time_s
            self._update_step_time()

    def _update_step_time(self) -> None:
        """The learners' step time the grace window is sized from: the lower median over learners of what each
        reports, each clamped to what this syncer observed between its submissions (quorum.robust_step_time), so
        one learner's heartbeats cannot stretch the window."""
        step = robust_step_time([(i.step_time_s, i.observed_step_s) for i in self.learners.values()
                                 if i.step_time_s is not None])
        if step is not None:
            self.policy.set_step_time(step)

    # --- submissions -------------------------------------------------------------------------------

    def check_base(self, p: int, base_version: int) -> _Version:
        """The kept version a submission is based on; Rejected (409 too old / lost, 400 never issued) if none."""
        kept = self.history[p]
        if base_version in kept:
            return kept[base_version]
        current = self.versions[p]
        if base_version > current and base_version >= self.reservation.floor[p]:
            raise Rejected(400, f"base_version {base_version} of fragment {p} is newer than the current "
                                f"version {current}", "base_newer")
        if base_version > min(kept):  # a gap in the ids: published before a crash, never checkpointed
            raise Rejected(409, f"base_version {base_version} of fragment {p} is not known to this syncer "
                                f"(published before a restart and lost); current is {current}: re-adopt",
                           "base_lost")
        raise Rejected(409, f"base_version {base_version} of fragment {p} is older than the versions kept "
                            f"({min(kept)}..{current}); re-adopt the current version", "base_too_old")

    def new_contribution(self, p: int, meta: SubmissionMeta, deltas: dict[str, Tensor]) -> Contribution:
        """Validate a decoded submission against fragment p; nothing is changed (Rejected on a bad one)."""
        if meta.fragment != p:
            raise Rejected(400, f"metadata fragment {meta.fragment} does not match the URL fragment {p}",
                           "fragment_mismatch")
        if set(deltas) != set(self.plan[p]):
            raise Rejected(400, f"parameters do not match fragment {p}", "bad_parameters")
        base = self.check_base(p, meta.base_version)
        version = meta.base_version
        if meta.rider:
            # Decision: a rider (a restarted learner's resend of its predecessor's unsent work, maybe built from a
            # version others have since moved on from) is taken as built from the current version:
            # θ_m := Θ_current − Δ̂.
            # Re-anchored against its own stale base instead, Δ' = Θ_current − θ_m would carry the others' updates
            # since that base back out of Θ (learner/loop.py, _adopt_updates, measured that drag). Its base must
            # still be kept (bounded staleness); from here on it is an ordinary contribution (spool, journal, replay).
            version = self.versions[p]
            base = self.history[p][version]
        return Contribution(meta.submission_id, meta.learner_id, p, version, base.step, meta.c_steps,
                            meta.c_tokens, base.tensors, deltas, self.clock(), self.spool.reserve_name(),
                            rides=meta.rider)

    def add_pending(self, c: Contribution) -> None:
        """Register an acknowledged (already spooled) contribution for its fragment's next merge."""
        assert not self.is_known(c.submission_id), c.submission_id
        p = c.fragment
        self.pending[p][c.submission_id] = c
        if c.norms is not None:  # a live submission (not one replayed from the spool)
            self.norms[p].record(c.norms)
            info = self.learners.setdefault(c.learner_id, LearnerInfo())
            last = info.last_submitted_at.get(p)
            info.last_submitted_at[p] = c.received_at
            if last is not None and c.received_at > last:
                info.observed_step_s = (c.received_at - last) / self.config.outer.sync_every
                if info.step_time_s is not None:
                    self._update_step_time()
        if self.first_pending_at[p] is None and not c.rides:
            self.first_pending_at[p] = c.received_at
        if self.quorum_reached_at[p] is None and self.pending_learners(p) >= self.config.outer.quorum:
            self.quorum_reached_at[p] = self.clock()
            self.policy.observe_quorum_time(self.quorum_reached_at[p] - self.first_pending_at[p])

    def rider_wait_s(self) -> float:
        """How long riders wait for their fragment's next merge: RIDER_WAIT_PERIODS sync periods (H steps at the
        learners' step time), RIDER_WAIT_UNKNOWN_S before a step time is known."""
        step = self.policy.step_time.value
        if step is None:
            return RIDER_WAIT_UNKNOWN_S
        return RIDER_WAIT_PERIODS * self.config.outer.sync_every * step

    def decide(self, p: int, live_timeout_s: float) -> float | None:
        """MergePolicy's answer for fragment p now: None (wait for contributions), 0.0 (merge), or seconds.
        Riders only join a merge: alone, they wait for the next one, at most rider_wait_s(), unless every live
        learner has a contribution pending (nobody else can come: e.g. a lone learner, or all restarted at once)."""
        pending = self.pending[p].values()
        live = self.live_ids(live_timeout_s)
        riders = [c.received_at for c in pending if c.rides]
        if riders and live and live <= {c.learner_id for c in pending}:
            return 0.0  # as MergePolicy does when every live learner is pending (riders' learners included)
        if riders and len(riders) == len(self.pending[p]):
            left = min(riders) + self.rider_wait_s() - self.clock()
            return left if left > 0 else 0.0
        # A learner with a pending contribution counts as alive (MergePolicy's contract: |live ∪ pending|).
        alive = live | {c.learner_id for c in pending if not c.rides}
        return self.policy.decide(self.pending_learners(p), self.first_pending_at[p], self.quorum_reached_at[p],
                                  self.clock(), n_live=len(alive))

    # --- merge -------------------------------------------------------------------------------------

    def prepare_merge(self, p: int) -> tuple[list[Contribution], dict[str, Tensor], NesterovOuter]:
        """Snapshot what a merge of fragment p needs (the contributions stay pending until commit)."""
        return list(self.pending[p].values()), self.fragment(p), self.outer[p]

    def compute_merge(self, p: int, contribs: list[Contribution], current: dict[str, Tensor],
                      outer: NesterovOuter) -> MergeResult:
        """Pure: re-anchor, weight, merge (RDA / mean) and take the outer Nesterov step on copies."""
        out = self.config.outer
        deltas = [c.reanchored(current) for c in contribs]
        # A contribution's weight counts at most WEIGHT_ROUNDS rounds of H steps (limits.py: a lying learner).
        counted = [weighed_counts(c.c_steps, c.c_tokens, WEIGHT_ROUNDS * out.sync_every) for c in contribs]
        weights = [token_weight(tokens, steps) if out.token_weights else 1.0 for steps, tokens in counted]
        merged = merge_fragment(deltas, weights, self.embeddings, out.merge)
        if out.late_share:
            scale = late_share(weights, [0.0 if c.rides else self.weight_merged_since(p, c.base_step) for c in contribs])
            if scale < 1.0:
                merged = {n: t.mul_(scale) for n, t in merged.items()}
        fresh = NesterovOuter(out.lr, out.momentum)
        fresh.load_state_dict(outer.state_dict())  # clones: the published outer state is never mutated
        stepped = fresh.stepped(current, merged)  # new tensors: the published Θ is never mutated
        # Never publish a version (nor keep momentum) that is not finite: NotFinite, and the state stays as it was.
        check_finite(stepped)
        check_finite({n: t for n, t in fresh.state_dict().items() if n in stepped})
        theta = dict(current) | stepped
        if not is_quantized(out.downlink):
            return MergeResult(p, theta, fresh, contribs, weights)
        # The published version is what learners can rebuild from the current one; the rest waits in the residual.
        published, update, residual = publish(current, theta, self.residual[p], out.downlink, out.block_size)
        return MergeResult(p, published, fresh, contribs, weights, update, residual, fragment_digest(published))

    def commit_merge(self, r: MergeResult) -> int:
        """Publish a merge: new Θ_p and version, outer state, counters. Returns the new version."""
        p = r.fragment
        prev = self.versions[p]
        version = max(prev + 1, self.reservation.floor[p])
        self.reservation.ensure(p, version)  # durable before any learner can see the id
        if r.update is not None:
            self.updates[p].add(Update(prev, version, r.update, update_nbytes(r.update), r.digest))
            self.residual[p] = r.residual
        self.theta.update(r.theta)
        self.versions[p] = version
        self.published_at[p] = self.clock()
        self.outer[p] = r.outer
        self.outer_steps[p] += 1
        self._count_merged_weight(p, sum(r.weights))
        self._remember(p, version, r.theta)
        for c in r.contribs:
            del self.pending[p][c.submission_id]
            self.merged_ids[c.submission_id] = (p, c.base_version)
            info = self.learners.setdefault(c.learner_id, LearnerInfo())
            info.tokens_merged += c.c_tokens
            info.steps_merged += c.c_steps
            info.submissions_merged += 1
            info.lives.merged(c.learner_id, c.submission_id, c.c_steps, c.c_tokens, time.time())
            self.tokens_merged += c.c_tokens
            self.contributions_merged += 1
        # Contributions that arrived during the merge start a new round: quorum is counted afresh.
        self.first_pending_at[p] = self._first_counted_at(p)
        self.quorum_reached_at[p] = None
        if self.first_pending_at[p] is not None and self.pending_learners(p) >= self.config.outer.quorum:
            self.quorum_reached_at[p] = self.clock()
        self.dirty = True
        return version

    def refuse_merge(self, p: int, contribs: list[Contribution]) -> None:
        """Drop a merge whose result was not finite (compute_merge raised NotFinite): the fragment stays at its last
        good version and outer state; its contributions are discarded (merging them again would fail again) and a
        retry of one is answered as a duplicate."""
        self.merges_refused += 1
        for c in contribs:
            self.pending[p].pop(c.submission_id, None)
            self.merged_ids[c.submission_id] = (p, c.base_version)
        self.spool.remove([c.spool_name for c in contribs])
        self.first_pending_at[p] = self._first_counted_at(p)
        self.quorum_reached_at[p] = None
        if self.first_pending_at[p] is not None and self.pending_learners(p) >= self.config.outer.quorum:
            self.quorum_reached_at[p] = self.clock()
        self.dirty = True

    def journal_merge(self, r: MergeResult) -> None:
        """Make a computed merge durable under the version `commit_merge` will give it, before anyone can see that
        version (I/O: call from a worker thread, right before the commit)."""
        version = max(self.versions[r.fragment] + 1, self.reservation.floor[r.fragment])
        self.journal.append(JournalEntry(r.fragment, version, tuple(c.spool_name for c in r.contribs)))

    def staleness(self, c: Contribution) -> int:
        """Outer steps of c's fragment published since its base (0 = merged into the next version)."""
        return max(0, self.outer_steps[c.fragment] - c.base_step)

    def weight_merged_since(self, p: int, base_step: int) -> float:
        """Merge weight that went into fragment p after the version published at outer step `base_step` (late_share).
        Counted since this syncer started: a base from before, or older than the steps remembered, counts from the
        oldest step remembered (so at most what is known)."""
        marks = self.weight_marks[p]
        if not marks:
            return 0.0
        at = marks.get(max(base_step, next(iter(marks))))  # before the oldest step remembered: from that one
        return max(0.0, self.weight_merged[p] - at) if at is not None else 0.0

    def _count_merged_weight(self, p: int, weight: float) -> None:
        marks = self.weight_marks[p]
        if not marks:  # the version this syncer started from
            marks[self.outer_steps[p] - 1] = self.weight_merged[p]
        self.weight_merged[p] += weight
        marks[self.outer_steps[p]] = self.weight_merged[p]
        while len(marks) > 4 * self.config.outer.versions_kept + 1:
            marks.popitem(last=False)

    def _remember(self, p: int, version: int, tensors: dict[str, Tensor]) -> None:
        kept = self.history[p]
        kept[version] = _Version(self.outer_steps[p], tensors)
        while len(kept) > self.config.outer.versions_kept:
            kept.popitem(last=False)

    # --- durability --------------------------------------------------------------------------------

    def checkpoint_job(self) -> CheckpointJob:
        """A consistent snapshot (references to immutable tensors) to write from a worker thread."""
        momentum = {n: t for opt in self.outer for n, t in opt.state_dict().items()}
        state = {
            "config": self.config.model_dump(mode="json"),
            "shard": self.shard,
            "shards": self.shards,
            "versions": {str(p): self.versions[p] for p in self.owned},
            "outer_steps": {str(p): self.outer_steps[p] for p in self.owned},
            "tokens_merged": self.tokens_merged,
            "contributions_merged": self.contributions_merged,
            "learners": {lid: {"tokens_merged": i.tokens_merged, "steps_merged": i.steps_merged,
                               "submissions_merged": i.submissions_merged, "lives": i.lives.state_dict()}
                         for lid, i in self.learners.items()},
            "merged_ids": {sid: list(pb) for sid, pb in sorted(self.merged_ids.items())},
            "policy": self.policy.state_dict(),
            "written_at": time.time(),
        }
        self.dirty = False
        residual = {n: t for res in self.residual for n, t in res.items()}
        return CheckpointJob(Checkpoint(dict(self.theta), momentum, state, residual))

    def write(self, job: CheckpointJob) -> None:
        """Write a checkpoint (the one it replaces stays as the previous one), then drop the journal lines and spool
        files the previous one covers: a start that falls back to it redoes every later merge from them, so no
        acknowledged update is lost (I/O: call from a worker thread)."""
        write_checkpoint(self.dir, job.checkpoint)
        reach = previous_versions(self.dir) or job.checkpoint.state["versions"]  # no previous: nothing to redo
        dropped = self.journal.covered([int(reach.get(str(p), 0)) for p in range(self.num_fragments)])
        self.spool.remove(sorted({n for e in dropped for n in e.spool}))

    def checkpoint_written(self, job: CheckpointJob) -> None:
        self.last_checkpoint = job.checkpoint.state["written_at"]
        self.forget_old_ids(job.checkpoint.state)

    def idempotency_floor(self, p: int, version: int | None = None) -> int:
        """Base versions of fragment p below this are outside the idempotency window: no submission based on one
        can be pending (it would have been refused as stale), so one that is spooled was merged already."""
        return (self.versions[p] if version is None else version) - self.config.outer.versions_kept

    def forget_old_ids(self, written: dict) -> None:
        """Drop merged ids that the written checkpoint `written` covers (their spool files are gone with it) and
        whose base is below the idempotency floor at that checkpoint: the id list stays bounded however long the
        run."""
        versions = {int(p): int(v) for p, v in written["versions"].items()}
        old = [sid for sid, (p, base) in (written.get("merged_ids") or {}).items()
               if p in versions and base < self.idempotency_floor(p, versions[p])]
        for sid in old:
            self.merged_ids.pop(sid, None)

    def _load(self) -> None:
        loaded = load_checkpoint(self.dir)  # ValueError if every checkpoint there is damaged
        if loaded is not None:
            self._load_checkpoint(loaded.checkpoint)
            if loaded.damaged:
                aside = set_aside_damaged(self.dir)
                self.checkpoint_fallback = "; ".join(loaded.damaged)
                log.error("started from the previous checkpoint %s (versions %s): the latest is damaged and was "
                          "moved to %s; the merge journal redoes the merges since", loaded.path,
                          list(self.versions), aside)
        for p in self.owned:
            self._remember(p, self.versions[p], self.fragment(p))
        self.reservation.floor = [max(f, v + 1) for f, v in zip(self.reservation.floor, self.versions)]
        replayed = 0
        entries = self.spool.load_all()
        kept = {n for j in self.journal.entries() for n in j.spool}  # the previous checkpoint's fallback needs them
        journaled = self._replay_journal(entries)
        for e in entries:
            if e.name in journaled:
                continue  # merged again above; its file goes with the next checkpoint
            m = e.meta
            p = int(m["fragment"])
            if m["submission_id"] in self.merged_ids or (
                    0 <= p < self.num_fragments and int(m["base_version"]) < self.idempotency_floor(p)):
                if e.name not in kept:
                    self.spool.remove([e.name])  # in the checkpoint already; only the deletion was lost
                continue
            if not 0 <= p < self.num_fragments or set(e.tensors) != set(self.plan[p]) or p not in self.owned:
                log.error("spool file %s does not match this run's fragment plan; left in place", e.name)
                continue
            c = Contribution(m["submission_id"], m["learner_id"], p, int(m["base_version"]), int(m["base_step"]),
                             int(m["c_steps"]), int(m["c_tokens"]), e.tensors, None, self.clock(), e.name,
                             rides=m.get("rides") is True)
            if not self.is_known(c.submission_id):
                self.add_pending(c)
                replayed += 1
        if loaded is not None or replayed or journaled:
            log.info("syncer state: versions %s, %d contributions replayed from the spool", self.versions, replayed)

    def _spooled(self, e: SpoolEntry) -> Contribution:
        m = e.meta
        return Contribution(m["submission_id"], m["learner_id"], int(m["fragment"]), int(m["base_version"]),
                            int(m["base_step"]), int(m["c_steps"]), int(m["c_tokens"]), e.tensors, None, self.clock(),
                            e.name)

    def _replay_journal(self, entries: list[SpoolEntry]) -> set[str]:
        """Redo the journaled merges the checkpoint does not cover, under their own versions, from the spooled
        contributions (θ_m, so each Δ is re-anchored as Θ − θ_m: equal to the live merge up to float rounding).
        Returns the spool files merged."""
        by_name = {e.name: e for e in entries}
        done: set[str] = set()
        broken: set[int] = set()  # fragments whose journal cannot be followed further
        floor = list(self.reservation.floor)
        merges = 0
        for j in self.journal.entries():
            p = j.fragment
            if p not in self.owned or j.version <= self.versions[p] or p in broken:
                continue
            missing = [n for n in j.spool if n not in by_name]
            if missing:
                log.error("merge journal: version %d of fragment %d needs spool files %s that are gone; its later "
                          "merges are not replayed (their contributions merge anew)", j.version, p, missing)
                broken.add(p)
                continue
            for n in j.spool:
                self.add_pending(self._spooled(by_name[n]))
            try:
                r = self.compute_merge(p, list(self.pending[p].values()), self.fragment(p), self.outer[p])
            except NotFinite as exc:  # finite when it was journaled: only rounding could change that
                log.error("merge journal: version %d of fragment %d is not finite when redone (%s); its later merges "
                          "are not replayed (their contributions merge anew)", j.version, p, exc)
                broken.add(p)
                continue
            self.reservation.floor[p] = j.version  # commit_merge publishes at max(current + 1, floor): this version
            self.commit_merge(r)
            done.update(j.spool)
            merges += 1
        if merges:
            log.info("merge journal: %d merges published before the last checkpoint redone (%d contributions)",
                     merges, len(done))
        self.reservation.floor = [max(f, v + 1) for f, v in zip(floor, self.versions)]
        return done

    def _load_checkpoint(self, ckpt: Checkpoint) -> None:
        saved = ckpt.state["config"]
        mine = self.config.model_dump(mode="json")
        for key in ("model", "seed"):
            if saved.get(key) != mine[key]:
                raise ValueError(f"checkpoint in {self.dir} was written for a different {key} "
                                 f"({saved.get(key)} vs {mine[key]}); use a fresh --state-dir")
        if saved["outer"]["fragments"] != mine["outer"]["fragments"]:
            raise ValueError(f"checkpoint in {self.dir} has {saved['outer']['fragments']} fragments, the config "
                             f"asks for {mine['outer']['fragments']}; use a fresh --state-dir")
        s = ckpt.state
        if (int(s.get("shard", 0)), int(s.get("shards", 1))) != (self.shard, self.shards):
            raise ValueError(f"checkpoint in {self.dir} belongs to shard {s.get('shard', 0)} of "
                             f"{s.get('shards', 1)}, this syncer is shard {self.shard} of {self.shards}; give each "
                             "shard its own --state-dir")
        if set(ckpt.theta) != set(self.theta):
            raise ValueError(f"checkpoint in {self.dir} names different parameters than the model")
        self.theta = {n: ckpt.theta[n].float() for n in self.theta}
        for p in self.owned:
            self.versions[p] = int(s["versions"][str(p)])
            self.outer_steps[p] = int(s["outer_steps"][str(p)])
        for p in self.owned:
            names = self.plan[p]
            self.outer[p].load_state_dict({n: ckpt.momentum[n] for n in names if n in ckpt.momentum})
            if is_quantized(self.config.outer.downlink):
                self.residual[p] = {n: ckpt.residual[n].float() for n in names if n in ckpt.residual}
        self.last_checkpoint = s.get("written_at")
        self.tokens_merged = int(s["tokens_merged"])
        self.contributions_merged = int(s.get("contributions_merged", 0))
        for lid, d in s["learners"].items():
            self.learners[lid] = LearnerInfo(tokens_merged=d["tokens_merged"], steps_merged=d["steps_merged"],
                                             submissions_merged=d["submissions_merged"])
            self.learners[lid].lives.load_state_dict(d.get("lives") or [])  # none in checkpoints from before
        ids = s["merged_ids"]  # a list of ids in checkpoints written before ids carried their base
        self.merged_ids = {sid: (int(v[0]), int(v[1])) for sid, v in ids.items()} if isinstance(ids, dict) else \
            {sid: (-1, 1 << 62) for sid in ids}  # fragment unknown: never forgotten
        self.policy.load_state_dict(s.get("policy") or {})
