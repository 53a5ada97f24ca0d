"""The record of a chaos experiment (`diloco chaos run --record`, bench): one JSON line per thing the runner did,
as one model with one writer and one reader. Written by diloco_chaos, read by it, the operator and bench."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from diloco_trainer.fsutil import read_jsonl
from diloco_trainer.protocol.messages import describe

EntryKind = Literal["experiment", "resumed", "fault", "skipped", "held", "released", "recovery", "ending", "error",
                    "end"]


class ChaosEntry(BaseModel):
    """One line of the record. Fields beyond `event` and `time` belong to some kinds (noted beside them); a target's
    own details on held / released lines are kept as extra fields."""

    model_config = ConfigDict(extra="allow")

    event: EntryKind
    time: float
    fault: int | None = None  # fault, held, released, recovery, error: the fault's number
    unit: str | None = None
    # experiment
    name: str | None = None
    description: str | None = None
    target: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    # resumed
    missed_ticks: int | None = None
    started_at: float | None = None
    # fault, skipped
    tick: int | None = None
    scheduled_at: float | None = None
    role: str | None = None
    members: list[str] | None = None
    action: str | None = None  # kill | fail | pause
    exit_code: int | None = None
    back_at: float | None = None  # also on recovery
    why: str | None = None
    dry_run: bool | None = None  # also on experiment
    details: dict[str, Any] | None = None
    # skipped, ending, end
    reason: str | None = None
    # held
    until: float | None = None
    # recovery (record.RecoveryTracker)
    injected_at: float | None = None
    replacement_started_at: float | None = None
    trained_again_at: float | None = None
    merged_again_at: float | None = None
    trained_again_s: float | None = None
    merged_again_s: float | None = None
    recovered: bool | None = None
    note: str | None = None
    # end
    elapsed_s: float | None = None
    summary: dict[str, Any] | None = None
    # error
    error: str | None = None

    def line(self) -> str:
        """The JSON line: the fields this kind carries (unset ones left out; a target's odd values as strings)."""
        return json.dumps(self.model_dump(exclude_none=True), default=str) + "\n"


def append_entry(path: Path, entry: ChaosEntry) -> None:
    """Append one entry to a record file (one write, flushed at once: a killed experiment keeps what it did)."""
    path.parent.mkdir(parents=True, exist_ok=True)  # on first use: a refused run leaves nothing
    with open(path, "a") as f:
        f.write(entry.line())


def read_record(path: Path) -> list[ChaosEntry]:
    """Every complete line of a record file as its model (a torn last line is skipped; none if there is no file);
    a line of another shape raises ValueError naming the file, the line and the field."""
    out = []
    for n, raw in enumerate(read_jsonl(Path(path)), 1):
        try:
            out.append(ChaosEntry.model_validate(raw))
        except ValidationError as exc:
            raise ValueError(f"{path}, line {n}: {describe(exc)}") from None
    return out
