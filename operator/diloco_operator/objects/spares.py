"""Warm spare pods (`spec.units[].spares`, pure: spec in, manifests and patches out).

A spare pod is a learner pod of its template that is nobody yet: `diloco pod-learner --assignment-file` has imported
torch and transformers and waits. When a unit's pod dies or is deleted, the operator relabels a spare as that unit's
pod (the next incarnation) and writes the unit's identity and sealed token into its `diloco.dev/assignment`
annotation (protocol/assignment.py) in one patch; the kubelet shows the annotation to the pod through a downward-API
file and the spare becomes the learner. Pod specs are immutable, so only what may differ between units of a template
travels in the assignment: the learner id, the data shard, the shard count and the token.
"""

from __future__ import annotations

import secrets

from diloco_trainer.protocol.assignment import ANNOTATION as ANNOTATION_ASSIGNMENT, POD_NAME_ENV

from diloco_kube.labels import LABEL_SPARE, SPARE_WAITING
from diloco_kube.pod_phase import effective_phase
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O

ANNOTATION_SPARE_HASH = "diloco.dev/spare-hash"  # which units a spare can become (spare_hash of their spec)
SPARE_KEY_KEY = "key"
SPARE_KEY_DIR = "/etc/diloco-spare-key"
ASSIGNMENT_DIR = "/etc/diloco-assignment"
ASSIGNMENT_FILE = "assignment"
# What differs between units of one template; the assignment carries the first three (and the token).
_PER_UNIT = ("index", "unitIndex", "shards", "failurePolicy")
_PER_UNIT_FLAGS = {"--learner-id": 1, "--unit": 1, "--units": 1, "--token-file": 1}
_PER_UNIT_ENV = ("DILOCO_UNIT", "DILOCO_LEARNER_ID")


def spare_key_secret_name(job: str) -> str:
    return f"{job}-spare-key"


def spare_key_secret(job: dict, key_text: str) -> dict:
    """The job's spare key (assignment.spare_key, base64), which the spare pods mount to open their assignment."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": O._meta(spare_key_secret_name(name), job, {O.LABEL_JOB: name}),
            "stringData": {SPARE_KEY_KEY: key_text}}


def spare_hash(unit_spec: dict | api.LearnerUnitSpec) -> str:
    """The same for every unit of a template whose pods a spare built from it can be: the unit spec, read through
    the model (so defaults filled in by the API server do not count), without what the assignment gives."""
    spec = unit_spec if isinstance(unit_spec, api.LearnerUnitSpec) else api.LearnerUnitSpec.model_validate(unit_spec)
    dump = spec.model_dump(mode="json", exclude_none=True)
    return O.spec_hash({k: v for k, v in dump.items() if k not in _PER_UNIT})


def spare_template_spec(job_name: str, spec: api.DilocoJobSpec, template: api.UnitTemplate) -> api.LearnerUnitSpec:
    """The unit spec a template's spares are built from (any unit's, up to what the assignment gives)."""
    return O.unit_spec(job_name, spec, template, 0, 0)


def _without_per_unit_flags(command: list[str]) -> list[str]:
    out, skip = [], 0
    for arg in command:
        if skip:
            skip -= 1
        elif arg in _PER_UNIT_FLAGS:
            skip = _PER_UNIT_FLAGS[arg]
        else:
            out.append(arg)
    return out


def spare_pod(job: dict, uspec: api.LearnerUnitSpec) -> dict:
    """A new spare pod of `uspec`'s template (a random name), owned by the job: a unit pod of that template without
    the unit's identity or token volume, with the spare key and the downward-API view of its assignment instead."""
    job_name = job["metadata"]["name"]
    name = f"{job_name}-{uspec.template}-spare-{secrets.token_hex(3)}"
    stand_in = {"apiVersion": job["apiVersion"], "kind": job["kind"],
                "metadata": {"name": name, "namespace": job["metadata"]["namespace"], "uid": job["metadata"]["uid"]},
                "spec": uspec.model_dump(mode="json", exclude_none=True)}
    pod = O.unit_pod(stand_in, 0, 0)
    labels = {O.LABEL_JOB: job_name, O.LABEL_COMPONENT: "learner", O.LABEL_TEMPLATE: uspec.template,
              LABEL_SPARE: SPARE_WAITING}
    annotations = {ANNOTATION_SPARE_HASH: spare_hash(uspec), **O.scrape_annotations(api.METRICS_PORT)}
    pod["metadata"] = O._meta(name, job, labels, annotations)
    pod_spec = pod["spec"]
    pod_spec.pop("subdomain", None)  # a single pod is its own rendezvous (localhost)
    container = pod_spec["containers"][0]
    command = _without_per_unit_flags(container["command"])
    sep = command.index("--")
    container["command"] = [*command[:sep], "--assignment-file", f"{ASSIGNMENT_DIR}/{ASSIGNMENT_FILE}",
                            "--spare-key-file", f"{SPARE_KEY_DIR}/{SPARE_KEY_KEY}", *command[sep:]]
    container["env"] = [e for e in container["env"] if e["name"] not in _PER_UNIT_ENV] + [
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != O.TOKEN_VOLUME] + [
        {"name": "spare-key", "mountPath": SPARE_KEY_DIR, "readOnly": True},
        {"name": "assignment", "mountPath": ASSIGNMENT_DIR, "readOnly": True}]
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != O.TOKEN_VOLUME] + [
        {"name": "spare-key", "secret": {"secretName": spare_key_secret_name(job_name), "defaultMode": 0o440,
                                         "items": [{"key": SPARE_KEY_KEY, "path": SPARE_KEY_KEY}]}},
        {"name": "assignment", "downwardAPI": {"items": [{
            "path": ASSIGNMENT_FILE,
            "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_ASSIGNMENT}']"}}]}}]
    return pod


def takeover_patch(spare: dict, unit: dict, incarnation: int, assignment_text: str) -> dict:
    """The merge patch that makes `spare` rank 0 of `unit`'s incarnation `incarnation`: its labels, the unit as its
    owner, the unit's spec hash and the sealed assignment, all at once. It carries the spare's resourceVersion, so
    of two units taking the same spare only the first succeeds (409 for the other)."""
    return {"metadata": {
        "resourceVersion": spare["metadata"]["resourceVersion"],
        "labels": {LABEL_SPARE: None, O.LABEL_UNIT: unit["metadata"]["name"], O.LABEL_INCARNATION: str(incarnation),
                   O.LABEL_RANK: "0"},
        "annotations": {ANNOTATION_ASSIGNMENT: assignment_text, O.ANNOTATION_SPEC_HASH: O.pod_spec_hash(unit["spec"])},
        "ownerReferences": [O.owner_ref(unit)]}}


def usable_spares(spares: list[dict], unit_spec: dict) -> list[dict]:
    """The spare pods that can become a unit of `unit_spec`: its template's, running (not one whose container ended
    and whose phase has not followed yet: pod_phase.effective_phase), not being deleted, not taken;
    those that have been running longest (warmest) first."""
    want = spare_hash(unit_spec)
    ok = [p for p in spares
          if (p["metadata"].get("labels") or {}).get(LABEL_SPARE) == SPARE_WAITING
          and (p["metadata"].get("annotations") or {}).get(ANNOTATION_SPARE_HASH) == want
          and not p["metadata"].get("deletionTimestamp") and effective_phase(p) == "Running"]
    return sorted(ok, key=lambda p: ((p.get("status") or {}).get("startTime") or "", p["metadata"]["name"]))


def spares_wanted(spec: api.DilocoJobSpec, queued: bool, finished: bool) -> dict[str, int]:
    """Spare pods each template keeps: none for a finished job, nor for one queued in Kueue (a spare would hold
    resources outside the quota)."""
    if finished or queued:
        return {}
    return {t.name: t.spares for t in spec.units if t.spares}
