"""Where faults land: local learner processes (`local.py`) or pods of a DilocoJob (`kubernetes.py`).

Every target offers the same async operations, so one experiment description runs against both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from diloco_chaos.inject.experiment import Experiment
from diloco_chaos.inject.guards import Candidate
from diloco_chaos.inject.record import UnitObservation


@dataclass(frozen=True)
class Fault:
    """One injected fault: which unit and members, what action, and when it may come back."""

    id: int
    unit: str
    role: str
    members: tuple[str, ...]
    action: str  # kill | fail | pause
    at: float
    back_at: float  # end of the pause or of the downtime (== at when neither applies)
    exit_code: int | None = None
    experiment: str = ""
    why: str = ""


class Target(Protocol):
    """The operations a runner needs; every method is safe to call repeatedly."""

    def describe(self) -> dict: ...

    async def preflight(self, exp: Experiment) -> None:
        """Raise ValueError (naming the field) if this target cannot run `exp`, before anything happens."""

    async def ended(self) -> str | None:
        """Why the run under test is over (no more faults make sense), else None."""

    async def candidates(self) -> list[Candidate]: ...

    async def observe(self) -> dict[str, UnitObservation]: ...

    async def inject(self, fault: Fault) -> dict:
        """Apply the fault; returns details for the record. Raises RuntimeError if it could not be applied."""

    async def hold(self, fault: Fault) -> dict | None:
        """During a downtime: keep the victim from coming back (returns a record entry when it acted)."""

    async def release(self, fault: Fault) -> dict | None:
        """End of a pause or downtime: let the victim go on."""

    async def close(self) -> None: ...
