"""Typed contracts between the packages: every `/v1` request body and answer of the syncer, its `/v1/status`
document, the learner metrics record (metrics.jsonl) and the local runtime's processes.json. Torch-free on
purpose: the operator, chaos and bench import it without torch (a test checks that)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

LEARNER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"  # the alphabet of wire.SubmissionMeta ids
LearnerId = Annotated[str, Field(pattern=LEARNER_ID_PATTERN)]
Count = Annotated[int, Field(ge=0, le=2**62)]  # steps, tokens: bounded so a hostile value never overflows a counter
Versions = dict[str, int]  # fragment index (as a JSON key) -> version id
# One life (process) of a learner: the nonce its submission ids carry (`{learner}.{life}.p{p}.v{version}`).
LifeId = Annotated[str, Field(pattern=r"^[0-9a-f]{1,32}$")]
LIVES_KEPT = 4  # the syncer remembers a learner's last few lives (/v1/status learners[].incarnations)
DOWNLINK_DTYPES = ("fp32", "bf16")


class ProtocolError(ValueError):
    """A document that does not fit its model; `reason` names the first offending field."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def parse(model: type[BaseModel], data: object):
    """`model` validated from already-decoded JSON `data`; ProtocolError names the field on a bad document."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """One line naming the first offending field, e.g. `unit: Input should be greater than or equal to 0 (got -1)`."""
    err = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"]) or "body"
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{field}: {err['msg']} (got {got})" if err["type"] != "missing" else f"{field}: field required"


class _Request(BaseModel):
    # Strict: "7" is not a step and true is not a unit. Unknown keys are ignored, so a newer learner can add
    # fields without breaking an older syncer.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------------------ requests


class RegisterRequest(_Request):
    """`POST /v1/register`. Every field is required (Decision): a registration without its unit, world size or
    device would show up as an anonymous learner in /v1/status and in the operator's job status, and every
    learner this project ships sends all four; so a body with only `learner_id` is a 400 naming the field."""

    learner_id: LearnerId
    unit: Annotated[int, Field(ge=0, lt=2**31)]
    world_size: Annotated[int, Field(ge=1, le=2**20)]
    device: Annotated[str, Field(min_length=1, max_length=64)]


class HeartbeatRequest(_Request):
    """`POST /v1/heartbeat`: progress of a live learner. `step_time_s` None (or 0) means not measured yet."""

    learner_id: LearnerId
    step: Count
    tokens: Count
    step_time_s: Annotated[float, Field(ge=0, lt=1e6)] | None = None
    # Which life of the learner this is (the nonce of its submission ids) and the fragment-steps its adoptions
    # discarded since it started (outer.adopt=overwrite): the syncer's per-life ledger. Absent from older learners.
    incarnation: LifeId | None = None
    steps_discarded: Count = 0


class FragmentQuery(_Request):
    """`GET /v1/fragments/{p}?after=v&dtype=fp32|bf16&base=v` (query values are strings; see `from_query`).

    `base`: the version the learner holds exactly (fp32), so a quantized down-link may answer with the updates
    from it (docs/protocol.md); an unknown or too old base gets the full fragment."""

    after: int | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"
    base: int | None = None

    @classmethod
    def from_query(cls, query) -> "FragmentQuery":
        """Validate a request's query mapping; ProtocolError names the parameter."""
        after = _version_param(query, "after")
        base = _version_param(query, "base")
        if base is not None and base < 0:
            raise ProtocolError(f"base: must be a version id >= 0 (got {base})")
        dtype = query.get("dtype", "fp32")
        if dtype not in DOWNLINK_DTYPES:
            raise ProtocolError(f"dtype: must be one of {list(DOWNLINK_DTYPES)} (got {dtype[:40]!r})")
        if base is not None and dtype != "fp32":
            raise ProtocolError("base: updates apply to exact fp32 values; do not combine base with dtype=bf16")
        return cls(after=after, dtype=dtype, base=base)


def _version_param(query, name: str) -> int | None:
    raw = query.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if not (text.lstrip("-").isascii() and text.lstrip("-").isdigit() and len(text) <= 20
            and text.count("-") <= int(text.startswith("-"))):
        raise ProtocolError(f"{name}: must be an integer version (got {raw[:40]!r})")
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise ProtocolError(f"{name}: must be a 64-bit integer version (got {value})")
    return value


# ------------------------------------------------------------------------------------------ answers


class ErrorAnswer(_Document):
    """Every 4xx/5xx answer of the syncer: `{"error": reason}`."""

    error: str


class RegisterAnswer(_Document):
    """What a (re)starting learner needs: the run config (a TrainConfig dump), the fragment plan, versions."""

    config: dict
    plan: dict[str, list[str]]
    versions: Versions  # of the fragments this shard owns
    heartbeat_s: float
    shard: int = 0  # which syncer shard answered, of `shards`; it owns the fragments in `owned` (shardmap.py)
    shards: int = 1
    owned: list[int] | None = None  # None from a syncer older than sharding: every fragment
    # Seconds since each owned fragment's current version was published, for those this syncer published (none
    # after a restart until it merges again), and its average of the learners' inner-step time (None: unknown).
    # A learner that joins lines its first sends up with the others' (fragments.aligned_first_due).
    version_age_s: dict[str, float] = Field(default_factory=dict)
    step_s: float | None = None

    def plan_lists(self) -> list[list[str]]:
        return [list(self.plan[str(p)]) for p in range(len(self.plan))]


class HeartbeatAnswer(_Document):
    versions: Versions


class SubmitAnswer(_Document):
    """`202` to `POST /v1/fragments/{p}/outer-gradient`; `duplicate` = the id was already held (never merged twice)."""

    accepted: bool
    duplicate: bool = False
    pending: int = 0
    note: str | None = None  # what the syncer did to it, e.g. clipped to the update norm bound (docs/protocol.md)


class VersionsAnswer(_Document):
    versions: Versions
    outer_steps: int
    tokens_merged: int


class IncarnationWork(_Document):
    """One life (process) of a learner as the syncer saw it: what it trained (as its last heartbeat said) and what of
    that was merged, counted like the learner's merged figures (summed over fragments: P per step). A resend of a
    life's unsent work by the next life carries the first life's id, so it counts there."""

    id: str
    first_seen: float  # unix time of its first heartbeat
    last_seen: float
    steps: int = 0
    tokens: int = 0
    steps_discarded: int = 0  # fragment-steps its adoptions dropped by design (outer.adopt=overwrite)
    steps_merged: int = 0
    tokens_merged: int = 0


class LearnerStatus(_Document):
    """One learner as the syncer sees it: liveness from its requests, merged work from merges."""

    last_seen: float | None = None  # unix time of its last request (None: not seen since the syncer started)
    step: int = 0
    tokens: int = 0
    step_time_s: float | None = None
    tokens_merged: int = 0
    steps_merged: int = 0
    submissions_merged: int = 0
    live: bool = False
    unit: int | None = None
    world_size: int | None = None
    device: str | None = None
    incarnations: list[IncarnationWork] = Field(default_factory=list)  # its last LIVES_KEPT lives, oldest first


class SyncerStatus(_Document):
    """`GET /v1/status`: the syncer's progress for displays, the operator's job status and goodput. The syncer
    fills every field; readers of older or partial samples (syncer.jsonl) get zeros and empty maps instead."""

    versions: Versions = Field(default_factory=dict)
    outer_steps: int = 0
    outer_steps_per_fragment: dict[str, int] = Field(default_factory=dict)
    merges: int = 0
    contributions_merged: int = 0
    tokens_merged: int = 0
    # Riders (docs/protocol.md) this incarnation merged, with other learners' contributions or in merges of riders
    # only: {"with_others": n, "alone": n}.
    riders_merged: dict[str, int] = Field(default_factory=dict)
    learners: dict[str, LearnerStatus] = Field(default_factory=dict)
    live_learners: int = 0
    pending: dict[str, int] = Field(default_factory=dict)
    grace_s: float = 0.0
    quorum: int = 1
    fragments: int = 0
    shard: int = 0  # this syncer's shard index of `shards`, owning the fragments `owned` (the maps above cover them)
    shards: int = 1
    owned: list[int] = Field(default_factory=list)
    uptime_s: float | None = None
    last_checkpoint: float | None = None

    @property
    def pending_total(self) -> int:
        return sum(self.pending.values())


class SyncerSample(_Document):
    """One line of a run's syncer.jsonl: the supervisor's sample of /v1/status (None while the syncer was away)."""

    time: float
    elapsed_s: float
    up: bool  # a sharded syncer: every shard answered
    status: SyncerStatus | None = None  # a sharded syncer: the shards that answered, merged (runtime/shards.py)
    shards_up: list[bool] | None = None  # a sharded syncer: which shards answered

    def to_line(self) -> dict:
        """The flat JSON line (status fields beside time/elapsed_s/up, as the file has always held them)."""
        line = {"time": self.time, "elapsed_s": self.elapsed_s, "up": self.up}
        if self.shards_up is not None:
            line["shards_up"] = self.shards_up
        if self.status is not None:
            line.update(self.status.model_dump(mode="json"))
        return line

    @classmethod
    def from_line(cls, line: dict) -> "SyncerSample":
        status = SyncerStatus.model_validate(line) if line.get("up") else None
        return cls(time=line["time"], elapsed_s=line.get("elapsed_s", 0.0), up=bool(line.get("up")), status=status,
                   shards_up=line.get("shards_up"))


# ------------------------------------------------------------------------------------------ run directory


def _counter(doc: str, default=0):
    """A field the learner's /metrics exports as the counter diloco_learner_<name> (learner/exporter.py)."""
    return Field(default, description=doc, json_schema_extra={"prometheus": "counter"})


def _gauge(doc: str, default=0):
    """A field the learner's /metrics exports as the gauge diloco_learner_<name>."""
    return Field(default, description=doc, json_schema_extra={"prometheus": "gauge"})


class LinkCounters(_Document):
    """What a learner's link to the syncer counts (learner/client.py; a sharded link sums its shards'). The one list
    of these names: the client's stats, the metrics record and /metrics take them from here."""

    superseded: int = 0  # submissions replaced in the outbox by a newer one of the same fragment before being sent
    sent: int = _counter("outer gradients delivered (answered by the syncer)")
    acked: int = _counter("outer gradients acknowledged")
    acked_tokens: int = _counter("tokens covered by acknowledged submissions")
    acked_steps: int = _counter("steps covered by acknowledged submissions")
    duplicates: int = _counter("of acked: resends the syncer already held (answered duplicate, never merged twice)")
    rejected: int = _counter("submissions rejected (4xx)")  # stale bases (409) included; those are dropped
    stale: int = 0
    syncer_up: bool = _gauge("1 if the last request to the syncer succeeded", False)
    pending: int = _gauge("submissions awaiting an answer")
    bytes_up: float = _counter("outer-gradient bytes sent")
    bytes_down: float = _counter("fragment/state bytes received")
    bytes_down_full: float = _counter("of bytes_down: whole fragments and the start-up state")
    versions_rebuilt: int = _counter("fragment versions rebuilt from down-link updates")
    versions_full: int = _counter("fragment versions fetched whole")
    digest_mismatches: int = _counter("rebuilt versions whose digest differed from the syncer's")  # then fetched whole


class LearnerRecord(LinkCounters):
    """One line of a learner's metrics.jsonl: exactly the fields `Learner._record` writes (its own and its link's
    counters), plus `final` on the line written as the learner stops. Counters restart at zero in each incarnation
    of the learner. Fields marked counter or gauge are what its /metrics exports."""

    time: float
    learner_id: str
    unit: int = 0
    world_size: int = 1
    step: int = _gauge("inner steps since (re)start")
    loss: float | None = _gauge("training loss (mean over the last log window)", None)
    tokens: int = _counter("tokens trained since (re)start")
    tokens_per_s: float = _gauge("tokens per second (last log window)", 0.0)
    step_time_s: float | None = _gauge("seconds per inner step", None)
    versions: dict[str, int] = Field(default_factory=dict)
    queued: int = _counter("outer gradients built and queued")
    adoptions: int = _counter("fragment versions adopted")
    steps_kept: int = 0  # steps carried over adoptions on top of the new version (outer.adopt=keep)
    steps_discarded: int = 0  # steps trained on a fragment and overwritten by an adoption (outer.adopt=overwrite)
    # This life's ledger in fragment-steps (P per inner step; learner/outer_sync.OuterSync.ledger, docs/protocol.md
    # Ledger): the buckets sum to P·step.
    ledger_acked: int = _counter("fragment-steps covered by acknowledged outer gradients")
    ledger_discarded: int = _counter("fragment-steps dropped by adoptions (outer.adopt=overwrite)")
    ledger_refused_stale: int = _counter("fragment-steps covered by outer gradients refused as stale (409)")
    ledger_refused_other: int = _counter("fragment-steps covered by outer gradients refused otherwise (non-2xx)")
    ledger_in_flight: int = _gauge("fragment-steps covered by outer gradients not answered yet")
    ledger_unsent: int = _gauge("fragment-steps covered by no outer gradient sent (or riding on an adoption)")
    ledger_resent_refused_stale: int = _counter("fragment-steps of the previous start's resent work refused (409)")
    ledger_resent_refused_other: int = _counter("fragment-steps of the previous start's resent work refused otherwise")
    epoch: int = _gauge("epoch of the data shard")
    lr: float | None = None
    # Snapshots this incarnation wrote (learner/snapshots.py) and their mean seconds on the step (copying tensors) and
    # in the background (encoding, writing): what frequent snapshots cost against step_time_s.
    snapshots: int = 0
    snapshot_capture_s: float | None = None
    snapshot_write_s: float | None = None
    # On an XLA device, torch_xla's own counts so far (learner/devices.py): graphs compiled, seconds compiling, graphs
    # run. Compilations that keep growing with the steps mean a graph changes every step.
    xla_compiles: int | None = _counter("XLA graphs compiled (torch_xla's CompileTime count; 0 off XLA)", None)
    xla_compile_s: float | None = None
    xla_executions: int | None = None
    final: bool = False


def prometheus_fields(model: type[BaseModel], kind: str) -> dict[str, str]:
    """The fields of `model` marked `kind` ("counter" or "gauge"), with their help text."""
    return {name: f.description for name, f in model.model_fields.items()
            if (f.json_schema_extra or {}).get("prometheus") == kind}


class MetricsRecord(LearnerRecord):
    """Any line of a run's learners/<id>/metrics.jsonl, as the readers take it: a learner's record, or a baseline
    worker's (baselines/worker.py), which adds the checkpoint step its incarnation resumed from and, on its last line,
    a digest of its parameters. Unknown keys are ignored; missing counters read as zero."""

    time: float = 0.0
    learner_id: str = ""
    resumed_from_step: int = 0
    param_sha256: str | None = None

    @property
    def steps_in_incarnation(self) -> int:
        """Steps this line's incarnation trained: its step less the checkpoint step it resumed from."""
        return self.step - self.resumed_from_step


class ProcessEntry(_Document):
    """One supervised program in processes.json; `cmdline_tag` is what its command line contains that no other
    process's does (a warm spare that took over a learner keeps showing `--standby DIR`). Other metadata the
    supervisor attaches to a child is kept as it is."""

    model_config = ConfigDict(extra="allow")

    name: str
    role: str  # learner | syncer
    pid: int | None = None
    alive: bool = False
    restarts: int = 0
    finished: bool = False
    started: float | None = None
    cmdline_tag: str | None = None
    state_dir: str | None = None
    slowdown: float | None = None
    rank: int | None = None


class ProcessesDoc(_Document):
    """processes.json of a local run: written atomically by the supervisor, read by `diloco chaos` and bench."""

    supervisor_pid: int
    updated: float
    stopping: bool = False
    processes: list[ProcessEntry] = Field(default_factory=list)
    # Where a tool may ask the supervisor not to restart a child before a time: HOLD_DIR/<name>.json (RestartHold).
    hold_dir: str | None = None

    def process(self, name: str) -> ProcessEntry | None:
        return next((p for p in self.processes if p.name == name), None)


class RestartHold(_Document):
    """HOLD_DIR/<name>.json: the supervisor restarts child `name` no earlier than `until` (wall clock). Written by
    `diloco chaos` before it kills a victim with a downtime, so the replacement cannot come up early (a warm spare
    takes over within a second, sooner than any outside tool can stop it); removed when the downtime ends."""

    until: float
    by: str = ""  # who asked (e.g. the chaos experiment and fault)
