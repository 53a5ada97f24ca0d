"""Files of a run directory that other packages read (summary, `diloco chaos goodput`, bench): one model and one
reader each. events.jsonl: the supervisor's record of its processes. final/state.json has two shapes: the syncer's
last checkpoint state, or a baseline's end record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_trainer.fsutil import read_jsonl
from diloco_trainer.protocol.messages import IncarnationWork, describe

FINAL_STATE = Path("final") / "state.json"
EVENTS = Path("events.jsonl")


class _File(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the syncer's checkpoint state holds much more than its readers need


class LearnerMerged(_File):
    """What the syncer merged of one learner's work, over all its incarnations."""

    tokens_merged: int = 0
    steps_merged: int = 0  # fragment contributions: a step is merged once per fragment
    submissions_merged: int = 0
    lives: list[IncarnationWork] = Field(default_factory=list)  # its last LIVES_KEPT lives (syncer/lives.py)


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


# ------------------------------------------------------------------------------------------------ events.jsonl

EventKind = Literal["start", "exit", "kill", "held", "hold-ignored", "job_restart"]


class RunEvent(_File):
    """One line of events.jsonl: what the supervisor (runtime/procs.py) did to or saw of one process, or a
    synchronous baseline's whole-job restart (`name` "job"). Fields beyond the first four belong to some kinds."""

    time: float
    name: str
    role: str  # learner | syncer | job
    event: EventKind
    pid: int | None = None  # start
    spare: bool = False  # start: a warm spare took the learner over
    standby: bool = False  # start: a warm standby syncer took over
    code: int | None = None  # exit: the exit code (negative: killed by that signal)
    until: float | None = None  # held: restart held until then (unix time)
    reason: str | None = None  # kill, hold-ignored
    # job_restart (baselines/train.py): which worker failed, and what the restart from the checkpoint cost
    restart: int | None = None
    max_restarts: int | None = None
    failed: str | None = None
    checkpoint_step: int | None = None
    failed_step: int | None = None
    lost_steps: int | None = None
    lost_steps_by_worker: dict[str, int] | None = None

    def line(self) -> str:
        """The JSON line: the fields this kind carries (defaults left out)."""
        return self.model_dump_json(exclude_defaults=True) + "\n"


def append_event(path: Path, event: RunEvent) -> None:
    """Append one event to an events.jsonl file (one write, so a killed writer leaves at most a torn last line)."""
    with open(path, "a") as f:
        f.write(event.line())


def read_events(run_dir: Path) -> list[RunEvent]:
    """events.jsonl of `run_dir` as its model ([] if the run has none yet); a torn last line is skipped, a line of
    another shape raises ValueError naming the file and the field."""
    path = Path(run_dir) / EVENTS
    out = []
    for n, raw in enumerate(read_jsonl(path), 1):
        try:
            out.append(RunEvent.model_validate(raw))
        except ValidationError as exc:
            raise ValueError(f"{path}, line {n}: {describe(exc)}") from None
    return out


def starts_by_name(events: list[RunEvent]) -> dict[str, list[float]]:
    """Wall-clock start times of every incarnation of every process."""
    starts: dict[str, list[float]] = {}
    for e in events:
        if e.event == "start":
            starts.setdefault(e.name, []).append(e.time)
    return starts
