"""Condition types and reasons (constants), and the one way to set a condition: lastTransitionTime moves only
when the status flips."""

from __future__ import annotations

from datetime import datetime, timezone

# Condition types.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
QUORUM_AVAILABLE = "QuorumAvailable"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
PODS_SCHEDULED = "PodsScheduled"  # LearnerUnit only
SCALING_LIMITED = "ScalingLimited"  # DilocoJob with spec.autoscaling
LINK_ENCRYPTED = "LinkEncrypted"  # DilocoJob: TLS between learners and the syncer (spec.syncer.tls)
NODE_LOST = "NodeLost"  # LearnerUnit: True while it moves off a lost node (spec.failurePolicy.nodeLostSeconds)
CLUSTER_REACHABLE = "ClusterReachable"  # LearnerUnit in a remote cluster (spec.clusters)
ADMITTED = "Admitted"  # LearnerUnit of a job queued in Kueue: its Workload is admitted (kueue.py)
CLUSTERS_REACHABLE = "ClustersReachable"  # DilocoJob with spec.clusters: every remote cluster answers
# DilocoJob with a trusted diloco.dev/syncer-url annotation: whether the operator follows it
SYNCER_URL_ANNOTATION = "SyncerUrlAnnotation"


class Reason:
    """Every reason the operator writes, so users and tests can match on them."""

    ALL_UNITS_READY = "AllUnitsReady"
    UNITS_NOT_READY = "UnitsNotReady"
    SYNCER_NOT_READY = "SyncerNotReady"
    STABLE = "Stable"
    CREATING = "Creating"
    SCALING = "Scaling"
    RESTARTING_UNITS = "RestartingUnits"
    HEALTHY = "Healthy"
    UNITS_UNSCHEDULABLE = "UnitsUnschedulable"
    UNITS_FAILED = "UnitsFailed"
    QUORUM_MET = "QuorumMet"
    QUORUM_LOST = "QuorumLost"
    NOT_FINISHED = "NotFinished"
    ALL_UNITS_SUCCEEDED = "AllUnitsSucceeded"
    TOO_FEW_UNITS = "TooFewUnits"
    INVALID_SPEC = "InvalidSpec"
    OBJECT_NOT_OURS = "ObjectNotOurs"  # an object the job needs exists under its name and is someone else's
    # Autoscaling (condition ScalingLimited and the Events of its decisions)
    TARGET_MET = "TargetMet"
    CAPACITY_UNAVAILABLE = "CapacityUnavailable"
    WAITING_FOR_QUOTA = "WaitingForQuota"  # every unit wanted exists; some wait for Kueue to admit their Workloads
    COOLDOWN = "Cooldown"
    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    UNITS_PARKED = "UnitsParked"
    RETRYING_TEMPLATE = "RetryingTemplate"
    CAPACITY_APPEARED = "CapacityAppeared"
    # LinkEncrypted (spec.syncer.tls) and the certificate's Events
    AUTO_CERTIFICATE = "AutoCertificate"
    SECRET_CERTIFICATE = "SecretCertificate"
    TLS_DISABLED = "TLSDisabled"
    TLS_SECRET_INVALID = "TLSSecretInvalid"
    CERTIFICATE_ISSUED = "CertificateIssued"
    # SyncerUrlAnnotation
    ANNOTATION_FOLLOWED = "AnnotationFollowed"
    PLAIN_HTTP_REFUSED = "PlainHttpRefused"  # an http:// syncer URL while TLS is on: the token is not sent there
    # Remote clusters (spec.clusters): conditions ClusterReachable (unit) and ClustersReachable (job)
    CLUSTER_REACHABLE = "ClusterReachable"
    CLUSTER_UNREACHABLE = "ClusterUnreachable"
    KUBECONFIG_REFUSED = "KubeconfigRefused"  # exec plugin, auth-provider or file path: never loaded
    CLUSTERS_REACHABLE = "AllClustersReachable"
    REMOTE_CLEANUP = "RemoteCleanup"
    REMOTE_CLEANUP_FAILED = "RemoteCleanupFailed"
    # Events of the job's own actions
    UNIT_CREATED = "UnitCreated"
    UNIT_REMOVED = "UnitRemoved"
    UNIT_UPDATED = "UnitUpdated"
    PODS_CREATED = "PodsCreated"
    SPARE_TOOK_PLACE = "SpareTookPlace"  # a unit's unplaceable pod gave way to a warm spare of its template
    JOB_SUCCEEDED = "JobSucceeded"
    JOB_FAILED = "JobFailed"
    # spec.chaos run by the operator
    CHAOS_STARTED = "ChaosStarted"
    CHAOS_ENDED = "ChaosEnded"
    CHAOS_REJECTED = "ChaosRejected"
    # LearnerUnit
    PODS_READY = "PodsReady"
    PODS_NOT_READY = "PodsNotReady"
    SCHEDULED = "Scheduled"
    UNSCHEDULABLE = "Unschedulable"
    BACKOFF = "BackOff"
    POD_FAILED = "PodFailed"
    POD_DELETED = "PodDeleted"
    # Deleted by Kubernetes, which said why (the pod's DisruptionTarget condition): a restart, not the unit's failure
    EVICTED_BY_TAINT = "EvictedByTaint"  # the taint manager: e.g. a node not Ready past failurePolicy.nodeLostSeconds
    EVICTED = "Evicted"  # the Eviction API: kubectl drain, a cluster autoscaler's scale-down, a descheduler
    PREEMPTED = "Preempted"  # the scheduler made room for a pod of higher priority
    SPEC_CHANGED = "SpecChanged"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    COMPLETED = "Completed"
    JOB_FINISHED = "JobFinished"
    NOT_CONTROLLED_BY_JOB = "NotControlledByJob"  # names a job that does not control it: refused, never run
    NODE_LOST = "NodeLost"  # a node not Ready for nodeLostSeconds: its pods force-deleted, the unit restarted
    RUNNING_ELSEWHERE = "RunningElsewhere"  # condition NodeLost=False: the unit runs again, on other nodes
    # Admitted (a job queued in Kueue, kueue.py); EvictedByKueue is also the Warning Event of an eviction
    ADMITTED_BY_KUEUE = "AdmittedByKueue"
    QUEUED_IN_KUEUE = "QueuedInKueue"
    EVICTED_BY_KUEUE = "EvictedByKueue"
    KUEUE_DISABLED = "KueueDisabled"  # queued in Kueue, and the operator runs without --kueue: held


def now_iso(now: datetime | None = None) -> str:
    """RFC 3339 UTC timestamp with seconds precision, as Kubernetes writes them."""
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def set_condition(conditions: list[dict], type_: str, status: bool | str, reason: str, message: str,
                  now: datetime, generation: int | None = None) -> list[dict]:
    """Return a new list with condition `type_` set; lastTransitionTime changes only if status changed."""
    status_s = status if isinstance(status, str) else ("True" if status else "False")
    old = next((c for c in conditions if c.get("type") == type_), None)
    ltt = old["lastTransitionTime"] if old and old.get("status") == status_s else now_iso(now)
    new = {"type": type_, "status": status_s, "reason": reason, "message": message, "lastTransitionTime": ltt}
    if generation is not None:
        new["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != type_] + [new] if old is None else \
        [new if c.get("type") == type_ else c for c in conditions]


def get_condition(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def is_true(conditions: list[dict] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return bool(cond and cond.get("status") == "True")
