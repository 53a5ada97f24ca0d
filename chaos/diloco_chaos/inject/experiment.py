"""A chaos experiment description: schedule, target, action and safety limits (pydantic, target-agnostic).

The same description runs against a `diloco local` run and against a DilocoJob; a bad description is
rejected with a ValueError naming the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

# A duration: seconds as an integer, or a string like "90s", "2m", "1h30m", "500ms", "1.5s". The CRD schema carries
# DURATION_PATTERN and minimum 0 (a DilocoJob with `every: ""` or `every: -5` is refused at apply time, naming the
# field); pydantic leaves the check to parse_duration, whose message says what a duration looks like.
DURATION_PATTERN = r"^ *(([0-9]+(\.[0-9]+)?)|([0-9]+(\.[0-9]+)? *(ms|s|m|h|d) *)+)$"
Duration = (Annotated[int, Field(json_schema_extra={"minimum": 0})]
            | Annotated[str, Field(json_schema_extra={"pattern": DURATION_PATTERN})])
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Duration | float | None) -> float | None:
    """Seconds in a duration (int/float seconds, or "2m", "1h30m", "500ms"); ValueError if malformed or negative."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, 2m or 1h, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return float(value)
    text = value.strip().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"expected a duration like 30s, 2m, 1h30m or 500ms, got {value!r}")
    return total


class _Spec(BaseModel):
    # camelCase in YAML (the DilocoJob convention); snake_case accepted too. Unknown fields are errors.
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class ScheduleSpec(_Spec):
    """When faults happen: exactly one of `every` (fixed interval), `cron`, or `mtbf` (per unit, Poisson)."""

    every: Duration | None = None
    cron: str | None = None  # 5 fields (minute resolution) or 6 (croniter: the 6th field is seconds)
    mtbf: Duration | None = None  # mean time between failures of each unit: exponential gaps, per unit
    start_after: Duration = 0  # no fault before this much time has passed
    downtime: Duration = 0  # a killed victim may not come back before this much time has passed
    seed: int = Field(0, ge=0, le=2**32 - 1)

    @field_validator("every", "mtbf", "start_after", "downtime", mode="before")
    @classmethod
    def _duration(cls, v):
        return _normalize_duration(v)

    @field_validator("cron")
    @classmethod
    def _cron(cls, v):
        if v is not None and not croniter.is_valid(v):
            raise ValueError(f"not a valid cron expression: {v!r}")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> "ScheduleSpec":
        given = [k for k in ("every", "cron", "mtbf") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of every, cron or mtbf (got {', '.join(given) or 'none'})")
        for key in ("every", "mtbf"):
            value = getattr(self, key)
            if value is not None and parse_duration(value) <= 0:
                raise ValueError(f"{key} must be longer than zero, got {value!r}")
        return self

    @property
    def kind(self) -> Literal["every", "cron", "mtbf"]:
        return "every" if self.every is not None else "cron" if self.cron is not None else "mtbf"

    @property
    def every_s(self) -> float | None:
        return parse_duration(self.every)

    @property
    def mtbf_s(self) -> float | None:
        return parse_duration(self.mtbf)

    @property
    def start_after_s(self) -> float:
        return parse_duration(self.start_after) or 0.0

    @property
    def downtime_s(self) -> float:
        return parse_duration(self.downtime) or 0.0


class TargetSpec(_Spec):
    """Who may be hit: learner processes/pods, whole learner units, or the syncer; narrowed by unit index,
    labels, and how many (a count or a percentage of the matching units) per fault."""

    kind: Literal["learner", "unit", "syncer"] = "learner"
    units: list[Annotated[int, Field(le=100_000)]] | None = None  # unit indices; None = every unit
    labels: dict[str, str] = Field(default_factory=dict)  # all must match (a matchLabels selector)
    count: int | None = Field(None, ge=1, le=10000)  # victims per fault (default 1)
    percent: float | None = Field(None, gt=0, le=100)  # or: this share of the matching units per fault

    @field_validator("units")
    @classmethod
    def _indices(cls, v):
        if v is not None:
            if not v:
                raise ValueError("an empty list matches no unit; leave units out to match every unit")
            if any(i < 0 for i in v):
                raise ValueError(f"unit indices start at 0, got {v}")
        return v

    @model_validator(mode="after")
    def _one_way_to_count(self) -> "TargetSpec":
        if self.count is not None and self.percent is not None:
            raise ValueError("give count or percent, not both")
        if self.kind == "syncer" and (self.units is not None or self.percent is not None):
            raise ValueError("units and percent select learner units; a syncer target takes neither")
        return self


class ActionSpec(_Spec):
    """What happens to a victim: `kill` (SIGKILL / pod delete), `fail` with an exit code, or `pause`
    (SIGSTOP for `duration`, then SIGCONT: a straggler, not a death)."""

    type: Literal["kill", "fail", "pause"] = "kill"
    exit_code: int | None = Field(None, ge=1, le=255)
    duration: Duration | None = None

    @field_validator("duration", mode="before")
    @classmethod
    def _duration(cls, v):
        return _normalize_duration(v)

    @model_validator(mode="after")
    def _params_match_type(self) -> "ActionSpec":
        if self.type == "fail" and self.exit_code is None:
            raise ValueError("a fail action needs exitCode (1-255)")
        if self.type != "fail" and self.exit_code is not None:
            raise ValueError(f"exitCode applies only to the fail action, not {self.type}")
        if self.type == "pause" and not parse_duration(self.duration):
            raise ValueError("a pause action needs a duration longer than zero (e.g. 20s)")
        if self.type != "pause" and self.duration is not None:
            raise ValueError(f"duration applies only to the pause action, not {self.type}")
        return self

    @property
    def duration_s(self) -> float:
        return parse_duration(self.duration) or 0.0


class SafetySpec(_Spec):
    """Limits that hold whatever the schedule says."""

    min_alive_units: int = Field(1, ge=0, le=10000)  # never take the number of healthy learner units below this
    max_concurrent: int = Field(1, ge=1, le=10000)  # at most this many victims down (not yet recovered) at once
    max_duration: Duration = "30m"  # no fault after this long; the experiment then ends
    max_faults: int | None = Field(None, ge=1, le=1_000_000)
    recovery_timeout: Duration = "5m"  # a victim not trained again within this is recorded as not recovered
    namespace: str | None = None  # Kubernetes: only this namespace (default: the kubeconfig's)

    @field_validator("max_duration", "recovery_timeout", mode="before")
    @classmethod
    def _duration(cls, v):
        if not parse_duration(v):
            raise ValueError(f"must be a duration longer than zero, got {v!r}")
        return _normalize_duration(v)

    @property
    def max_duration_s(self) -> float:
        return parse_duration(self.max_duration)

    @property
    def recovery_timeout_s(self) -> float:
        return parse_duration(self.recovery_timeout)


class _Chaos(_Spec):
    """What an experiment does, wherever it runs: its schedule, whom it hits, how, and its safety limits."""

    description: str = ""
    schedule: ScheduleSpec
    target: TargetSpec = Field(default_factory=TargetSpec)
    action: ActionSpec = Field(default_factory=ActionSpec)
    safety: SafetySpec = Field(default_factory=SafetySpec)
    dry_run: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "_Chaos":
        if self.target.kind == "syncer" and self.schedule.kind == "mtbf":
            raise ValueError("schedule.mtbf is per learner unit; use every or cron for a syncer target")
        if self.action.type == "pause" and self.schedule.downtime_s:
            raise ValueError("schedule.downtime applies to kill and fail; a pause already has action.duration")
        return self


class Experiment(_Chaos):
    """One chaos experiment. `dry_run` prints and records what would happen and touches nothing."""

    name: str = Field(..., max_length=63)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v):
        if not _DNS_LABEL.fullmatch(v):
            raise ValueError(f"must be lowercase letters, digits and '-' (a DNS label, used in Event names), got {v!r}")
        return v


class JobChaos(_Chaos):
    """A DilocoJob's `spec.chaos`: an experiment on that job's own units (name and namespace come from the job)."""

    def to_experiment(self, job: str, namespace: str) -> Experiment:
        """The experiment the operator runs for job `namespace/job` (its own namespace, whatever safety says)."""
        safety = self.safety.model_copy(update={"namespace": namespace})
        return Experiment(name=f"{job}-chaos"[:63].rstrip("-"), description=self.description,
                          schedule=self.schedule, target=self.target, action=self.action, safety=safety,
                          dry_run=self.dry_run)


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not str(part).startswith("function-after"))


def _normalize_duration(v):
    """Before validation: check a duration and keep it as int seconds or a string (floats become "1.5s")."""
    if v is None:
        return v
    parse_duration(v)
    return f"{v:g}s" if isinstance(v, float) else v


def parse_experiment(raw: dict) -> Experiment:
    """Validate a parsed description; a ValueError names each bad field (e.g. `schedule.every: ...`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"an experiment must be a mapping of fields, got {type(raw).__name__}")
    try:
        return Experiment.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = _field_path(err["loc"]) or "experiment"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
        raise ValueError("invalid chaos experiment:\n  " + "\n  ".join(dict.fromkeys(lines))) from None


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment YAML file (errors name the file and the field)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"experiment file {str(path)!r} not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_experiment(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
