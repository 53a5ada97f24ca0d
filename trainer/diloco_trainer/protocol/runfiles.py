"""Files of a run directory that other packages read (summary, `diloco chaos goodput`, bench): one model and one
reader each. final/state.json has two shapes: the syncer's last checkpoint state, or a baseline's end record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_trainer.protocol.messages import describe

FINAL_STATE = Path("final") / "state.json"


class _File(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the syncer's checkpoint state holds much more than its readers need


class LearnerMerged(_File):
    """What the syncer merged of one learner's work, over all its incarnations."""

    tokens_merged: int = 0
    steps_merged: int = 0  # fragment contributions: a step is merged once per fragment
    submissions_merged: int = 0


class SyncerFinalState(_File):
    """Decoupled DiLoCo: the syncer's last checkpoint state (a sharded syncer's shards combined: runtime/shards.py).
    Per-fragment maps are keyed by the fragment index as a string."""

    versions: dict[str, int] = Field(default_factory=dict)
    outer_steps: dict[str, int] = Field(default_factory=dict)
    tokens_merged: int = 0
    contributions_merged: int = 0
    learners: dict[str, LearnerMerged] = Field(default_factory=dict)


class BaselineFinalState(_File):
    """A synchronous baseline (DDP, synchronous DiLoCo): how far its last incarnation trained."""

    mode: Literal["ddp", "sync-diloco"]
    steps: int
    outer_steps: int
    learners: int  # the workers (world size)
    wall_s: float


FinalState = SyncerFinalState | BaselineFinalState


def read_final_state(run_dir: Path) -> FinalState | None:
    """final/state.json of `run_dir` as its model (a baseline's is the one with `mode`); None if the run left none.
    A file of neither shape raises ValueError naming the file and the field."""
    path = Path(run_dir) / FINAL_STATE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    model = BaselineFinalState if "mode" in raw else SyncerFinalState
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{path}: {describe(exc)}") from None
