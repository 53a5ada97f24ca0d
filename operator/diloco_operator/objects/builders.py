"""Builders of the Kubernetes objects a DilocoJob owns (pure: spec in, manifest dicts out).

Command lines follow docs/protocol.md "Commands the images run".
"""

from __future__ import annotations

import hashlib
import json

import yaml

from diloco_kube.labels import (LABEL_COMPONENT, LABEL_INCARNATION, LABEL_JOB, LABEL_RANK,  # noqa: F401
                                 LABEL_SHARD, LABEL_TEMPLATE, LABEL_UNIT, POOL_LABEL)
from diloco_operator.api import models as api
from diloco_operator.objects.podsecurity import harden
from diloco_trainer.syncer.epochs import EPOCHS_KEY

ANNOTATION_SPEC_HASH = "diloco.dev/spec-hash"
MANAGED_BY = {"app.kubernetes.io/name": "diloco", "app.kubernetes.io/managed-by": "diloco-operator"}
TOKEN_KEY = "token"
CONFIG_KEY = "config.yaml"
CA_KEY = "ca.crt"
SYNCER_TLS_DIR = "/etc/diloco/tls"
LEARNER_CA_DIR = "/etc/diloco/ca"
ANNOTATION_TLS_HASH = "diloco.dev/tls-cert-hash"  # a renewed certificate rolls the syncer onto it
ANNOTATION_CONFIG_HASH = "diloco.dev/config-hash"  # on syncer pods: the spec.config they were started with
SYNCER_EPOCHS_DIR = "/etc/diloco-epochs"  # the learner token epochs the syncer checks (syncer/epochs.py)
ANNOTATION_TOKEN_EPOCH = "diloco.dev/token-epoch"  # on a LearnerUnit: the epoch of its learner token
TOKEN_VOLUME = "token"  # the pod volume of the token Secret (token_volume)
TOKEN_DIR = "/etc/diloco-token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"  # what --token-file reads in syncer and learner pods
SYNCER_STATE_DIR = "/var/lib/diloco"
LEARNER_STATE_DIR = "/var/lib/diloco-learner"
DATA_VOLUME = "data"  # the pod volume of spec.data
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def secret_name(job: str) -> str:
    return f"{job}-token"


def unit_token_secret_name(unit: str) -> str:
    """The Secret of one unit's own learner token (tokens.py), which its pods read instead of the job's."""
    return f"{unit}-learner-token"


def config_name(job: str) -> str:
    return f"{job}-config"


def syncer_name(job: str, shard: int = 0, shards: int = 1) -> str:
    """The Deployment and Service of one syncer shard: <job>-syncer for a single syncer, <job>-syncer-<i> for shards."""
    return f"{job}-syncer" if shards == 1 else f"{job}-syncer-{shard}"


def pvc_name(job: str, shard: int = 0, shards: int = 1) -> str:
    """One shard's checkpoint volume: it holds only that shard's fragments."""
    return f"{job}-checkpoint" if shards == 1 else f"{job}-checkpoint-{shard}"


def syncer_labels(job: str, shard: int = 0, shards: int = 1) -> dict[str, str]:
    """Labels (and selector) of a syncer shard's objects; a single syncer keeps the labels it has always had."""
    labels = {LABEL_JOB: job, LABEL_COMPONENT: "syncer"}
    return labels if shards == 1 else {**labels, LABEL_SHARD: str(shard)}


def unit_name(job: str, template: str, index: int) -> str:
    return f"{job}-{template}-{index}"


def pod_name(unit: str, incarnation: int, rank: int) -> str:
    return f"{unit}-{incarnation}-{rank}"


def tls_secret_name(job: str, tls: api.SyncerTls) -> str | None:
    """The Secret whose tls.crt/tls.key the syncer serves: the user's (Secret), the operator's (Auto), or None."""
    mode = tls.effective_mode
    return tls.secretName if mode == "Secret" else f"{syncer_name(job)}-tls" if mode == "Auto" else None


def epochs_config_name(job: str) -> str:
    return f"{job}-learner-epochs"


def learner_epochs_config_map(job: dict, learners: dict[str, dict]) -> dict:
    """Each learner id's current token epoch and whether its unit exists (`{id: {"epoch": N, "live": bool}}`): the
    syncer refuses the token of a removed or replaced unit (syncer/epochs.py). Mounted into the syncer pods."""
    name = job["metadata"]["name"]
    text = json.dumps({"learners": {k: learners[k] for k in sorted(learners)}}, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(epochs_config_name(name), job, {LABEL_JOB: name}),
            "data": {EPOCHS_KEY: text}}


def token_epoch(unit: dict) -> int:
    """The epoch of a LearnerUnit's token (0: a unit from before epochs)."""
    raw = ((unit.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TOKEN_EPOCH, "0")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else 0


def ca_config_name(job: str) -> str:
    """The ConfigMap holding only ca.crt: what learners mount to verify the syncer (never the syncer's key)."""
    return f"{syncer_name(job)}-ca"


def syncer_url(job: str, tls: bool = True, shard: int = 0, shards: int = 1) -> str:
    """The in-cluster address learners use for one shard (same namespace, through the shard's Service)."""
    return f"{'https' if tls else 'http'}://{syncer_name(job, shard, shards)}:{api.SYNCER_PORT}"


def syncer_urls(job: str, tls: bool = True, shards: int = 1) -> str:
    """The learner's --syncer: every shard's address, in shard order, comma-separated."""
    return ",".join(syncer_url(job, tls, i, shards) for i in range(shards))


def spec_hash(obj: dict) -> str:
    """A short stable hash of a JSON-able value (detects spec drift without deep compares)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def pod_spec_hash(unit_spec: dict) -> str:
    """The hash a unit's pods carry (ANNOTATION_SPEC_HASH): of its spec without failurePolicy, so a new
    nodeLostSeconds reaches the pods created next and restarts none (and pods from before the field keep theirs)."""
    return spec_hash({k: v for k, v in unit_spec.items() if k != "failurePolicy"})


def config_hash(spec: api.DilocoJobSpec) -> str:
    """The hash of the job's training config that its syncer pods carry (ANNOTATION_CONFIG_HASH)."""
    return spec_hash(spec.config.model_dump(mode="json"))


def owner_ref(owner: dict) -> dict:
    """An ownerReference that lets the garbage collector cascade deletion from `owner`."""
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def scrape_annotations(port: int) -> dict[str, str]:
    """The prometheus.io/* annotations a Prometheus without prometheus-operator discovers pods by (the chart's
    PodMonitors select the same pods by label)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _meta(name: str, owner: dict, labels: dict, annotations: dict | None = None) -> dict:
    meta = {"name": name, "namespace": owner["metadata"]["namespace"], "labels": {**MANAGED_BY, **labels},
            "ownerReferences": [owner_ref(owner)]}
    if annotations:
        meta["annotations"] = annotations
    return meta


ANNOTATION_HOME_OWNER = "diloco.dev/home-owner"  # on objects in a remote cluster: what owns them at home


def controller_uid(obj: dict) -> str | None:
    """The UID of the object's controller: its controller ownerReference, or in a remote cluster the owner named by
    the home-owner annotation ("Kind/name/uid"); None if nothing controls it."""
    meta = obj.get("metadata") or {}
    ref = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if ref is not None:
        return ref.get("uid")
    home = ((meta.get("annotations") or {}).get(ANNOTATION_HOME_OWNER) or "").split(",")[0]
    return home.rsplit("/", 1)[-1] if home.count("/") == 2 else None


def controlled_by(obj: dict, uid: str | None, remote: bool = False) -> bool:
    """Whether the object of `uid` controls `obj`, as the operator may act on it (delete it, count it, hand it a
    token): at home only through its controller ownerReference, which the garbage collector honours and which a
    pod author cannot point at an object they do not own without the apiserver checking it exists; labels and
    annotations anyone who can create pods may write do not count. In a remote cluster (`remote`), objects carry no
    ownerReference to home objects, so there the home-owner annotation the operator wrote names the owner."""
    if not uid:
        return False
    meta = obj.get("metadata") or {}
    ref = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if not remote:
        return ref is not None and ref.get("uid") == uid
    return ref is None and controller_uid(obj) == uid


def same_controller(desired: dict, current: dict) -> bool:
    """Whether `current` (an existing object of `desired`'s name) is controlled by whatever controls `desired`:
    only then may the operator use, patch or later delete it."""
    return controller_uid(current) == controller_uid(desired)


def in_remote_cluster(obj: dict, namespace: str) -> dict:
    """`obj` as created in a remote cluster (spec.clusters): in `namespace`, without ownerReferences (their owner
    lives in the home cluster: that cluster's garbage collector would delete the object at once); the owner is
    named in an annotation, and the job label lets the operator find and remove it (remote.py)."""
    meta = dict(obj["metadata"])
    owners = meta.pop("ownerReferences", [])
    if owners:
        meta["annotations"] = {**meta.get("annotations", {}), ANNOTATION_HOME_OWNER: ",".join(
            f"{o['kind']}/{o['name']}/{o['uid']}" for o in owners)}
    meta["namespace"] = namespace
    return {**obj, "metadata": meta}


def _resources(res: api.Resources, extra: dict[str, int] | None = None) -> dict:
    out: dict = {}
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    for key, value in (extra or {}).items():  # extended resources need requests == limits
        requests[key] = limits[key] = str(value)
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _tolerations(tols: list[api.Toleration]) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tols]


def node_loss_tolerations(tols: list[api.Toleration], seconds: int) -> list[dict]:
    """Tolerations of the not-ready/unreachable NoExecute taints for `seconds` (Kubernetes adds 300 s otherwise),
    except for a key the user's own tolerations already name (theirs decides: the shortest would win)."""
    named = {t.key for t in tols}
    return [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            for key in NODE_LOSS_TAINTS if key not in named]


def off_accelerators() -> dict:
    """A required node affinity that keeps a pod off accelerator nodes, tainted or not. DoesNotExist rather
    than a positive selector: every node without accelerator labels qualifies, whatever its pool."""
    terms = [{"matchExpressions": [{"key": key, "operator": "DoesNotExist"} for key in api.ACCELERATOR_NODE_LABELS]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def one_slice(unit_name: str, incarnation: int) -> dict:
    """The pod affinity of a multi-host TPU unit: all its pods (of this incarnation) in one node pool, which on GKE
    is one TPU slice, the only place their chips are linked (ICI); and no other unit's learner pod in that pool,
    so a slice is never shared by two units. The scheduler places the pods one at a time and sees the ones it has
    placed, so the first lands anywhere it fits and the others follow it (a pool without room for all of them
    leaves them Pending: the unit's PodsScheduled condition says so)."""
    this_unit = {"matchLabels": {LABEL_UNIT: unit_name, LABEL_INCARNATION: str(incarnation)}}
    other_units = {"matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": ["learner"]},
                                        {"key": LABEL_UNIT, "operator": "Exists"},
                                        {"key": LABEL_UNIT, "operator": "NotIn", "values": [unit_name]}]}
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": this_unit, "topologyKey": POOL_LABEL}]},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": other_units, "topologyKey": POOL_LABEL}]}}


def token_secret(job: dict, token: str) -> dict:
    """The bearer token learners and the syncer share; created once, never rewritten."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(secret_name(name), job, {LABEL_JOB: name}), "stringData": {TOKEN_KEY: token}}


def unit_token_secret(unit: dict, token: str) -> dict:
    """A unit's learner token, owned by the unit: a leaked one acts only as that unit (the syncer checks)."""
    name = unit["metadata"]["name"]
    labels = {LABEL_JOB: unit["spec"]["jobName"], LABEL_UNIT: name}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(unit_token_secret_name(name), unit, labels), "stringData": {TOKEN_KEY: token}}


def auto_tls_secret(job: dict, data: dict[str, str]) -> dict:
    """The operator's own CA and syncer certificate (spec.syncer.tls.mode Auto), as kubernetes.io/tls."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": _meta(f"{syncer_name(name)}-tls", job, {LABEL_JOB: name, LABEL_COMPONENT: "syncer"}),
            "stringData": dict(data)}


def ca_config_map(job: dict, ca_pem: str) -> dict:
    """The CA learners verify the syncer against (a public certificate, so a ConfigMap)."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(ca_config_name(name), job, {LABEL_JOB: name}),
            "data": {CA_KEY: ca_pem}}


def config_map(job: dict, spec: api.DilocoJobSpec) -> dict:
    """The run config file the syncer reads (learners get it from the syncer at registration)."""
    name = job["metadata"]["name"]
    text = yaml.safe_dump(spec.config.model_dump(mode="json"), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(config_name(name), job, {LABEL_JOB: name}),
            "data": {CONFIG_KEY: text}}


def checkpoint_pvc(job: dict, spec: api.DilocoJobSpec, shard: int = 0) -> dict:
    name, shards = job["metadata"]["name"], spec.config.syncer.shards
    pvc_spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": spec.syncer.checkpoint.size}}}
    if spec.syncer.checkpoint.storageClassName:
        pvc_spec["storageClassName"] = spec.syncer.checkpoint.storageClassName
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(pvc_name(name, shard, shards), job, syncer_labels(name, shard, shards)), "spec": pvc_spec}


def token_volume(secret: str) -> tuple[dict, dict]:
    """The mount and volume of a token Secret: only its `token` key, as a file at TOKEN_FILE read with --token-file,
    never in the environment (where /proc/PID/environ and tools that dump it show it). Mode 0440 under the pod's
    fsGroup: root owns it, only the image's group (the container's processes) reads it, nobody writes it (the kubelet
    would widen 0400 to 0440 under fsGroup anyway, and without fsGroup the image's user could not read 0400)."""
    return ({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": TOKEN_VOLUME, "secret": {"secretName": secret, "defaultMode": 0o440,
                                              "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}})


def syncer_deployment(job: dict, spec: api.DilocoJobSpec, replicas: int = 1, tls_hash: str | None = None,
                      shard: int = 0) -> dict:
    """The pod of syncer shard `shard` (Recreate: the checkpoint volume is ReadWriteOnce); a replaced pod resumes
    from the shard's PVC. With spec.syncer.standby a second container waits, warm, on the same volume and takes over
    the moment the serving process dies (syncer/takeover.py: whichever holds STATE_DIR/serve.lock serves; a
    restarted container becomes the next standby). With TLS it serves the certificate of tls_secret_name; `tls_hash`
    (of that certificate) rolls it on renewal."""
    name, shards = job["metadata"]["name"], spec.config.syncer.shards
    tls_secret = tls_secret_name(name, spec.syncer.tls)
    labels = syncer_labels(name, shard, shards)
    command = ["diloco", "syncer", "--config", f"/etc/diloco/{CONFIG_KEY}", "--host", "0.0.0.0",
               "--port", str(api.SYNCER_PORT), "--state-dir", SYNCER_STATE_DIR, "--token-file", TOKEN_FILE,
               "--max-body-mb", str(spec.syncer.maxBodyMb),
               # An inner step covers at most batch x seq_len x this many tokens: the syncer refuses more.
               "--max-unit-processes", str(max(u.podsPerUnit for u in spec.units))]
    if shards > 1:
        command += ["--shard", str(shard)]
    token_mount, token_vol = token_volume(secret_name(name))
    mounts = [{"name": "config", "mountPath": "/etc/diloco", "readOnly": True},
              {"name": "state", "mountPath": SYNCER_STATE_DIR}, token_mount]
    volumes = [{"name": "config", "configMap": {"name": config_name(name)}},
               {"name": "state", "persistentVolumeClaim": {"claimName": pvc_name(name, shard, shards)}}, token_vol]
    if spec.data is not None:  # the syncer builds the initial model, maybe from a checkpoint on this volume
        mounts.append(spec.data.mount(DATA_VOLUME))
        volumes.append(spec.data.volume(DATA_VOLUME))
    # The kubelet refreshes the mounted file when the operator changes the ConfigMap; optional: a missing one
    # (an operator from before epochs) retires nothing.
    command += ["--learner-epochs", f"{SYNCER_EPOCHS_DIR}/{EPOCHS_KEY}"]
    mounts.append({"name": "learner-epochs", "mountPath": SYNCER_EPOCHS_DIR, "readOnly": True})
    volumes.append({"name": "learner-epochs", "configMap": {"name": epochs_config_name(name), "optional": True}})
    if tls_secret:
        command += ["--tls-cert", f"{SYNCER_TLS_DIR}/tls.crt", "--tls-key", f"{SYNCER_TLS_DIR}/tls.key"]
        mounts.append({"name": "tls", "mountPath": SYNCER_TLS_DIR, "readOnly": True})
        # Only the serving pair: ca.key (Auto) stays in the Secret, never in the syncer's filesystem.
        volumes.append({"name": "tls", "secret": {"secretName": tls_secret, "defaultMode": 0o440, "items": [
            {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}})
    containers = [{
        "name": "syncer", "image": spec.image, "imagePullPolicy": spec.imagePullPolicy, "command": command,
        "ports": [{"name": "api", "containerPort": api.SYNCER_PORT}],
        # The pod's port answers whichever container serves: ready while either one does.
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": api.SYNCER_PORT,
                                       "scheme": "HTTPS" if tls_secret else "HTTP"}, "periodSeconds": 5},
        "resources": _resources(spec.syncer.resources),
        "volumeMounts": mounts,
    }]
    if spec.syncer.standby:  # no fork of a successor: the kubelet restarts the container that died instead
        containers.append({**{k: v for k, v in containers[0].items() if k not in ("ports", "readinessProbe")},
                           "name": "standby", "command": [*command, "--standby", "--no-fork-successor"]})
    # Restricted pods (podsecurity.py); fsGroup: the image's user writes the checkpoint PVC and reads the token.
    pod_spec = harden({"automountServiceAccountToken": False, "containers": containers, "volumes": volumes},
                      fs_group=True)
    if spec.syncer.nodeSelector:
        pod_spec["nodeSelector"] = dict(spec.syncer.nodeSelector)
    else:  # an explicit nodeSelector is the user's placement; by default the syncer stays off accelerators
        pod_spec["affinity"] = off_accelerators()
    pod_spec["tolerations"] = _tolerations(spec.syncer.tolerations) + node_loss_tolerations(
        spec.syncer.tolerations, spec.failurePolicy.nodeLostSeconds)
    annotations = {**scrape_annotations(api.SYNCER_PORT), ANNOTATION_CONFIG_HASH: config_hash(spec)}
    if tls_secret:
        annotations["prometheus.io/scheme"] = "https"
        if tls_hash:
            annotations[ANNOTATION_TLS_HASH] = tls_hash
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(syncer_name(name, shard, shards), job, labels),
        "spec": {
            "replicas": replicas, "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": {**MANAGED_BY, **labels}, "annotations": annotations},
                         "spec": pod_spec},
        },
    }


def syncer_service(job: dict, shard: int = 0, shards: int = 1) -> dict:
    """One shard's address. It routes to the shard's pod also while the pod is not ready: the pod has one syncer,
    a standby taking over serves on the same port before the kubelet has restarted the dead container, and a
    learner that finds nobody listening retries."""
    name = job["metadata"]["name"]
    labels = syncer_labels(name, shard, shards)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(syncer_name(name, shard, shards), job, labels),
            "spec": {"selector": labels, "publishNotReadyAddresses": True,
                     "ports": [{"name": "api", "port": api.SYNCER_PORT, "targetPort": api.SYNCER_PORT}]}}


def unit_spec(job_name: str, spec: api.DilocoJobSpec, template: api.UnitTemplate, index: int,
              unit_index: int) -> api.LearnerUnitSpec:
    """The LearnerUnit spec for unit `index` of `template` (everything its pods need, copied from the job)."""
    return api.LearnerUnitSpec(
        jobName=job_name, template=template.name, index=index, unitIndex=unit_index,
        shards=max(spec.data_shards(), unit_index + 1), image=template.image or spec.image,
        imagePullPolicy=spec.imagePullPolicy, podsPerUnit=template.podsPerUnit, accelerator=template.accelerator,
        nodeSelector=template.nodeSelector, tolerations=template.tolerations, resources=template.resources,
        steps=template.steps, stateVolume=template.stateVolume, restartPolicy=spec.restartPolicy,
        failurePolicy=spec.failurePolicy,
        syncerTls=spec.syncer.tls.effective_mode != "Disabled",
        syncerShards=spec.config.syncer.shards if spec.config.syncer.shards > 1 else None,
        cluster=template.cluster,
        syncerUrl=next((c.syncerUrl for c in spec.clusters if c.name == template.cluster), None),
        data=spec.data,
    )


def learner_unit(job: dict, spec: api.LearnerUnitSpec, epoch: int = 0) -> dict:
    """A LearnerUnit; `epoch` (>= 1) is its token's (jobplan.token_epochs), fixed for the unit's life."""
    job_name = job["metadata"]["name"]
    name = unit_name(job_name, spec.template, spec.index)
    labels = {LABEL_JOB: job_name, LABEL_TEMPLATE: spec.template}
    annotations = {ANNOTATION_TOKEN_EPOCH: str(epoch)} if epoch else None
    return {"apiVersion": api.API_VERSION, "kind": "LearnerUnit", "metadata": _meta(name, job, labels, annotations),
            "spec": spec.model_dump(mode="json", exclude_none=True)}


def needs_unit_service(spec: api.LearnerUnitSpec) -> bool:
    """Only a unit of several pods rendezvous across pods (torch.distributed, TPU workers) by DNS name."""
    return spec.podsPerUnit > 1


def unit_service(unit: dict) -> dict:
    """Headless Service giving each pod of a unit a DNS name (rank-R.<unit>) for torch.distributed rendezvous
    (only for units of several pods: needs_unit_service)."""
    spec = api.LearnerUnitSpec.model_validate(unit["spec"])
    name = unit["metadata"]["name"]
    selector = {LABEL_JOB: spec.jobName, LABEL_UNIT: name}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, unit, selector),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector,
                     "ports": [{"name": "dist", "port": api.MASTER_PORT}]}}


def state_pvc_name(unit: str, rank: int) -> str:
    return f"{unit}-state-{rank}"


def unit_state_pvc(unit: dict, rank: int) -> dict | None:
    """The PVC holding rank `rank`'s --state-dir (its data position), owned by the unit so it outlives pods;
    None when the unit keeps its state in an emptyDir."""
    spec = api.LearnerUnitSpec.model_validate(unit["spec"])
    if spec.stateVolume is None:
        return None
    name = unit["metadata"]["name"]
    pvc_spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": spec.stateVolume.size}}}
    if spec.stateVolume.storageClassName:
        pvc_spec["storageClassName"] = spec.stateVolume.storageClassName
    labels = {LABEL_JOB: spec.jobName, LABEL_UNIT: name, LABEL_RANK: str(rank)}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(state_pvc_name(name, rank), unit,
                                                                                    labels), "spec": pvc_spec}


def learner_tolerations(spec: api.LearnerUnitSpec) -> list[dict]:
    """A learner pod's tolerations: the template's, its accelerator pool's taint, and nodeLostSeconds on lost nodes."""
    resource, label, _ = api.ACCELERATORS[spec.accelerator.type]
    tolerations = _tolerations(spec.tolerations)
    if resource and label:
        # Accelerator pools are tainted with their resource name; pods that request it tolerate it.
        tolerations.append({"key": resource, "operator": "Exists", "effect": "NoSchedule"})
    # A lost node's taints evict its pods after nodeLostSeconds instead of the default 300 s (where the cluster's
    # controller-manager evicts; the operator's own node watch force-deletes them too: nodeloss.py).
    return tolerations + node_loss_tolerations(spec.tolerations, spec.failurePolicy.nodeLostSeconds)


def pod_learner_entrypoint(pods_per_unit: int) -> list[str]:
    """The learner container's command up to the learner's own arguments: `diloco pod-learner` (runtime/podsup.py), a
    supervisor that restarts a killed or crashed learner process in place from a warm spare, without the kubelet's
    CrashLoopBackOff. A rank of a unit of several pods cannot rejoin its group's collectives alone: there the
    supervisor only passes signals and exit codes on, and the operator restarts the whole unit, as before."""
    if pods_per_unit > 1:
        return ["diloco", "pod-learner", "--max-restarts", "0", "--spares", "0", "--"]
    return ["diloco", "pod-learner", "--"]


def learner_arguments(command: list[str]) -> list[str]:
    """The `diloco learner` arguments in a learner container's command (after pod-learner's `--`)."""
    return command[command.index("--") + 1:]


def unit_pod(unit: dict, incarnation: int, rank: int) -> dict:
    """Pod `rank` of incarnation `incarnation` of a unit, placed by nodeSelector/tolerations/resources."""
    spec = api.LearnerUnitSpec.model_validate(unit["spec"])
    name = unit["metadata"]["name"]
    resource, label, device = api.ACCELERATORS[spec.accelerator.type]
    node_selector = dict(spec.nodeSelector)
    tolerations = learner_tolerations(spec)
    extra: dict[str, int] = {}
    if resource and label:
        node_selector[label] = spec.accelerator.type
        extra[resource] = spec.accelerator.count
    if spec.accelerator.topology:
        node_selector[api.TPU_TOPOLOGY_LABEL] = spec.accelerator.topology
    url = spec.syncerUrl or syncer_urls(spec.jobName, spec.syncerTls, spec.syncerShards or 1)
    command = [*pod_learner_entrypoint(spec.podsPerUnit), "--syncer", url, "--learner-id", name,
               "--unit", str(spec.unitIndex), "--units", str(spec.shards or spec.unitIndex + 1), "--device", device, "--state-dir", LEARNER_STATE_DIR,
               "--metrics-port", str(api.METRICS_PORT), "--token-file", TOKEN_FILE,
               "--drain-s", str(spec.failurePolicy.drainSeconds)]
    if spec.steps:
        command += ["--steps", str(spec.steps)]
    token_mount, token_vol = token_volume(unit_token_secret_name(name))  # the unit's own token, never the job's
    mounts = [{"name": "state", "mountPath": LEARNER_STATE_DIR}, token_mount]
    volumes = [{"name": "state", "persistentVolumeClaim": {"claimName": state_pvc_name(name, rank)}}
               if spec.stateVolume else {"name": "state", "emptyDir": {}}, token_vol]
    if spec.data is not None:
        mounts.append(spec.data.mount(DATA_VOLUME))
        volumes.append(spec.data.volume(DATA_VOLUME))
    if spec.syncerTls:
        command += ["--ca", f"{LEARNER_CA_DIR}/{CA_KEY}"]
        mounts.append({"name": "syncer-ca", "mountPath": LEARNER_CA_DIR, "readOnly": True})
        volumes.append({"name": "syncer-ca", "configMap": {"name": ca_config_name(spec.jobName)}})
    # A single pod is its own rendezvous (it has no headless Service, so no rank-R.<unit> DNS name).
    hosts = [f"rank-{r}.{name}" for r in range(spec.podsPerUnit)] if needs_unit_service(spec) else ["localhost"]
    env = [
        {"name": "DILOCO_SYNCER_URL", "value": url},
        {"name": "DILOCO_UNIT", "value": str(spec.unitIndex)},
        {"name": "DILOCO_LEARNER_ID", "value": name},
        {"name": "RANK", "value": str(rank)},
        {"name": "WORLD_SIZE", "value": str(spec.podsPerUnit)},
        {"name": "MASTER_ADDR", "value": hosts[0]},
        {"name": "MASTER_PORT", "value": str(api.MASTER_PORT)},
    ]
    if device == "xla":
        env += [{"name": "TPU_WORKER_ID", "value": str(rank)},
                {"name": "TPU_WORKER_HOSTNAMES",
                 "value": ",".join(hosts)}]
    labels = {LABEL_JOB: spec.jobName, LABEL_COMPONENT: "learner", LABEL_UNIT: name, LABEL_TEMPLATE: spec.template,
              LABEL_INCARNATION: str(incarnation), LABEL_RANK: str(rank)}
    pod_spec: dict = {
        "restartPolicy": "Never",  # the operator restarts whole units, counting and backing off
        # SIGTERM (preemption, a drain): the learner hands over its unsent work within drainSeconds, then exits 0
        "terminationGracePeriodSeconds": spec.failurePolicy.termination_grace_seconds,
        "automountServiceAccountToken": False,
        "hostname": f"rank-{rank}", "subdomain": name,
        "containers": [{
            "name": "learner", "image": spec.image, "imagePullPolicy": spec.imagePullPolicy, "command": command,
            "env": env, "ports": [{"name": "metrics", "containerPort": api.METRICS_PORT}],
            "resources": _resources(spec.resources, extra),
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
    }
    harden(pod_spec, fs_group=True)  # restricted (podsecurity.py); fsGroup: the token file, and a state PVC
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if resource is None:  # a CPU unit never uses an accelerator: never let it take an accelerator node's room
        pod_spec["affinity"] = off_accelerators()
    elif device == "xla" and spec.podsPerUnit > 1:  # a multi-host TPU unit: one slice, its own
        pod_spec["affinity"] = one_slice(name, incarnation)
    pod_spec["tolerations"] = tolerations
    annotations = {ANNOTATION_SPEC_HASH: pod_spec_hash(unit["spec"]), **scrape_annotations(api.METRICS_PORT)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": _meta(pod_name(name, incarnation, rank), unit, labels,
                                                                  annotations), "spec": pod_spec}


# The operator's own pods (manifests/operator*.yaml): the one peer besides learners a syncer answers.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "diloco-operator"}


def syncer_network_policy(job: dict, spec: api.DilocoJobSpec, operator_namespace: str | None) -> dict:
    """Ingress to the job's syncer pods (every shard): the syncer port, from the job's learner pods and from the
    operator's pods in `operator_namespace` (None: an operator outside the cluster, no pod to name). With
    spec.clusters, pods elsewhere arrive through a LoadBalancer or Ingress that no pod selector names, so the port
    is then open to any source (tokens and TLS still guard it). Enforced only by a CNI that implements NetworkPolicy;
    policies add up, so a user's own (e.g. for Prometheus) widens this one without editing it."""
    name = job["metadata"]["name"]
    port = [{"protocol": "TCP", "port": api.SYNCER_PORT}]
    peers: list[dict] = [{"podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_COMPONENT: "learner"}}}]
    if operator_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                      "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}})
    ingress = [{"from": peers, "ports": port}] if not spec.clusters else [{"ports": port}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(f"{syncer_name(name)}-ingress", job, {LABEL_JOB: name, LABEL_COMPONENT: "syncer"}),
            "spec": {"podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_COMPONENT: "syncer"}},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def learner_network_policy(job: dict) -> dict:
    """Ingress to every learner pod of the job: only the metrics port (Prometheus), from anywhere. One object per job,
    not per unit: at thousands of single-pod units a policy each was one API request in five of a unit's creation.
    A unit of several pods adds its own (unit_network_policy); policies add up."""
    name = job["metadata"]["name"]
    selector = {LABEL_JOB: name, LABEL_COMPONENT: "learner"}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(f"{name}-learners-ingress", job, selector),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": api.METRICS_PORT}]}]}}


def unit_network_policy(unit: dict) -> dict:
    """Ingress to the pods of a unit of several pods: any port from the unit's own pods (torch.distributed's store,
    its collectives' ports, TPU workers), and only the metrics port from anywhere else (Prometheus). Owned by the
    unit. A single-pod unit needs none beside the job's (learner_network_policy): a pod's traffic to itself is not
    subject to NetworkPolicy."""
    spec = api.LearnerUnitSpec.model_validate(unit["spec"])
    name = unit["metadata"]["name"]
    selector = {LABEL_JOB: spec.jobName, LABEL_UNIT: name}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(f"{name}-ingress", unit, selector),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": selector}}]},
                                 {"ports": [{"protocol": "TCP", "port": api.METRICS_PORT}]}]}}
