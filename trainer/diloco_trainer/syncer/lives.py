"""A learner's lives (processes) as the syncer saw them: what each trained and what of that was merged, the ledger
behind /v1/status learners[].incarnations (the operator's work lost per fault). Pure and torch-free."""

from __future__ import annotations

from collections import OrderedDict

from diloco_trainer.protocol.messages import LIVES_KEPT, IncarnationWork


def life_of(submission_id: str, learner_id: str) -> str | None:
    """The life a learner's submission id names (`{learner}.{life}.p{p}.v{version}`, outer_sync.submission_id),
    None for an id of another form."""
    prefix = learner_id + "."
    if not submission_id.startswith(prefix):
        return None
    parts = submission_id[len(prefix):].split(".")
    return parts[0] if len(parts) == 3 and parts[1].startswith("p") and parts[2].startswith("v") else None


class Lives:
    """The last LIVES_KEPT lives of one learner, in the order the syncer first heard of them."""

    def __init__(self) -> None:
        self.by_id: OrderedDict[str, IncarnationWork] = OrderedDict()

    def _life(self, life: str, now: float) -> IncarnationWork:
        rec = self.by_id.get(life)
        if rec is None:
            rec = self.by_id[life] = IncarnationWork(id=life, first_seen=now, last_seen=now)
            while len(self.by_id) > LIVES_KEPT:
                self.by_id.popitem(last=False)
        return rec

    def heartbeat(self, life: str, steps: int, tokens: int, steps_discarded: int, now: float) -> None:
        rec = self._life(life, now)
        rec.last_seen, rec.steps, rec.tokens, rec.steps_discarded = now, steps, tokens, steps_discarded

    def merged(self, learner_id: str, submission_id: str, steps: int, tokens: int, now: float) -> None:
        """Count a merged contribution to the life that built it (a resend by a later life names the first). A life
        is known from its first heartbeat or its first merged contribution, whichever came first (a learner's first
        sends may be merged before its first heartbeat)."""
        if (life := life_of(submission_id, learner_id)) is None:
            return
        rec = self._life(life, now)
        rec.steps_merged += steps
        rec.tokens_merged += tokens

    def listed(self) -> list[IncarnationWork]:
        return [rec.model_copy() for rec in self.by_id.values()]

    def state_dict(self) -> list[dict]:
        return [rec.model_dump() for rec in self.by_id.values()]

    def load_state_dict(self, records: list[dict]) -> None:
        self.by_id = OrderedDict((r["id"], IncarnationWork.model_validate(r)) for r in records[-LIVES_KEPT:])
