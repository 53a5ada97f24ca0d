"""The CRDs: generated from the pydantic models, and enforced by the real apiserver with the field named."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from pydantic import ValidationError

from diloco_operator import api, schema

from cluster_kit import ROOT

GOOD = {
    "apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": "good"},
    "spec": {"image": "diloco-trainer:0.1.0", "config": {"outer": {"quorum": 2}},
             "units": [{"name": "h100", "count": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                       {"name": "tpu", "count": 1, "podsPerUnit": 2,
                        "accelerator": {"type": "tpu-v5p-slice", "count": 4, "topology": "2x2x2"}}]},
}


def _with(path: str, value, drop: bool = False) -> dict:
    doc = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if drop:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


# (what is wrong, manifest, text the apiserver's error must contain)
BAD = [
    ("wrong type", _with("spec.units.0.count", "two"), "spec.units[0].count"),
    ("negative count", _with("spec.units.0.count", -1), "spec.units[0].count"),
    ("K larger than the units", _with("spec.config.outer.quorum", 7), "spec.config.outer.quorum"),
    ("unknown accelerator type", _with("spec.units.0.accelerator.type", "nvidia-rtx-9090"),
     "spec.units[0].accelerator.type"),
    ("missing image", _with("spec.image", None, drop=True), "spec.image"),
    ("GPU type without a count", _with("spec.units.0.accelerator.count", 0), "spec.units[0].accelerator.count"),
    ("duplicate template names", _with("spec.units.1.name", "h100"), "spec.units"),
    ("replicas above every maxCount",
     _with("spec", {"image": "x", "replicas": 5, "units": [{"name": "a", "count": 1, "maxCount": 2}]}),
     "spec.replicas"),
    ("chaos without a schedule", _with("spec.chaos", {"action": {"type": "kill"}}), "spec.chaos.schedule"),
    ("unknown chaos action", _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "explode"}}),
     "spec.chaos.action.type"),
    ("chaos exit code out of range",
     _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "fail", "exitCode": 300}}),
     "spec.chaos.action.exitCode"),
]


def test_committed_crds_are_generated_from_the_models():
    rendered = schema.render()
    for name, text in rendered.items():
        assert (ROOT / "crds" / name).read_text() == text, f"crds/{name} is stale: python -m diloco_operator.schema"


def test_the_crd_schema_is_structural_and_carries_the_training_config():
    spec = schema.dilocojob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = json.dumps(spec)
    assert "$ref" not in text and "anyOf" not in text and "additionalProperties\": false" not in text
    outer = spec["properties"]["config"]["properties"]["outer"]["properties"]
    assert set(outer) == set(api.DilocoJobSpec.model_fields["config"].annotation.model_fields["outer"].annotation
                             .model_fields)
    assert outer["compression"]["enum"] == ["none", "bf16", "int8", "int4"]


@pytest.mark.parametrize("what,doc,field", BAD, ids=[b[0] for b in BAD])
def test_the_pydantic_model_rejects_each_bad_manifest(what, doc, field):
    with pytest.raises(ValidationError):
        api.DilocoJobSpec.model_validate(doc["spec"])


def test_the_pydantic_model_accepts_the_good_manifest_and_every_sample():
    api.DilocoJobSpec.model_validate(GOOD["spec"])
    for path in sorted((ROOT / "manifests").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DilocoJob":
                api.DilocoJobSpec.model_validate(doc["spec"])


@pytest.mark.cluster
@pytest.mark.parametrize("what,doc,field", BAD, ids=[b[0] for b in BAD])
def test_the_apiserver_rejects_a_bad_manifest_naming_the_field(kubectl, crds, ns, what, doc, field):
    out = kubectl.apply(doc, "-n", ns, check=False)
    assert out.returncode != 0, f"{what}: accepted by the apiserver"
    assert field in out.stderr, f"{what}: error does not name {field}: {out.stderr}"
    assert kubectl.get("dilocojob", ns=ns) == [], "a rejected manifest must not create anything"


@pytest.mark.cluster
def test_the_apiserver_accepts_the_good_manifest_and_kubectl_shows_columns(kubectl, crds, ns):
    kubectl.apply(GOOD, "-n", ns)
    out = kubectl.run("get", "dj", "-n", ns).stdout
    header = out.splitlines()[0].split()
    assert header[:6] == ["NAME", "PHASE", "READY", "DESIRED", "RESTARTS", "OUTER-STEPS"]
    assert kubectl.run("get", "lu", "-n", ns).returncode == 0
