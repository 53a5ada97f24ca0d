"""A learner's outer-step bookkeeping: which fragments are due, the compressed outer gradients it sends, the
syncer's answers, adoption of newer global versions, and the counters of work not yet merged.

Tensor math and state, no I/O: the learner loop hands `OuterSync` its parameters, the syncer's answers and the
versions it fetched, and hands the submissions it returns to the client.

Adoption (`outer.adopt`):
- "overwrite" (the paper): θ_p := Θ_p(new). Whatever the learner trained on p since its last send is lost.
- "keep": θ_p := Θ_p(new) + ρ·(θ_p − θ_p(ref)) (ρ = `outer.keep_fraction`, 1 by default), where ref is θ_p when the learner's outstanding Δ of p was built
  (that Δ's work is in the new version, or still on its way to the syncer), or the adopted base when nothing was
  sent from it. The learner's unsent progress rides on top of the new global version and goes out with its next
  Δ (its steps and tokens carried over), so no trained step is discarded at adoption. Like the "eager" outer
  updates of overlapped DiLoCo, the local copy never waits for, nor forgets, its own in-flight work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from diloco_trainer.learner.link import Answer, Submission
from diloco_trainer.protocol.fragments import first_due_step
from diloco_trainer.protocol.wire import ErrorFeedback, SubmissionMeta, encode_submission

AdoptMode = Literal["keep", "overwrite"]
QueueFn = Callable[[Submission], bool]  # hands a Δ to the link: False when it keeps an earlier Δ of that id instead


def submission_id(learner_id: str, nonce: str, fragment: int, base_version: int) -> str:
    """One id per (learner incarnation, fragment, base version): a superseding Δ from the same base reuses it,
    so the syncer can never merge two Δs that overlap in the steps they cover."""
    return f"{learner_id}.{nonce}.p{fragment}.v{base_version}"


@dataclass
class FragmentState:
    """What the learner knows about one fragment since it last adopted a global version of it."""

    version: int
    base: dict[str, Tensor]  # Θ_p as adopted: the reference the outer gradient is taken against
    next_due: int  # local step after which this fragment's Δ goes out next
    c_steps: int = 0  # steps (and tokens) trained on p that no acknowledged Δ covers yet
    c_tokens: int = 0
    acked: bool = False  # a Δ from this base was acknowledged: send nothing until a newer version is adopted
    in_flight: bool = False  # a Δ from this base is queued and unanswered (a fresh one supersedes it)
    refused: bool = False  # a Δ from this base was refused: a leaving learner waits for a newer version instead
    ef_before: dict[str, Tensor | None] | None = None  # residuals before the unacknowledged compression
    sent: dict[str, Tensor] | None = None  # θ_p when the outstanding (or acknowledged) Δ was built
    sent_steps: int = 0  # what that Δ covered
    sent_tokens: int = 0
    # Of c_steps, the steps a refused Δ from this base covered, by answer class ("stale": 409, "other"): booked as
    # refused until a later Δ from this base covers them again (its own answer settles them) or an adoption settles
    # them (overwrite: refused, not discarded; keep: what is carried rides on, the rest is refused).
    refused_pending: dict[str, int] | None = None


class OuterSync:
    """Outer-gradient and adoption state of one learner unit, for the parameters `params` (updated in place).

    Only the rank that talks to the syncer (`sends=True`) keeps bases and builds submissions; the other ranks of a
    unit only follow versions (their parameters come from the unit's broadcast). `state_device` is where the bases,
    the outer gradients and their compression live: beside the parameters by default; the host's memory for XLA,
    whose lazy tensors would otherwise compile a graph for every tensor's compression and check."""

    def __init__(self, plan: list[list[str]], versions: dict[int, int], params: dict[str, Tensor], *,
                 sync_every: int, adopt: AdoptMode, compression: str, block_size: int, step: int = 0,
                 sends: bool = True, keep_fraction: float = 1.0, state_device: torch.device | None = None):
        if adopt not in ("keep", "overwrite"):
            raise ValueError(f"adopt must be 'keep' or 'overwrite', got {adopt!r}")
        self.plan, self.params, self.sends = plan, params, sends
        if not 0.0 < keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
        self.sync_every, self.adopt_mode, self.keep_fraction = sync_every, adopt, keep_fraction
        self.compression, self.block_size = compression, block_size
        self.state_device = state_device
        self.ef = ErrorFeedback()
        P = len(plan)
        self.frags = [FragmentState(versions[p], self._copy(names) if sends else {},
                                    next_due=step + first_due_step(p, sync_every, P))
                      for p, names in enumerate(plan)]
        self.queued = 0  # outer gradients built and handed to the client (a superseding one included)
        self.adoptions = 0
        self.steps_kept = 0  # steps carried over an adoption instead of being discarded ("keep")
        self.steps_discarded = 0  # steps trained on a fragment and overwritten by an adoption
        # The ledger (docs/protocol.md, Ledger), in fragment-steps: every step trained on a fragment ends in exactly
        # one of acknowledged, discarded, refused (by class), or, while the learner runs or when it leaves,
        # unanswered (`in_flight`) or not sent (`unsent`). See `ledger()`.
        self.steps_acked = 0  # covered by Δs the syncer acknowledged (2xx)
        self.refused_settled = {"stale": 0, "other": 0}  # covered by refused Δs, settled by an adoption or an answer
        self.limbo: dict[tuple[int, int], int] = {}  # (fragment, base) -> steps of an unanswered Δ of an older base

    def _copy(self, names: list[str]) -> dict[str, Tensor]:
        return {n: self._local(n).clone() for n in names}

    def _local(self, name: str) -> Tensor:
        """θ of one parameter where the outer state lives (the parameter itself by default; a host copy for XLA)."""
        t = self.params[name].detach()
        return t if self.state_device is None else t.to(self.state_device)

    def align(self, first_due: dict[int, int], step: int) -> None:
        """Send fragment p first `first_due[p]` steps after `step` (fragments.aligned_first_due), not after its offset."""
        for p, due in first_due.items():
            self.frags[p].next_due = step + due

    def versions(self) -> dict[str, int]:
        return {str(p): fs.version for p, fs in enumerate(self.frags)}

    # ------------------------------------------------------------------ inner steps and sends

    def trained(self, tokens: int) -> None:
        """One inner step of `tokens` tokens happened on every fragment."""
        for fs in self.frags:
            fs.c_steps += 1
            fs.c_tokens += tokens

    def due_fragments(self, step: int) -> list[int]:
        """The fragments `send_due(step)` sends (every rank of a unit knows them: the clocks move on every rank)."""
        return [p for p, fs in enumerate(self.frags) if step >= fs.next_due]

    def send_due(self, step: int, learner_id: str, nonce: str, queue: QueueFn | None = None) -> list[Submission]:
        """Δs of the fragments due after local step `step`, each handed to `queue`; each fragment's clock moves H
        steps on."""
        out = []
        for p, fs in enumerate(self.frags):
            if step >= fs.next_due:
                sub = self.outer_gradient(p, learner_id, nonce, queue)
                if sub is not None:
                    out.append(sub)
                fs.next_due = step + self.sync_every
        return out

    def flushable(self) -> list[int]:
        """The fragments `flush` would send now: work no sent Δ covers, and no Δ from that base unanswered or
        refused (empty where this process does not send)."""
        return [p for p, fs in enumerate(self.frags)
                if self.sends and fs.c_steps > 0 and not (fs.acked or fs.in_flight or fs.refused)]

    def flush(self, learner_id: str, nonce: str, queue: QueueFn | None = None) -> list[Submission]:
        """Δs of the fragments with work no sent Δ covers (the learner is leaving). A fragment whose Δ is still
        unanswered keeps it (its answer comes during the drain; superseding it there could race its delivery)."""
        return [s for p in self.flushable() if (s := self.outer_gradient(p, learner_id, nonce, queue)) is not None]

    def unsettled(self) -> list[int]:
        """The fragments a leaving learner still has trained work on that no acknowledged Δ covers: unsent, or
        unanswered, or (adopt=keep) trained after an acknowledged Δ, which rides on the version that merges that Δ
        and goes out from there. With adopt=overwrite the steps after an acknowledged Δ are settled: its adoption
        discards them, as it would during training. A refused Δ waits for a newer version (its base is gone)."""
        if not self.sends:
            return []
        keep = self.adopt_mode == "keep"
        return [p for p, fs in enumerate(self.frags)
                if fs.c_steps > 0 and not fs.refused
                and (not fs.acked or (keep and fs.c_steps > fs.sent_steps))]

    def discard_after_acknowledged(self) -> int:
        """Leaving with adopt=overwrite: count the steps trained on each fragment after its acknowledged Δ as
        discarded, as the adoption of the version that merges that Δ would have (`unsettled` already treats them as
        settled), since this process will not live to see it. Without this a learner that left before that version
        arrived would report those steps as neither merged nor discarded. Returns how many it counted."""
        if not self.sends or self.adopt_mode != "overwrite":
            return 0
        counted = 0
        for fs in self.frags:
            if fs.acked and fs.c_steps > fs.sent_steps:
                counted += fs.c_steps - fs.sent_steps
                fs.c_steps, fs.c_tokens = fs.sent_steps, fs.sent_tokens
        self.steps_discarded += counted
        return counted

    def outer_gradient(self, p: int, learner_id: str, nonce: str, queue: QueueFn | None = None) -> Submission | None:
        """Δ_p = Θ_p(base) − θ_p, compressed with error feedback, handed to `queue` (when given); None when there is
        nothing to send, or when `queue` refuses it: a Δ from this base may already have reached the syncer, which
        merges at most one Δ per id, so that one stands and the steps since count as trained after it (a newer
        version discards them with overwrite and carries them with keep, as after any acknowledged Δ)."""
        fs = self.frags[p]
        if not self.sends or fs.acked or fs.c_steps == 0:
            return None
        names = self.plan[p]
        now = {n: self.ef.residual(n) for n in names}
        start = now if fs.ef_before is None else fs.ef_before
        if fs.ef_before is not None:  # superseding an unanswered Δ: compress from the residuals it started from
            self._restore_residuals(start)
        with torch.no_grad():
            deltas = {n: fs.base[n] - self._local(n) for n in names}
        parts = self.ef.compress(deltas, self.compression, self.block_size)
        sid = submission_id(learner_id, nonce, p, fs.version)
        meta = SubmissionMeta(learner_id, sid, p, fs.version, fs.c_steps, fs.c_tokens)
        body = encode_submission(meta, parts, self.compression, self.block_size,
                                 {n: tuple(self.params[n].shape) for n in names})
        sub = Submission(p, fs.version, sid, body, fs.c_steps, fs.c_tokens)
        if queue is not None and not queue(sub):
            self._restore_residuals(now)  # as if never built: the residuals of the Δ that stands
            return None
        fs.ef_before = start
        fs.in_flight = True
        fs.refused_pending = None  # this Δ covers the work an earlier refused one did: its answer settles it
        if self.adopt_mode == "keep":
            fs.sent = self._copy(names)
        fs.sent_steps, fs.sent_tokens = fs.c_steps, fs.c_tokens
        self.queued += 1
        return sub

    def _restore_residuals(self, before: dict[str, Tensor | None]) -> None:
        state = self.ef.state_dict()
        for name, residual in before.items():
            state.pop(name, None)
            if residual is not None:
                state[name] = residual
        self.ef.load_state_dict(state)

    def book(self, answers: list[Answer]) -> None:
        """Apply the syncer's answers to the fragments they concern (an answer for an older base is history)."""
        for ans in answers:
            fs = self.frags[ans.fragment]
            klass = "stale" if ans.status == 409 else "other"
            key = (ans.fragment, ans.base_version)
            if ans.base_version != fs.version or (not fs.in_flight and key in self.limbo):
                # The fate of a Δ that was unanswered when its fragment adopted another version.
                steps = self.limbo.pop(key, 0)
                if ans.accepted:
                    self.steps_acked += steps
                else:
                    self.refused_settled[klass] += steps
                if ans.base_version != fs.version:
                    continue
            elif fs.in_flight and self.sends:
                if ans.accepted:
                    self.steps_acked += fs.sent_steps
                else:
                    pending = fs.refused_pending or {}
                    pending[klass] = pending.get(klass, 0) + fs.sent_steps
                    fs.refused_pending = pending
            fs.in_flight = False
            if ans.accepted:
                fs.acked, fs.refused, fs.ef_before = True, False, None
                fs.refused_pending = None
            else:  # refused: its work was never merged, so the next Δ (or an adoption) must carry it
                fs.sent, fs.sent_steps, fs.sent_tokens = None, 0, 0
                fs.refused = True

    # ------------------------------------------------------------------ adoption

    def adopt(self, p: int, version: int, theta: dict[str, Tensor] | None, step: int) -> None:
        """Take global version `version` of fragment p (its tensors `theta` on the sending rank, None elsewhere)."""
        fs = self.frags[p]
        names = self.plan[p]
        keep = self.adopt_mode == "keep"
        if theta is not None:
            with torch.no_grad():
                for n in names:
                    param = self.params[n].data
                    new = theta[n].to(param.device, param.dtype)
                    if keep:  # Θ_new + ρ(θ − ref): the unsent progress rides on top
                        ref = fs.sent[n] if fs.sent is not None else fs.base[n]
                        param.sub_(ref.to(param.device)).mul_(self.keep_fraction).add_(new)
                    else:
                        param.copy_(new)
                    if self.sends:
                        fs.base[n] = theta[n].to(self.state_device or param.device, param.dtype, copy=True)
        # The work no outstanding or acknowledged Δ covers (all of it when nothing went out from this base).
        unsent_steps, unsent_tokens = fs.c_steps - fs.sent_steps, fs.c_tokens - fs.sent_tokens
        if keep:  # a fraction ρ of the work is carried: its counters scale with it (token weights stay fair)
            carried_steps = round(self.keep_fraction * unsent_steps)
            carried_tokens = round(self.keep_fraction * unsent_tokens)
            self.steps_kept += carried_steps
        else:
            carried_steps = carried_tokens = 0
        # Of the work dropped here, a refused Δ's is refused (its Δ reached the syncer and was turned away), the rest
        # discarded. A Δ still unanswered waits in limbo for its answer, which settles the steps it covered.
        dropped = unsent_steps - carried_steps
        for klass, n in (fs.refused_pending or {}).items():
            share = min(n, dropped)
            self.refused_settled[klass] += share
            dropped -= share
        self.steps_discarded += dropped
        if self.sends and fs.in_flight and fs.sent_steps:
            self.limbo[(p, fs.version)] = self.limbo.get((p, fs.version), 0) + fs.sent_steps
        fs.refused_pending = None
        fs.version = version
        fs.c_steps, fs.c_tokens = carried_steps, carried_tokens
        # Decision: the H-step clock of a fragment restarts at adoption. Every learner adopts a new version within
        # about one poll of the others, so their next sends of p line up and land in the same merge (quorum +
        # grace window) instead of one learner's merge erasing the others' unsent progress.
        fs.next_due = step + self.sync_every
        fs.acked = fs.in_flight = fs.refused = False
        fs.ef_before = None
        fs.sent, fs.sent_steps, fs.sent_tokens = None, 0, 0
        self.adoptions += 1

    # ------------------------------------------------------------------ the ledger

    def ledger(self) -> dict[str, int]:
        """Where the fragment-steps this process trained stand (P per inner step; the sending rank's books, zeros
        elsewhere): `acked` (covered by acknowledged Δs), `discarded` (dropped by adoptions), `refused_stale` /
        `refused_other` (covered by Δs the syncer refused: 409 / any other non-2xx answer), `in_flight` (covered by
        a Δ not answered yet) and `unsent` (covered by no sent Δ; with adopt=keep this includes the steps after an
        acknowledged Δ, which ride on the version that merges it). They sum to P·steps, exactly: every step enters
        one fragment's c_steps and leaves it into one of these."""
        if not self.sends:
            return dict.fromkeys(("acked", "discarded", "refused_stale", "refused_other", "in_flight", "unsent"), 0)
        refused = dict(self.refused_settled)
        in_flight, unsent = sum(self.limbo.values()), 0
        for fs in self.frags:
            pending = fs.refused_pending or {}
            for klass, n in pending.items():
                refused[klass] += n
            if fs.in_flight:
                in_flight += fs.sent_steps
            covered = fs.sent_steps if (fs.in_flight or fs.acked) else 0
            unsent += fs.c_steps - covered - sum(pending.values())
        return {"acked": self.steps_acked, "discarded": self.steps_discarded, "refused_stale": refused["stale"],
                "refused_other": refused["other"], "in_flight": in_flight, "unsent": unsent}

    # ------------------------------------------------------------------ across a restart

    def unsent_fragments(self) -> list[int]:
        """The fragments with trained steps that no acknowledged Δ covers (none where this process does not send)."""
        if not self.sends:
            return []
        return [p for p, fs in enumerate(self.frags) if not fs.acked and fs.c_steps > 0]

    def unsent_work(self) -> tuple[dict[str, Tensor], list[dict]]:
        """What a SIGKILL now would lose: each fragment with work no acknowledged Δ covers, as (tensors
        `base.{p}.{name}` and `theta.{p}.{name}`, [{fragment, version, c_steps, c_tokens}]) for the snapshot."""
        tensors: dict[str, Tensor] = {}
        fragments: list[dict] = []
        for p in self.unsent_fragments():
            fs = self.frags[p]
            fragments.append({"fragment": p, "version": fs.version, "c_steps": fs.c_steps, "c_tokens": fs.c_tokens})
            for n in self.plan[p]:
                tensors[f"base.{p}.{n}"] = fs.base[n]
                tensors[f"theta.{p}.{n}"] = self.params[n].detach()
        return tensors, fragments

    def held(self) -> tuple[dict[str, Tensor], dict[int, int]]:
        """The global Θ_p each fragment last adopted, as (tensors `base.{p}.{name}`, {p: version}) for the snapshot:
        what a restart may train from while the syncer shard owning p is down (only a version it issued)."""
        if not self.sends:
            return {}, {}
        tensors = {f"base.{p}.{n}": t for p, fs in enumerate(self.frags) for n, t in fs.base.items()}
        return tensors, {p: fs.version for p, fs in enumerate(self.frags)}

    def resend(self, tensors: dict[str, Tensor], fragments: list[dict], versions_now: dict[int, int],
               learner_id: str, nonce: str) -> list[Submission]:
        """Δs of a previous incarnation's unsent work, under that incarnation's ids (`nonce`): a Δ it had sent from
        the same base already is then a duplicate, never merged twice. Each goes as a rider
        (SubmissionMeta.rider): the syncer applies it to the fragment's current version as it is (where re-anchored
        against a base others have since moved on, it would drag Θ back) and holds it for the fragment's next merge
        (merged alone at once, it would make a version that every other learner's adoption drops its own unsent
        progress for). Had the learner lived, it would have sent that work at its next due step and joined that
        merge. The syncer refuses a base older than the versions it keeps (409), as for any late Δ. A fragment
        whose version went back (a syncer shard lost state) is left out."""
        out = []
        for f in fragments:
            p, version = int(f["fragment"]), int(f["version"])
            now = versions_now.get(p)
            if now is None or now < version:
                continue
            names = self.plan[p]
            deltas = {n: tensors[f"base.{p}.{n}"] - tensors[f"theta.{p}.{n}"] for n in names}
            parts = ErrorFeedback().compress(deltas, self.compression, self.block_size)  # its residual died with it
            sid = submission_id(learner_id, nonce, p, version)
            c_steps, c_tokens = int(f["c_steps"]), int(f["c_tokens"])
            meta = SubmissionMeta(learner_id, sid, p, version, c_steps, c_tokens, rider=True)
            body = encode_submission(meta, parts, self.compression, self.block_size,
                                     {n: tuple(self.params[n].shape) for n in names})
            out.append(Submission(p, version, sid, body, c_steps, c_tokens, recovered=True))
        return out
