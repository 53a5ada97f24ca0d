"""The DilocoJob and LearnerUnit API (diloco.dev/v1alpha1) as pydantic models; the CRD schemas are generated
from these (see schema.py), and the training config part is the trainer's own TrainConfig.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco_chaos.inject.experiment import JobChaos
from diloco_trainer.config import TrainConfig

GROUP = "diloco.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SYNCER_PORT = 8470
METRICS_PORT = 8471
MASTER_PORT = 29500

# accelerator type -> (extended resource, node label that selects it, learner --device)
ACCELERATORS: dict[str, tuple[str | None, str | None, str]] = {
    "cpu": (None, None, "cpu"),
    "nvidia-tesla-t4": ("nvidia.com/gpu", "cloud.google.com/gke-accelerator", "cuda"),
    "nvidia-l4": ("nvidia.com/gpu", "cloud.google.com/gke-accelerator", "cuda"),
    "nvidia-a100-80gb": ("nvidia.com/gpu", "cloud.google.com/gke-accelerator", "cuda"),
    "nvidia-h100-80gb": ("nvidia.com/gpu", "cloud.google.com/gke-accelerator", "cuda"),
    "nvidia-h200-141gb": ("nvidia.com/gpu", "cloud.google.com/gke-accelerator", "cuda"),
    "tpu-v5-lite-podslice": ("google.com/tpu", "cloud.google.com/gke-tpu-accelerator", "xla"),
    "tpu-v5p-slice": ("google.com/tpu", "cloud.google.com/gke-tpu-accelerator", "xla"),
    "tpu-v6e-slice": ("google.com/tpu", "cloud.google.com/gke-tpu-accelerator", "xla"),
}
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
# Labels only accelerator nodes carry (GKE's, and the NVIDIA GPU feature discovery's): CPU work must avoid them.
ACCELERATOR_NODE_LABELS = ("nvidia.com/gpu.present", "cloud.google.com/gke-accelerator",
                           "cloud.google.com/gke-tpu-accelerator")
AcceleratorType = Literal[
    "cpu", "nvidia-tesla-t4", "nvidia-l4", "nvidia-a100-80gb", "nvidia-h100-80gb", "nvidia-h200-141gb",
    "tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu-v6e-slice",
]
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_STEPS = 10**9
# Kubernetes's quantity grammar (resource.Quantity, as upstream CRDs write it) without the minus sign: requests,
# limits and volume sizes are never negative. Go's regexp (the apiserver's) and pydantic's agree on it.
QUANTITY_PATTERN = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# Rendered as x-kubernetes-int-or-string: an integer >= 0 or a quantity string.
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY_PATTERN)]


class _Api(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(_Api):
    """Container requests and limits (Kubernetes quantities)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class Toleration(_Api):
    """A Kubernetes toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = Field(None, le=31_536_000, description="At most a year (31,536,000 s).")


class Accelerator(_Api):
    """What each pod of a unit runs on: an accelerator type (cpu, a GPU or a TPU slice) and a count per pod."""

    type: AcceleratorType = "cpu"
    count: int = Field(0, ge=0, le=64)
    topology: str | None = Field(None, pattern=r"^[0-9]+(x[0-9]+){1,2}$")  # TPU slice topology, e.g. 2x2x2

    @model_validator(mode="after")
    def _count_matches_type(self) -> "Accelerator":
        if self.type == "cpu" and self.count:
            raise ValueError("accelerator.count must be 0 when accelerator.type is cpu")
        if self.type != "cpu" and not self.count:
            raise ValueError(f"accelerator.count must be at least 1 for accelerator.type {self.type}")
        if self.topology and not self.type.startswith("tpu-"):
            raise ValueError("accelerator.topology applies only to TPU types")
        return self


MAX_UNITS_PER_TEMPLATE = 1000  # a larger job spreads its units over several templates


MAX_SPARES = 16


class UnitTemplate(_Api):
    """A kind of learner unit: how many, how many pods each, on which accelerators and node pool."""

    name: str = Field(..., min_length=1, max_length=20, pattern=DNS_LABEL)
    image: str | None = Field(None, min_length=1, max_length=1024,
                              description="The learner image of these units (default: spec.image), e.g. a TPU image "
                                          "with torch_xla beside a CUDA one in a mixed job.")
    count: int = Field(1, ge=0, le=MAX_UNITS_PER_TEMPLATE)
    minCount: int = Field(0, ge=0, le=MAX_UNITS_PER_TEMPLATE)
    maxCount: int | None = Field(None, ge=0, le=MAX_UNITS_PER_TEMPLATE)
    podsPerUnit: int = Field(1, ge=1, le=64)
    accelerator: Accelerator = Field(default_factory=Accelerator)
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    # learner --steps; None trains until stopped
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Inner steps per learner (1 to 10^9).")
    stateVolume: Checkpoint | None = None  # per-pod PVC for --state-dir, kept across restarts (else emptyDir)
    cluster: str | None = Field(None, min_length=1, max_length=63, pattern=DNS_LABEL,
                                description="The name of a spec.clusters entry to run these units in (default: the "
                                            "operator's own cluster).")
    spares: int = Field(0, ge=0, le=MAX_SPARES,
                        description="Warm spare pods of this template (0 to 16): started, torch imported, waiting; "
                                    "a unit whose pod dies or is deleted takes one over at once. Each holds the "
                                    "template's resources. Units of one pod, without stateVolume, in the "
                                    "operator's own cluster.")

    @model_validator(mode="after")
    def _bounds(self) -> "UnitTemplate":
        if self.spares and (self.podsPerUnit > 1 or self.stateVolume is not None or self.cluster is not None):
            raise ValueError(f"units[{self.name}].spares applies only to units of one pod, without stateVolume, in "
                             "the operator's own cluster")
        if self.minCount > self.count:
            raise ValueError(f"units[{self.name}].minCount ({self.minCount}) must be <= count ({self.count})")
        if self.maxCount is not None and self.count > self.maxCount:
            raise ValueError(f"units[{self.name}].count ({self.count}) must be <= maxCount ({self.maxCount})")
        return self


class Checkpoint(_Api):
    """A PersistentVolumeClaim: the syncer's checkpoint volume, or a learner's state volume."""

    size: str = Field("10Gi", max_length=64, pattern=QUANTITY_PATTERN,
                      description="A quantity greater than zero, e.g. 10Gi.")
    storageClassName: str | None = None

    @field_validator("size")
    @classmethod
    def _positive(cls, v: str) -> str:
        mantissa = re.match(r"^\+?([0-9.]*)", v).group(1)
        if not float(mantissa) > 0:
            raise ValueError(f"size must be greater than zero, got {v!r}")
        return v


class ClaimSource(_Api):
    """An existing PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany when pods land on several nodes)."""

    claimName: str = Field(..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class NfsSource(_Api):
    """An NFS export."""

    server: str = Field(..., min_length=1, max_length=253)
    path: str = Field(..., min_length=1, max_length=4096, pattern=r"^/")


class CsiSource(_Api):
    """A CSI volume (e.g. a bucket through a FUSE CSI driver)."""

    driver: str = Field(..., min_length=1, max_length=63)
    volumeAttributes: dict[str, str] = Field(default_factory=dict)


class DataVolume(_Api):
    """Read-only training data: token shards, a tokenizer, a model checkpoint. Mounted read-only at mountPath into
    every learner pod and the syncer (which builds the initial model from it); the config's paths point inside it."""

    mountPath: str = Field("/data", min_length=2, max_length=256, pattern=r"^/[^:]*[^/:]$",
                           description="Where the volume appears in the pods (an absolute path, not /).")
    subPath: str | None = Field(None, min_length=1, max_length=4096, pattern=r"^[^/]",
                                description="A directory inside the volume to mount instead of its root.")
    persistentVolumeClaim: ClaimSource | None = None
    nfs: NfsSource | None = None
    csi: CsiSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "DataVolume":
        given = [k for k in ("persistentVolumeClaim", "nfs", "csi") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"data must name exactly one volume source of persistentVolumeClaim, nfs, csi; "
                             f"got {given or 'none'}")
        return self

    def volume(self, name: str) -> dict:
        """The pod volume (read-only) for this source."""
        if self.persistentVolumeClaim is not None:
            return {"name": name, "persistentVolumeClaim": {"claimName": self.persistentVolumeClaim.claimName,
                                                            "readOnly": True}}
        if self.nfs is not None:
            return {"name": name, "nfs": {"server": self.nfs.server, "path": self.nfs.path, "readOnly": True}}
        assert self.csi is not None
        return {"name": name, "csi": {"driver": self.csi.driver, "readOnly": True,
                                      "volumeAttributes": dict(self.csi.volumeAttributes)}}

    def mount(self, name: str) -> dict:
        out = {"name": name, "mountPath": self.mountPath, "readOnly": True}
        if self.subPath:
            out["subPath"] = self.subPath
        return out


class SyncerTls(_Api):
    """TLS between the learners and the syncer (docs/operator.md "TLS")."""

    mode: Literal["Auto", "Secret", "Disabled"] | None = Field(
        None, description="Auto (the default without secretName): the operator issues a CA and the syncer's "
                          "certificate and renews it. Secret (the default with secretName): the syncer serves "
                          "secretName's certificate. Disabled: plain HTTP, with a Warning Event and the condition "
                          "LinkEncrypted=False.")
    secretName: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                                   description="A Secret in the job's namespace with the keys tls.crt, tls.key "
                                               "and ca.crt (what cert-manager writes).")

    @model_validator(mode="after")
    def _consistent(self) -> "SyncerTls":
        if self.secretName and self.mode not in (None, "Secret"):
            raise ValueError(f"syncer.tls.secretName applies only with mode Secret, not {self.mode}")
        if self.mode == "Secret" and not self.secretName:
            raise ValueError("syncer.tls.mode Secret needs syncer.tls.secretName")
        return self

    @property
    def effective_mode(self) -> str:
        return self.mode or ("Secret" if self.secretName else "Auto")


# What a syncer may request: it runs outside Kueue's quota (Kueue admits the units), so an accelerator or any other
# extended resource on it (doubled by the standby, times its shards) would be a way round the quota (issue 38).
SYNCER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
SYNCER_RESOURCES_MESSAGE = ("syncer.resources may name only cpu, memory and ephemeral-storage: the syncer runs "
                            "outside Kueue's quota, so an accelerator or other extended resource is refused there")


class SyncerSpec(_Api):
    """Where and how big the syncer runs."""

    resources: Resources = Field(default_factory=Resources,
                                 description="Container requests and limits: cpu, memory and ephemeral-storage only "
                                             "(the syncer runs outside Kueue's quota).")
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    maxBodyMb: int = Field(256, ge=1, le=4096)
    tls: SyncerTls = Field(default_factory=SyncerTls)
    standby: bool = Field(True, description="Run a warm standby syncer beside each shard's syncer, in the same pod "
                                            "and on the same checkpoint volume: it serves within about a second "
                                            "when the syncer process dies (docs/operator.md \"Syncer shards\"). "
                                            "It reserves the syncer's resources twice.")

    @field_validator("resources")
    @classmethod
    def _no_extended_resources(cls, resources: Resources) -> Resources:
        extra = sorted({*resources.requests, *resources.limits} - set(SYNCER_RESOURCES))
        if extra:
            raise ValueError(f"{SYNCER_RESOURCES_MESSAGE} (got {', '.join(extra)})")
        return resources


class SecretKey(_Api):
    """A key of a Secret in the job's namespace."""

    name: str = Field(..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field("kubeconfig", min_length=1, max_length=253)


class RemoteCluster(_Api):
    """Another Kubernetes cluster that runs some of the job's learner units (docs/operator.md "Remote clusters")."""

    name: str = Field(..., min_length=1, max_length=63, pattern=DNS_LABEL)
    kubeconfigSecret: SecretKey = Field(..., description="A kubeconfig (contexts, exec plugins as kubectl reads "
                                                         "them) for that cluster, in a Secret of the job's namespace.")
    context: str | None = Field(None, min_length=1, max_length=253, description="Default: the current-context.")
    namespace: str | None = Field(None, min_length=1, max_length=63, pattern=DNS_LABEL,
                                  description="Where the units' pods go there (default: the job's namespace name); "
                                              "created if missing.")
    syncerUrl: str = Field(..., min_length=1, max_length=4096, pattern=r"^https?://[^\s,]+(,https?://[^\s,]+)*$",
                           description="How pods in that cluster reach the syncer (a LoadBalancer, Ingress or any "
                                       "address routed to the syncer Service): one URL, or one per syncer shard in "
                                       "shard order, comma-separated. With TLS its host names are added to the "
                                       "syncer's Auto certificate.")


HTTPS_SYNCER_URL = ("clusters[].syncerUrl must be https:// while spec.syncer.tls is on (mode Auto or Secret): learners "
                    "send their tokens there; set spec.syncer.tls.mode Disabled to allow http://")


def plain_http_urls(urls: str) -> list[str]:
    """The comma-separated `urls` that are not https://."""
    return [u for u in urls.split(",") if not u.startswith("https://")]


class RestartPolicy(_Api):
    """Per-unit healing: exponential backoff between whole-unit restarts, and when to give up on a unit."""

    maxRestarts: int = Field(10, ge=0, le=10000, description="Restarts before a unit fails for good (0 to 10000).")
    backoffSeconds: float = Field(10.0, ge=0, le=3600)
    maxBackoffSeconds: float = Field(300.0, ge=0, le=86400)


NODE_LOST_SECONDS = 20  # default of failurePolicy.nodeLostSeconds
DRAIN_SECONDS = 10  # default of failurePolicy.drainSeconds (the learner's own --drain-s default)
# A learner pod's terminationGracePeriodSeconds beyond drainSeconds: the inner step in progress when the signal came
# and the snapshot of the inner state it writes before handing over (a tiny model's take milliseconds).
STOP_MARGIN_SECONDS = 10


class FailurePolicy(_Api):
    """What counts as a failure the operator acts on by itself (a node that stopped being Ready), and how long a
    stopping learner may take to hand over its work."""

    nodeLostSeconds: int = Field(
        NODE_LOST_SECONDS, ge=5, le=86400,
        description="A node whose Ready condition has not been True for this long (5 to 86400 s) is lost: its "
                    "learner pods are force-deleted and their units restart on other nodes (with Nodes watched), and "
                    "every pod of the job tolerates the not-ready/unreachable taints this long (Kubernetes' "
                    "default: 300 s).")
    drainSeconds: int = Field(
        DRAIN_SECONDS, ge=0, le=3600,
        description="A learner whose pod is deleted with a grace period (preemption, a node drain, a scale-down) "
                    "finishes its step, sends the outer gradients of the steps it trained that no acknowledged one "
                    "covers, and waits at most this long (0 to 3600 s) for the syncer's acknowledgements, then "
                    "exits 0. Its pods' terminationGracePeriodSeconds is this plus 10 s for the step in progress.")

    @property
    def termination_grace_seconds(self) -> int:
        """The learner pods' terminationGracePeriodSeconds: the drain, the step in progress and the snapshot."""
        return self.drainSeconds + STOP_MARGIN_SECONDS


class Autoscaling(_Api):
    """Capacity-aware autoscaling: how many units the job may run and in which order its templates are filled."""

    minUnits: int = Field(1, ge=0, le=10000, description="Never fewer units on purpose (0 to 10000).")
    maxUnits: int = Field(..., ge=1, le=10000, description="Never more units (1 to 10000).")
    preference: list[Annotated[str, Field(max_length=20, pattern=DNS_LABEL)]] = Field(default_factory=list, max_length=16,
                                  description="Template names, best first; unnamed templates follow in spec order.")
    provisioningTimeoutSeconds: float = Field(
        300, ge=0, le=86400, description="How long a unit's pods may stay Unschedulable (e.g. while a cluster "
                                         "autoscaler adds nodes) before the unit is parked.")
    retryBackoffSeconds: float = Field(60, ge=0, le=86400,
                                       description="A parked template is retried after this, doubled per park.")
    maxRetryBackoffSeconds: float = Field(1800, ge=0, le=604800, description="Cap of the retry backoff.")
    scaleUpCooldownSeconds: float = Field(30, ge=0, le=86400, description="At least this between two scale-ups.")
    scaleDownCooldownSeconds: float = Field(
        30, ge=0, le=86400, description="At least this after a scale-up or a park before units are parked again.")

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.minUnits > self.maxUnits:
            raise ValueError(f"autoscaling.minUnits ({self.minUnits}) must be <= maxUnits ({self.maxUnits})")
        if len(set(self.preference)) != len(self.preference):
            raise ValueError(f"autoscaling.preference must not repeat a template, got {self.preference}")
        return self


class DilocoJobSpec(_Api):
    """A Decoupled DiLoCo training job: one syncer and learner units built from templates."""

    image: str = Field(..., min_length=1)
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    config: TrainConfig = Field(default_factory=TrainConfig)
    replicas: int | None = Field(None, ge=0, le=10000)  # total learner units; the scale subresource sets it
    units: list[UnitTemplate] = Field(..., min_length=1, max_length=16)
    syncer: SyncerSpec = Field(default_factory=SyncerSpec)
    restartPolicy: RestartPolicy = Field(default_factory=RestartPolicy)
    failurePolicy: FailurePolicy = Field(default_factory=FailurePolicy)
    chaos: JobChaos | None = None  # a chaos schedule the operator runs on this job's own units (docs/chaos.md)
    autoscaling: Autoscaling | None = None  # capacity-aware: units follow the room on the templates' pools
    clusters: list[RemoteCluster] = Field(default_factory=list, max_length=16)  # units[].cluster names one
    data: DataVolume | None = Field(None, description="A read-only volume with the data, tokenizer or model "
                                                      "checkpoint the config's paths point into.")

    @model_validator(mode="after")
    def _consistent(self) -> "DilocoJobSpec":
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"units[].name must be unique, got {names}")
        tokenizer = self.config.data.tokenizer if self.config.data.tokenizer != "bytes" else None
        for field, value in (("config.data.path", self.config.data.path), ("config.model.path", self.config.model.path),
                             ("config.data.tokenizer", tokenizer)):
            if value is not None and not value.startswith("/"):
                raise ValueError(f"{field} must be an absolute path in the pods (e.g. under spec.data.mountPath), "
                                 f"got {value!r}")
        clusters = [c.name for c in self.clusters]
        if len(set(clusters)) != len(clusters):
            raise ValueError(f"clusters[].name must be unique, got {clusters}")
        if self.syncer.tls.effective_mode != "Disabled":
            for c in self.clusters:
                if plain := plain_http_urls(c.syncerUrl):
                    raise ValueError(f"{HTTPS_SYNCER_URL}; clusters[{c.name}].syncerUrl has {plain[0]!r}")
        for u in self.units:
            if u.cluster is not None and u.cluster not in clusters:
                raise ValueError(f"units[{u.name}].cluster names no spec.clusters entry: {u.cluster!r} "
                                 f"(clusters: {clusters})")
            if u.cluster is not None:
                urls = len(next(c for c in self.clusters if c.name == u.cluster).syncerUrl.split(","))
                if urls != self.config.syncer.shards:
                    raise ValueError(f"clusters[{u.cluster}].syncerUrl must give one URL per syncer shard "
                                     f"({self.config.syncer.shards})")
        lo = sum(u.minCount for u in self.units)
        if self.autoscaling is not None:
            unknown = [p for p in self.autoscaling.preference if p not in names]
            if unknown:
                raise ValueError(f"autoscaling.preference names unknown templates {unknown} (templates: {names})")
            if self.autoscaling.minUnits < lo:
                raise ValueError(f"autoscaling.minUnits ({self.autoscaling.minUnits}) must be >= the sum of "
                                 f"units[].minCount ({lo})")
        elif self.replicas is not None:
            if self.replicas < lo:
                raise ValueError(f"replicas ({self.replicas}) must be >= the sum of units[].minCount ({lo})")
            if all(u.maxCount is not None for u in self.units):
                hi = sum(u.maxCount or 0 for u in self.units)
                if self.replicas > hi:
                    raise ValueError(f"replicas ({self.replicas}) must be <= the sum of units[].maxCount ({hi})")
        if self.autoscaling is not None and self.config.outer.quorum > self.autoscaling.minUnits:
            raise ValueError(f"config.outer.quorum ({self.config.outer.quorum}) must not exceed "
                             f"autoscaling.minUnits ({self.autoscaling.minUnits})")
        if self.autoscaling is None and self.config.outer.quorum > self.total_units():
            raise ValueError(f"config.outer.quorum ({self.config.outer.quorum}) must not exceed the number of "
                             f"learner units ({self.total_units()})")
        return self

    def data_shards(self) -> int:
        """How many shards the corpus is split into: the most units the templates allow (maxCount, else count),
        so scaling within those bounds never moves a running unit's shard."""
        return max(1, sum(u.maxCount if u.maxCount is not None else u.count for u in self.units))

    def total_units(self) -> int:
        """The number of learner units wanted: with autoscaling spec.replicas (else maxUnits) within
        [minUnits, maxUnits]; without, spec.replicas when set, else the sum of the templates' counts."""
        if self.autoscaling is not None:
            want = self.replicas if self.replicas is not None else self.autoscaling.maxUnits
            return max(self.autoscaling.minUnits, min(self.autoscaling.maxUnits, want))
        return self.replicas if self.replicas is not None else sum(u.count for u in self.units)


class LearnerUnitSpec(_Api):
    """One learner unit, created by the operator from a template of its job."""

    jobName: str = Field(..., min_length=1)
    template: str = Field(..., min_length=1)
    index: int = Field(..., ge=0, le=100_000)  # within the template: the unit is <job>-<template>-<index>
    unitIndex: int = Field(..., ge=0, le=100_000)  # within the job: the learner's --unit (its data shard)
    shards: int | None = Field(None, ge=1, le=100_001)  # the learner's --units: how many shards the corpus has
    image: str = Field(..., min_length=1)
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    podsPerUnit: int = Field(1, ge=1, le=64)
    accelerator: Accelerator = Field(default_factory=Accelerator)
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    stateVolume: Checkpoint | None = None
    restartPolicy: RestartPolicy = Field(default_factory=RestartPolicy)
    # the job's: not part of the pods' spec hash (a changed value reaches new pods, restarts none)
    failurePolicy: FailurePolicy = Field(default_factory=FailurePolicy)
    # https to the syncer, verified against the job's CA (ConfigMap <job>-syncer-ca); false: plain http
    syncerTls: bool = True
    # the job's config.syncer.shards (None: one syncer): the learner dials every shard's Service
    syncerShards: int | None = Field(None, ge=2, le=1024)
    cluster: str | None = None  # the spec.clusters entry this unit runs in (None: the operator's own cluster)
    # in a remote cluster: that cluster's syncerUrl (the learner's --syncer)
    syncerUrl: str | None = Field(None, max_length=4096)
    data: DataVolume | None = None  # the job's spec.data, mounted read-only

    @model_validator(mode="after")
    def _https_with_tls(self) -> "LearnerUnitSpec":
        if self.syncerTls and self.syncerUrl and (plain := plain_http_urls(self.syncerUrl)):
            raise ValueError(f"syncerUrl must be https:// while syncerTls is true, got {plain[0]!r}")
        return self


JobPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
UnitPhase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed"]


class Condition(_Api):
    """A Kubernetes-style condition; lastTransitionTime moves only when status flips."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(..., pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    lastTransitionTime: str
    observedGeneration: int | None = None


class TemplateScaling(_Api):
    """The autoscaler's view of one template: units it wants and runs, and why it is parked."""

    name: str
    desired: int = 0
    running: int = 0
    queued: int | None = None  # units whose Kueue Workload waits for quota (never parked)
    parkCount: int = 0  # consecutive parks (reset once a unit of the template runs)
    freeUnits: int | None = None  # units that fit on ready, matching nodes now (accelerator templates)
    retryAt: str | None = None  # parked: no new units before this (unless capacity appears)
    reason: str | None = None


class ParkedUnit(_Api):
    """A unit the autoscaler removed because its pods could not be placed."""

    name: str
    template: str
    reason: str = ""
    time: str


class AutoscalingStatus(_Api):
    """What the autoscaler wants and why (spec.autoscaling)."""

    targetUnits: int = 0  # spec.replicas (or maxUnits) within [minUnits, maxUnits]
    desiredUnits: int = 0  # what it asks for now, given parked templates
    runningUnits: int = 0
    queuedUnits: int | None = None  # units kept as pending Kueue Workloads (waiting for quota, never parked)
    templates: list[TemplateScaling] = Field(default_factory=list)
    parkedUnits: list[ParkedUnit] = Field(default_factory=list)  # newest first, at most 20
    lastScaleUpTime: str | None = None
    lastScaleDownTime: str | None = None


class SyncerShardStatus(_Api):
    """One syncer shard as the operator saw it: its Deployment's pod and what the shard reports."""

    shard: int
    name: str  # the Deployment and Service of this shard
    ready: bool = False
    outerSteps: int | None = None  # merges of this shard's fragments
    fragments: list[int] = Field(default_factory=list)  # the fragments it owns (p mod N = shard)


class SyncerRefusal(_Api):
    """The syncer refused the job's spec (exit 2): why, for which generation, and when. While it holds the syncer
    is scaled to zero (no crash loop) and Ready is False with reason InvalidSpec; an edit of the spec, or
    ten minutes, tries again."""

    generation: int | None = None
    message: str
    at: str


class UnitFault(_Api):
    """The unit's last whole-unit restart: why, when, (recoveredAt) when all its pods were ready again, and the work
    its learner's ended life trained that no merge covers (faultwork.py), once the syncer can tell."""

    time: str
    reason: str
    message: str = ""
    incarnation: int  # the incarnation the restart started
    recoveredAt: str | None = None
    recoverySeconds: float | None = None  # from the fault to recoveredAt
    # from the fault to the syncer first hearing of the next learner life, which reports only once it has trained a
    # step (an upper bound on the time to training again, by at most a heartbeat; faultwork.py)
    trainingAgainSeconds: float | None = None
    lostSteps: int | None = None  # inner steps the ended learner process trained that no merge covers
    lostTokens: int | None = None  # their tokens


class JobFault(UnitFault):
    """The job's latest unit fault: which unit, and its recovery time in seconds once it runs again."""

    unit: str


class _Status(_Api):
    """A status the operator builds as this model, in one place, and writes in its wire form (subclasses declare
    `conditions`)."""

    @classmethod
    def read(cls, status: Self | dict | None) -> Self:
        """The typed status as the API server returned it (its schema prunes fields it does not know), or as the
        operator decided it (returned as is)."""
        if isinstance(status, cls):
            return status
        return cls.model_validate({k: v for k, v in (status or {}).items() if k in cls.model_fields})

    def wire(self) -> dict:
        """The status as the API server stores it: camelCase, a field the operator does not know is absent."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def condition_dicts(self) -> list[dict]:
        """The conditions as conditions.py edits them."""
        return [c.model_dump(mode="json", exclude_none=True) for c in self.conditions]

    def set_conditions(self, conds: list[dict]) -> None:
        """Take back the conditions conditions.py edited."""
        self.conditions = [Condition.model_validate(c) for c in conds]


class DilocoJobStatus(_Status):
    """What the operator observed for a job: one typed model (jobstatus.observe), written once per reconcile."""

    phase: JobPhase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observedGeneration: int | None = None
    replicas: int | None = None  # learner units that exist (the scale subresource's status)
    selector: str | None = None  # label selector of the job's units (for the scale subresource)
    unitsReady: int | None = None
    unitsDesired: int | None = None
    restarts: int | None = None  # whole-unit restarts, summed over units
    syncerReady: bool | None = None  # every shard's syncer pod is ready
    syncerShards: list[SyncerShardStatus] | None = None  # one per shard, in shard order (absent once finished)
    outerSteps: int | None = None  # merges done by the syncer (from its /v1/versions)
    version: int | None = None  # sum of fragment versions published by the syncer
    lastCheckpoint: str | None = None
    # Progress, from the syncer's /v1/status (jobstatus.progress): absent until a syncer answered, then the last known.
    goodput: Annotated[float, Field(ge=0, le=1)] | None = None  # useful / allocated learner time (goodput.py)
    mergedFraction: Annotated[float, Field(ge=0, le=1)] | None = None  # share of trained steps merged into the model
    tokensTrained: int | None = None  # by the job's learners, as each last told the syncer
    tokensMergedPerFragment: int | None = None  # merged tokens / fragments: compares with tokensTrained
    learnersAlive: int | None = None  # learners the syncer hears from
    sparesWaiting: int | None = None  # warm spare pods running and free (units[].spares; absent without)
    lastFault: JobFault | None = None  # the latest whole-unit restart and how long its unit took to run again
    startTime: str | None = None
    completionTime: str | None = None
    message: str | None = None
    autoscaling: AutoscalingStatus | None = None
    syncerRefusal: SyncerRefusal | None = None


class LearnerUnitStatus(_Status):
    """What the operator observed for one unit: one typed model (unitplan.plan_unit, kueue.plan_held), written once
    per reconcile."""

    phase: UnitPhase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observedGeneration: int | None = None
    podsReady: int | None = None
    podsDesired: int | None = None
    restarts: int | None = None
    consecutiveFailures: int | None = None
    incarnation: int | None = None  # bumped on every whole-unit restart; pods carry it in a label
    launchedIncarnation: int | None = None  # the incarnation whose pods were all created
    restartAfter: str | None = None  # backoff: no new pods before this time
    nodePool: str | None = None
    nodes: list[str] = Field(default_factory=list)
    lastContribution: str | None = None
    lastFault: UnitFault | None = None
    message: str | None = None
