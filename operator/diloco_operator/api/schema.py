"""Generates the CRDs in crds/ from the pydantic models in api.py, so the two cannot drift.

`python -m diloco_operator.api.schema [--check] [DIR ...]` writes (or checks) crds/*.yaml and the Helm chart's copy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from diloco_operator.api import models as api
from diloco_trainer.config import TENSORS_FIXED, TENSORS_PER_LAYER, ModelConfig, OuterConfig, TrainConfig

CRD_DIR = Path(__file__).resolve().parents[3] / "crds"
# The chart installs its own copy (Helm reads a chart's crds/ folder only); generated here too, byte for byte.
CHART_CRD_DIR = Path(__file__).resolve().parents[3] / "charts" / "decoupled-diloco" / "crds"
_KEEP = ("type", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum", "minItems", "maxItems", "format")


def openapi(model: type[BaseModel]) -> dict:
    """A structural OpenAPI v3 schema for a pydantic model (refs inlined, null-unions and titles removed)."""
    js = model.model_json_schema(mode="validation")
    return _convert(js, js.get("$defs", {}))


def _convert(node: dict, defs: dict) -> dict:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _convert({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        types = {v.get("type") for v in variants}
        if types == {"integer", "string"}:
            # The integer's bounds and the string's pattern apply each to its own form (as in upstream CRDs).
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            for v in variants:
                out.update({k: v[k] for k in ("minimum", "maximum", "pattern") if k in v})
        else:
            assert len(variants) == 1, f"unsupported union in schema: {node}"
            out = _convert(variants[0], defs)
        if node.get("description"):
            out["description"] = node["description"]
        return out
    out = {k: node[k] for k in _KEEP if k in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    if "description" in node:
        out["description"] = node["description"].strip().splitlines()[0]
    # JSON Schema 2020 numeric exclusive bounds -> OpenAPI v3.0 boolean form.
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[plain], out[bound] = node[bound], True
    if out.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        if "properties" in node:
            out["properties"] = {k: _convert(v, defs) for k, v in node["properties"].items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        if node.get("additionalProperties") is True:  # free-form fields (e.g. config.model.hf): kept, not pruned
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif "properties" not in node and isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = _convert(node["additionalProperties"], defs)
    if out.get("type") == "array":
        out["items"] = _convert(node.get("items", {}), defs)
    return out


def _rule(rule: str, message: str, field_path: str | None = None) -> dict:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
        out["reason"] = "FieldValueInvalid"
    return out


_COUNT = "(has(u.count) ? u.count : 1)"
_TOTAL = f"(has(self.replicas) ? self.replicas : self.units.map(u, {_COUNT}).sum())"
_QUORUM = "(has(self.config) && has(self.config.outer) && has(self.config.outer.quorum) ? self.config.outer.quorum : 1)"
_MIN_UNITS = "(has(self.autoscaling.minUnits) ? self.autoscaling.minUnits : 1)"
_MIN_COUNTS = "self.units.map(u, has(u.minCount) ? u.minCount : 0).sum()"
SPEC_RULES = [
    _rule(f"has(self.autoscaling) || {_QUORUM} <= {_TOTAL}",
          "config.outer.quorum (K) must not exceed the number of learner units", ".config.outer.quorum"),
    _rule(f"!has(self.autoscaling) || {_QUORUM} <= {_MIN_UNITS}",
          "config.outer.quorum (K) must not exceed autoscaling.minUnits", ".config.outer.quorum"),
    _rule("self.units.all(u, self.units.exists_one(v, v.name == u.name))", "units[].name must be unique", ".units"),
    _rule(f"has(self.autoscaling) || !has(self.replicas) || self.replicas >= {_MIN_COUNTS}",
          "replicas must be >= the sum of units[].minCount", ".replicas"),
    _rule("has(self.autoscaling) || !has(self.replicas) || !self.units.all(u, has(u.maxCount)) || "
          "self.replicas <= self.units.map(u, u.maxCount).sum()",
          "replicas must be <= the sum of units[].maxCount", ".replicas"),
    _rule(f"!has(self.autoscaling) || {_MIN_UNITS} >= {_MIN_COUNTS}",
          "autoscaling.minUnits must be >= the sum of units[].minCount", ".autoscaling.minUnits"),
    _rule("!has(self.autoscaling) || !has(self.autoscaling.preference) || "
          "self.autoscaling.preference.all(p, self.units.exists(u, u.name == p))",
          "autoscaling.preference must name templates of units[]", ".autoscaling.preference"),
    _rule("self.units.all(u, !has(u.cluster) || (has(self.clusters) && self.clusters.exists(c, c.name == u.cluster)))",
          "units[].cluster must name a spec.clusters entry", ".units"),
    _rule("!has(self.clusters) || self.clusters.all(c, self.clusters.exists_one(d, d.name == c.name))",
          "clusters[].name must be unique", ".clusters"),
    _rule("!has(self.clusters) || self.clusters.all(c, c.syncerUrl.split(',').size() == (has(self.config) && "
          "has(self.config.syncer) && has(self.config.syncer.shards) ? self.config.syncer.shards : 1))",
          "clusters[].syncerUrl must give one URL per syncer shard (config.syncer.shards), comma-separated",
          ".clusters"),
    # Learners send their tokens to these URLs: while the job's link is encrypted, never over plain HTTP.
    _rule("!has(self.clusters) || (has(self.syncer) && has(self.syncer.tls) && has(self.syncer.tls.mode) && "
          "self.syncer.tls.mode == 'Disabled') || self.clusters.all(c, c.syncerUrl.split(',').all(u, "
          "u.startsWith('https://')))",
          api.HTTPS_SYNCER_URL, ".clusters"),
]
AUTOSCALING_RULES = [
    _rule("(has(self.minUnits) ? self.minUnits : 1) <= self.maxUnits", "minUnits must be <= maxUnits", ".minUnits"),
    _rule("!has(self.preference) || self.preference.all(p, self.preference.exists_one(q, q == p))",
          "preference must not repeat a template", ".preference"),
]


def _or_default(obj: str, path: str, default: object) -> str:
    """CEL for `obj.path` (dotted), or the pydantic default when it (or a parent) is absent: the schema
    carries no defaults, the models fill them in."""
    parts = path.split(".")
    has = " && ".join(f"has({obj}.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))
    return f"({has} ? {obj}.{path} : {default})"


def _default(model: type[BaseModel], field: str) -> object:
    return model.model_fields[field].default


_N_LAYERS = (f"(has(self.model) ? {_or_default('self.model', 'n_layers', _default(ModelConfig, 'n_layers'))} "
             f": {TrainConfig().model.n_layers})")
# Only the built-in GPT's tensor count is known without building the model; for the other kinds the syncer checks
# outer.fragments at its start.
_NOT_GPT = "(has(self.model) && (has(self.model.hf) || has(self.model.path) || has(self.model.entrypoint)))"
CONFIG_RULES = [
    _rule(f"{_NOT_GPT} || {_or_default('self', 'outer.fragments', _default(OuterConfig, 'fragments'))} <= "
          f"{TENSORS_FIXED} + {TENSORS_PER_LAYER} * {_N_LAYERS}",
          f"config.outer.fragments (P) must not exceed the model's parameter tensors "
          f"({TENSORS_FIXED} + {TENSORS_PER_LAYER} x config.model.n_layers)", ".outer.fragments"),
    _rule(f"{_or_default('self', 'syncer.shards', 1)} <= "
          f"{_or_default('self', 'outer.fragments', _default(OuterConfig, 'fragments'))}",
          "config.syncer.shards must not exceed config.outer.fragments (P): every shard owns at least one fragment",
          ".syncer.shards"),
    # A transition rule: shard i owns fragments p mod N = i and keeps them in its own checkpoint volume, so a running
    # job cannot be re-sharded (that would hand fragments to shards that do not hold their state).
    _rule(f"{_or_default('self', 'syncer.shards', 1)} == {_or_default('oldSelf', 'syncer.shards', 1)}",
          "config.syncer.shards cannot change on an existing job: each shard keeps its own fragments' state "
          "(create a new job to re-shard)", ".syncer.shards"),
]
OUTER_RULES = [
    _rule(f"{_or_default('self', 'overlap', _default(OuterConfig, 'overlap'))} < "
          f"{_or_default('self', 'sync_every', _default(OuterConfig, 'sync_every'))}",
          "config.outer.overlap (tau) must be less than config.outer.sync_every (H)", ".overlap"),
]
# Volumes of zero bytes are refused by the apiserver when the operator creates the PVC: refuse them here.
VOLUME_RULES = [
    _rule("!has(self.size) || !isQuantity(self.size) || quantity(self.size).isGreaterThan(quantity('0'))",
          "size must be greater than zero", ".size"),
]
DATA_RULES = [
    _rule("[has(self.persistentVolumeClaim), has(self.nfs), has(self.csi)].filter(x, x).size() == 1",
          "data must name exactly one volume source of persistentVolumeClaim, nfs, csi"),
]
# The pods have no working directory the user chose: a path in the config is absolute (inside spec.data's
# mountPath, or baked into the image).
DATA_PATH_RULES = [
    _rule("!has(self.path) || self.path.startsWith('/')",
          "config.data.path must be an absolute path in the pods (e.g. under spec.data.mountPath)", ".path"),    _rule("!has(self.tokenizer) || self.tokenizer == 'bytes' || self.tokenizer.startsWith('/')",
          "config.data.tokenizer must be 'bytes' or an absolute path in the pods", ".tokenizer"),
]
MODEL_PATH_RULES = [
    _rule("!has(self.path) || self.path.startsWith('/')",
          "config.model.path must be an absolute path in the pods (e.g. under spec.data.mountPath)", ".path"),
]
# A LearnerUnit copies its job's syncerUrl and TLS switch (a unit is written by the operator, but may be by hand).
UNIT_RULES = [
    _rule("!has(self.syncerUrl) || (has(self.syncerTls) && !self.syncerTls) || self.syncerUrl.split(',').all(u, "
          "u.startsWith('https://'))", "syncerUrl must be https:// while syncerTls is true", ".syncerUrl"),
]
TLS_RULES = [
    _rule("!has(self.secretName) || !has(self.mode) || self.mode == 'Secret'",
          "secretName applies only with mode Secret (or no mode)", ".secretName"),
    _rule("!has(self.mode) || self.mode != 'Secret' || has(self.secretName)",
          "mode Secret needs secretName", ".secretName"),
]
_SYNCER_KEYS = "[" + ", ".join(f"'{k}'" for k in api.SYNCER_RESOURCES) + "]"
SYNCER_RESOURCES_RULES = [
    _rule(f"!has(self.requests) || self.requests.all(k, k in {_SYNCER_KEYS})", api.SYNCER_RESOURCES_MESSAGE,
          ".requests"),
    _rule(f"!has(self.limits) || self.limits.all(k, k in {_SYNCER_KEYS})", api.SYNCER_RESOURCES_MESSAGE, ".limits"),
]
TEMPLATE_RULES = [
    _rule("(has(self.minCount) ? self.minCount : 0) <= (has(self.count) ? self.count : 1)",
          "minCount must be <= count", ".minCount"),
    _rule("!has(self.maxCount) || (has(self.count) ? self.count : 1) <= self.maxCount",
          "count must be <= maxCount", ".count"),
    _rule("!has(self.spares) || self.spares == 0 || ((!has(self.podsPerUnit) || self.podsPerUnit == 1) && "
          "!has(self.stateVolume) && !has(self.cluster))",
          "spares applies only to units of one pod, without stateVolume, in the operator's own cluster", ".spares"),
]
ACCELERATOR_RULES = [
    _rule("(!has(self.type) || self.type == 'cpu') ? (!has(self.count) || self.count == 0) : "
          "(has(self.count) && self.count >= 1)",
          "count must be 0 for type cpu and at least 1 for GPU and TPU types", ".count"),
    _rule("!has(self.topology) || (has(self.type) && self.type.startsWith('tpu-'))",
          "topology applies only to TPU types", ".topology"),
]


def _status_schema(model: type[BaseModel]) -> dict:
    schema = openapi(model)
    conds = schema["properties"]["conditions"]
    conds["x-kubernetes-list-type"] = "map"
    conds["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def _crd(kind: str, plural: str, short: str, spec: dict, status: dict, columns: list[dict],
         scale: dict | None = None) -> dict:
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = scale
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                      "shortNames": [short], "categories": ["diloco"]},
            "scope": "Namespaced",
            "versions": [{
                "name": api.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object", "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
                        "spec": spec, "status": status,
                    },
                }},
                "subresources": subresources,
                "additionalPrinterColumns": columns,
            }],
        },
    }


def _col(name: str, path: str, typ: str = "string", priority: int = 0, description: str = "") -> dict:
    col = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if description:
        col["description"] = description
    return col


def dilocojob_crd() -> dict:
    """The DilocoJob CRD: schema from DilocoJobSpec/DilocoJobStatus, CEL rules, scale subresource, columns."""
    spec = openapi(api.DilocoJobSpec)
    spec["x-kubernetes-validations"] = SPEC_RULES
    spec["properties"]["autoscaling"]["x-kubernetes-validations"] = AUTOSCALING_RULES
    template = spec["properties"]["units"]["items"]
    template["x-kubernetes-validations"] = TEMPLATE_RULES
    template["properties"]["accelerator"]["x-kubernetes-validations"] = ACCELERATOR_RULES
    template["properties"]["stateVolume"]["x-kubernetes-validations"] = VOLUME_RULES
    spec["properties"]["syncer"]["properties"]["checkpoint"]["x-kubernetes-validations"] = VOLUME_RULES
    spec["properties"]["syncer"]["properties"]["tls"]["x-kubernetes-validations"] = TLS_RULES
    spec["properties"]["syncer"]["properties"]["resources"]["x-kubernetes-validations"] = SYNCER_RESOURCES_RULES
    config = spec["properties"]["config"]
    config["x-kubernetes-validations"] = CONFIG_RULES
    config["properties"]["outer"]["x-kubernetes-validations"] = OUTER_RULES
    config["properties"]["data"]["x-kubernetes-validations"] = DATA_PATH_RULES
    config["properties"]["model"].setdefault("x-kubernetes-validations", []).extend(MODEL_PATH_RULES)
    spec["properties"]["data"]["x-kubernetes-validations"] = DATA_RULES
    columns = [
        _col("Phase", ".status.phase"), _col("Ready", ".status.unitsReady", "integer"),
        _col("Desired", ".status.unitsDesired", "integer"), _col("Restarts", ".status.restarts", "integer"),
        _col("Outer-Steps", ".status.outerSteps", "integer"),
        _col("Goodput", ".status.goodput", "number", 0, "useful / allocated learner time (0-1), from the syncer"),
        _col("Tokens-Merged", ".status.tokensMergedPerFragment", "integer", 0,
             "tokens merged into the global model, per fragment: compares with status.tokensTrained"),
        _col("Age", ".metadata.creationTimestamp", "date"),
        _col("Syncer", ".status.syncerReady", "boolean", 1), _col("Version", ".status.version", "integer", 1),
        _col("Spares", ".status.sparesWaiting", "integer", 1, "warm spare pods running and free (units[].spares)"),
        _col("Message", ".status.message", "string", 1),
    ]
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
             "labelSelectorPath": ".status.selector"}
    return _crd("DilocoJob", "dilocojobs", "dj", spec, _status_schema(api.DilocoJobStatus), columns, scale)


def learnerunit_crd() -> dict:
    """The LearnerUnit CRD (created by the operator, one per unit)."""
    spec = openapi(api.LearnerUnitSpec)
    spec["properties"]["accelerator"]["x-kubernetes-validations"] = ACCELERATOR_RULES
    spec["properties"]["stateVolume"]["x-kubernetes-validations"] = VOLUME_RULES
    spec["properties"]["data"]["x-kubernetes-validations"] = DATA_RULES
    spec["x-kubernetes-validations"] = UNIT_RULES
    columns = [
        _col("Job", ".spec.jobName"), _col("Phase", ".status.phase"),
        _col("Pods-Ready", ".status.podsReady", "integer"), _col("Pods", ".status.podsDesired", "integer"),
        _col("Restarts", ".status.restarts", "integer"), _col("Pool", ".status.nodePool"),
        _col("Cluster", ".spec.cluster"),
        _col("Last-Fault", ".status.lastFault.reason", "string", 0, "why the unit last restarted as a whole"),
        _col("Recovery", ".status.lastFault.recoverySeconds", "number", 0,
             "seconds from that fault to all its pods ready again"),
        _col("Lost-Tokens", ".status.lastFault.lostTokens", "integer", 0,
             "tokens the learner process that fault ended trained that no merge covers"),
        _col("Lost-Steps", ".status.lastFault.lostSteps", "integer", 1, "their inner steps"),
        _col("Age", ".metadata.creationTimestamp", "date"),
        _col("Unit", ".spec.unitIndex", "integer", 1), _col("Message", ".status.message", "string", 1),
    ]
    return _crd("LearnerUnit", "learnerunits", "lu", spec, _status_schema(api.LearnerUnitStatus), columns)


def render() -> dict[str, str]:
    """File name -> YAML text of every CRD."""
    header = "# Generated by `python -m diloco_operator.api.schema` from operator/diloco_operator/api/models.py: do not edit.\n"
    return {f"{api.GROUP}_{crd['spec']['names']['plural']}.yaml": header + yaml.safe_dump(crd, sort_keys=False, width=120)
            for crd in (dilocojob_crd(), learnerunit_crd())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", nargs="*", default=[str(CRD_DIR), str(CHART_CRD_DIR)])
    parser.add_argument("--check", action="store_true", help="fail if the files differ from the models")
    args = parser.parse_args(argv)
    stale = []
    for out in map(Path, args.dir):
        for name, text in render().items():
            path = out / name
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path))
            else:
                out.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m diloco_operator.api.schema", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
