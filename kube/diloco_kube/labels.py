"""Label and annotation keys that more than one package reads or writes on Kubernetes objects (pure constants)."""

# Set by the operator on every object a DilocoJob owns; read by chaos to find its victims.
LABEL_JOB = "diloco.dev/job"
LABEL_COMPONENT = "diloco.dev/component"
LABEL_UNIT = "diloco.dev/unit"
LABEL_TEMPLATE = "diloco.dev/template"
LABEL_INCARNATION = "diloco.dev/incarnation"
LABEL_RANK = "diloco.dev/rank"
# On a warm spare pod while it is no unit's yet (operator objects/spares.py); its takeover removes it.
LABEL_SPARE = "diloco.dev/spare"
SPARE_WAITING = "waiting"
LABEL_SHARD = "diloco.dev/shard"  # a syncer shard's objects, when the job has more than one (config.syncer.shards)

# The node pool a node belongs to, as GKE labels it (the fake pools of the dev cluster use the same key).
POOL_LABEL = "cloud.google.com/gke-nodepool"

# kwok: a Node with this annotation is a fake node kwok keeps alive.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
# A pod with this label is turned Failed by kwok's chaos stage about a second after it is Running.
FAIL_POD_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_POD_EXIT_CODE_ANNOTATION = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"
