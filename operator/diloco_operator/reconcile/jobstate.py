"""What the operator remembers of each DilocoJob between reconciles, one JobState per job keyed by its UID: a job's
deletion drops it in one place (JobStates.drop), and a job re-created under an old name starts from nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco_operator.plan.jobstatus import SyncerReading


@dataclass
class SyncerTls:
    """The syncer's certificate as the operator last saw it (spec.syncer.tls)."""

    secret: str | None = None  # the Secret the syncer serves from (None: plain HTTP)
    ca: str | None = None  # ca.crt (PEM): what learners and the operator verify the syncer against
    cert_hash: str | None = None  # of tls.crt: a new certificate rolls the syncer
    problem: str | None = None  # what is wrong with the user's Secret, naming the field
    events: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class TlsRead:
    """The syncer's TLS as last read for one (mode, Secret) of the job's spec, and when (Secrets are not watched)."""

    mode: str
    secret: str
    state: SyncerTls
    at: float


@dataclass
class JobState:
    """One job's memory: read-once values, the syncer's last answers, and when slow looks were last taken."""

    namespace: str
    name: str
    uid: str
    token: str | None = None  # the syncer's bearer token (read once from its Secret: created once, never changed)
    epochs: dict[str, dict] | None = None  # the learner epochs document as last written (jobplan.token_epochs)
    tls: TlsRead | None = None
    syncer_readings: dict[int, SyncerReading] = field(default_factory=dict)  # shard -> its last /v1/status
    syncer_polled: dict[str, float] = field(default_factory=dict)  # shard URL -> when its poll last started
    swept_at: float = 0.0  # when objects removed units left in remote clusters were last swept
    # cluster -> (template -> units that fit there, when): remote Nodes are listed, not watched
    remote_room: dict[str, tuple[dict[str, int | None], float]] = field(default_factory=dict)


class JobStates:
    """Every job's JobState by UID. `of(job)` is the only way one is made; `drop(ns, name)` forgets a job."""

    def __init__(self) -> None:
        self.by_uid: dict[str, JobState] = {}

    def __len__(self) -> int:
        return len(self.by_uid)

    def of(self, job: dict) -> JobState:
        """The state of `job` (made if new). An older job of the same name (deleted and re-created before its
        deletion was handled) is forgotten here: nothing it read is used for the new one."""
        meta = job["metadata"]
        uid = meta.get("uid") or ""
        state = self.by_uid.get(uid)
        if state is None:
            self.drop(meta["namespace"], meta["name"])
            state = self.by_uid[uid] = JobState(meta["namespace"], meta["name"], uid)
        return state

    def get(self, uid: str) -> JobState | None:
        """The state of the job with `uid`, if that job is still known (None once it was dropped)."""
        return self.by_uid.get(uid)

    def drop(self, namespace: str, name: str) -> None:
        """Forget every job of that name (whatever its UID)."""
        for uid in [u for u, s in self.by_uid.items() if (s.namespace, s.name) == (namespace, name)]:
            del self.by_uid[uid]
