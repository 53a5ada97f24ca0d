"""Work lost per unit fault: what the learner life a restart ended had trained that no merge covers, from the
syncer's per-life ledger (/v1/status learners[].incarnations). Pure: no I/O, no kopf."""

from __future__ import annotations

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_trainer.protocol.messages import IncarnationWork, LearnerStatus


def ended_life(learner: LearnerStatus, fault_at: float) -> IncarnationWork | None:
    """The learner life that ran when the fault came: the last one the syncer first heard from before it. A fault's
    time is in whole seconds (floored), so a life first heard of within that second counts as before it."""
    return max((i for i in learner.incarnations if i.first_seen < fault_at + 1.0), key=lambda i: i.first_seen,
               default=None)


def work_lost(life: IncarnationWork, fragments: int) -> tuple[int, int]:
    """(steps, tokens) a life trained that no merge covers and that its own adoptions did not discard by design
    (outer.adopt=overwrite drops the steps since a send when a newer version comes: mergedFraction counts those).
    Merged and discarded work is counted per fragment, so it is divided by the P fragments."""
    if life.steps <= 0:
        return 0, 0
    per_step = life.tokens / life.steps
    covered_steps = (life.steps_merged + life.steps_discarded) / fragments
    covered_tokens = (life.tokens_merged + life.steps_discarded * per_step) / fragments
    return max(0, round(life.steps - covered_steps)), max(0, round(life.tokens - covered_tokens))


def fault_work(fault: api.UnitFault, learner: LearnerStatus | None, fragments: int,
               unit_ended: bool) -> api.UnitFault:
    """`fault` (a LearnerUnit's status.lastFault) with lostSteps and lostTokens (and trainingAgainSeconds, from the
    fault to the syncer first hearing of the next life, which it does once that life trained a step; the fault's
    time is in whole seconds, so up to 1 s more), once the syncer can tell: a later
    life has trained a step (so its start-up resend of the ended life's snapshot went out), or none will follow
    (`unit_ended`: a failed unit). Recomputed while the figures move (a resend merged late lowers them); `fault`
    as it was otherwise."""
    if learner is None or fragments < 1 or (at := C.parse_time(fault.time)) is None:
        return fault
    life = ended_life(learner, at.timestamp())
    if life is None:
        return fault
    after = [i for i in learner.incarnations if i.first_seen > life.first_seen and i.steps > 0]
    if not (after or unit_ended):
        return fault
    steps, tokens = work_lost(life, fragments)
    told = {"lostSteps": steps, "lostTokens": tokens}
    if after:  # the next life reports once it trained a step: heard of within a heartbeat of training again
        told["trainingAgainSeconds"] = round(min(i.first_seen for i in after) - at.timestamp(), 1)
    return fault.model_copy(update=told)

