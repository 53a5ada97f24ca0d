"""The CRDs: generated from the pydantic models, and enforced by the real apiserver with the field named."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from pydantic import ValidationError

from diloco_operator.api import models as api, schema

from cluster_kit import ROOT

GOOD = {
    "apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": "good"},
    "spec": {"image": "diloco-trainer:0.1.0", "config": {"outer": {"quorum": 2}},
             "units": [{"name": "h100", "count": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                       {"name": "tpu", "count": 1, "podsPerUnit": 2,
                        "accelerator": {"type": "tpu-v5p-slice", "count": 4, "topology": "2x2x2"}}]},
}


def _with(path: str, value, drop: bool = False) -> dict:
    """GOOD with `value` at `path` (dotted; list indices as numbers; missing dicts on the way are created)."""
    doc = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if drop:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


# Every countable field set to 10^12 must be refused (its maximum is in the schema and the models).
ABSURD = [f"spec.config.{f}" for f in (
    "model.d_model", "model.n_layers", "model.n_heads", "model.seq_len", "model.vocab_size", "model.mlp_ratio",
    "inner.batch_size", "inner.warmup_steps", "outer.sync_every", "outer.overlap", "outer.fragments",
    "outer.block_size", "outer.versions_kept", "data.max_bytes", "seed")] + [
    "spec.units.0.steps", "spec.units.0.count", "spec.units.0.spares", "spec.units.0.podsPerUnit", "spec.restartPolicy.maxRestarts",
    "spec.syncer.maxBodyMb", "spec.failurePolicy.nodeLostSeconds", "spec.failurePolicy.drainSeconds"]

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
    ("node lost after under 5 s", _with("spec.failurePolicy.nodeLostSeconds", 2), "spec.failurePolicy.nodeLostSeconds"),
    ("chaos without a schedule", _with("spec.chaos", {"action": {"type": "kill"}}), "spec.chaos.schedule"),
    ("unknown chaos action", _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "explode"}}),
     "spec.chaos.action.type"),
    ("chaos exit code out of range",
     _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "fail", "exitCode": 300}}),
     "spec.chaos.action.exitCode"),
    # Quantities (issue 8): empty, negative or malformed requests, limits and volume sizes.
    ("empty cpu request", _with("spec.units.0.resources", {"requests": {"cpu": ""}}),
     "spec.units[0].resources.requests.cpu"),
    ("empty memory limit", _with("spec.units.1.resources", {"limits": {"memory": ""}}),
     "spec.units[1].resources.limits.memory"),
    ("negative cpu request", _with("spec.units.0.resources", {"requests": {"cpu": "-1"}}),
     "spec.units[0].resources.requests.cpu"),
    ("negative integer memory limit", _with("spec.units.0.resources", {"limits": {"memory": -2}}),
     "spec.units[0].resources.limits.memory"),
    ("malformed quantity", _with("spec.units.0.resources", {"requests": {"memory": "4 GB"}}),
     "spec.units[0].resources.requests.memory"),
    ("empty syncer cpu request", _with("spec.syncer", {"resources": {"requests": {"cpu": ""}}}),
     "spec.syncer.resources.requests.cpu"),
    ("empty syncer memory limit", _with("spec.syncer", {"resources": {"limits": {"memory": ""}}}),
     "spec.syncer.resources.limits.memory"),
    # Issue 38, Medium 5: the syncer runs outside Kueue's quota: no accelerator (nor other extended resource) there.
    ("a GPU on the syncer", _with("spec.syncer", {"resources": {"limits": {"nvidia.com/gpu": 8}}}),
     "spec.syncer.resources.limits"),
    ("a TPU request on the syncer", _with("spec.syncer", {"resources": {"requests": {"cpu": "2", "google.com/tpu": 4}}}),
     "spec.syncer.resources.requests"),
    # Issue 38, Low 13: a chaos duration is seconds (>= 0) or a string like 30s / 1h30m, never empty or negative.
    ("empty chaos interval", _with("spec.chaos", {"schedule": {"every": ""}, "action": {"type": "kill"}}),
     "spec.chaos.schedule.every"),
    ("negative chaos start", _with("spec.chaos", {"schedule": {"every": "2m", "startAfter": -5},
                                                  "action": {"type": "kill"}}), "spec.chaos.schedule.startAfter"),
    ("malformed chaos max duration", _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "kill"},
                                                          "safety": {"maxDuration": "soon"}}),
     "spec.chaos.safety.maxDuration"),
    ("empty chaos recovery timeout", _with("spec.chaos", {"schedule": {"every": "2m"}, "action": {"type": "kill"},
                                                          "safety": {"recoveryTimeout": " "}}),
     "spec.chaos.safety.recoveryTimeout"),
    ("empty checkpoint size", _with("spec.syncer", {"checkpoint": {"size": ""}}), "spec.syncer.checkpoint.size"),
    ("zero checkpoint size", _with("spec.syncer", {"checkpoint": {"size": "0Gi"}}), "spec.syncer.checkpoint.size"),
    # Warm spare pods (issue 19): only for units of one pod, without a state volume, at home; at most 16.
    ("spares for units of several pods", _with("spec.units.0", {"name": "a", "podsPerUnit": 2, "spares": 1}),
     "spec.units[0].spares"),
    ("spares with a state volume", _with("spec.units.0", {"name": "a", "spares": 1, "stateVolume": {"size": "1Gi"}}),
     "spec.units[0].spares"),
    ("too many spares", _with("spec.units.0.spares", 17), "spec.units[0].spares"),
    ("negative state volume size", _with("spec.units.0.stateVolume", {"size": "-1Gi"}),
     "spec.units[0].stateVolume.size"),
    ("empty state volume size", _with("spec.units.0.stateVolume", {"size": ""}), "spec.units[0].stateVolume.size"),
    # The outer schedule and fragments (issue 8).
    ("overlap equal to sync_every", _with("spec.config.outer", {"quorum": 2, "sync_every": 4, "overlap": 4}),
     "spec.config.outer.overlap"),
    ("default overlap not below sync_every", _with("spec.config.outer", {"quorum": 2, "sync_every": 2}),
     "spec.config.outer.overlap"),
    ("more fragments than the model's tensors",
     _with("spec.config", {"model": {"n_layers": 1}, "outer": {"quorum": 2, "fragments": 13}}),
     "spec.config.outer.fragments"),
    ("more fragments than the default model's tensors", _with("spec.config.outer", {"quorum": 2, "fragments": 37}),
     "spec.config.outer.fragments"),
    ("more syncer shards than fragments",
     _with("spec.config", {"outer": {"quorum": 2, "fragments": 2}, "syncer": {"shards": 3}}),
     "spec.config.syncer.shards"),
    # spec.clusters (issue 9): units in remote clusters.
    ("a template in a cluster spec.clusters does not name", _with("spec.units.0.cluster", "west"), "spec.units"),
    ("two clusters of one name", _with("spec.clusters", [
        {"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "https://s.w:8470"},
        {"name": "west", "kubeconfigSecret": {"name": "w2"}, "syncerUrl": "https://s.w2:8470"}]), "spec.clusters"),
    ("a remote syncerUrl that is no URL", _with("spec.clusters", [
        {"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "syncer:8470"}]), "spec.clusters[0].syncerUrl"),
    ("a remote syncerUrl over plain http while TLS is on", _with("spec.clusters", [
        {"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "http://s.w:8470"}]), "spec.clusters"),
    ("a remote syncerUrl with one shard over plain http", _with("spec", {**GOOD["spec"], "config": {
        "outer": {"quorum": 2}, "syncer": {"shards": 2}}, "clusters": [{
            "name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "https://s0.w:8470,http://s1.w:8470"}]}),
     "spec.clusters"),
    ("a remote cluster without a kubeconfig Secret", _with("spec.clusters", [
        {"name": "west", "syncerUrl": "https://s.w:8470"}]), "spec.clusters[0].kubeconfigSecret"),
    # spec.data (issue 18): one read-only volume source, absolute paths in the config.
    ("a data volume with no source", _with("spec.data", {"mountPath": "/data"}), "spec.data"),
    ("a data volume with two sources", _with("spec.data", {"persistentVolumeClaim": {"claimName": "tokens"},
                                                           "nfs": {"server": "nfs.local", "path": "/x"}}), "spec.data"),
    ("a data mount at the root", _with("spec.data", {"mountPath": "/", "persistentVolumeClaim": {"claimName": "t"}}),
     "spec.data.mountPath"),
    ("a data claim with no name", _with("spec.data", {"persistentVolumeClaim": {}}),
     "spec.data.persistentVolumeClaim.claimName"),
    ("a relative data path", _with("spec.config.data", {"source": "tokens", "path": "tokens.bin"}),
     "spec.config.data.path"),
    ("a relative model checkpoint path", _with("spec.config.model", {"path": "ckpt"}), "spec.config.model.path"),
    ("a relative tokenizer path", _with("spec.config.data", {"tokenizer": "tok.json"}), "spec.config.data.tokenizer"),
    ("an empty template image", _with("spec.units.0.image", ""), "spec.units[0].image"),
    # spec.autoscaling (issue 9).
    ("autoscaling minUnits above maxUnits", _with("spec.autoscaling", {"minUnits": 5, "maxUnits": 2}),
     "spec.autoscaling.minUnits"),
    ("autoscaling preference naming no template",
     _with("spec.autoscaling", {"minUnits": 2, "maxUnits": 4, "preference": ["a100"]}), "spec.autoscaling.preference"),
    ("K above autoscaling.minUnits", _with("spec.autoscaling", {"minUnits": 1, "maxUnits": 4}),
     "spec.config.outer.quorum"),
    ("absurd maxUnits", _with("spec.autoscaling", {"minUnits": 2, "maxUnits": 10**12}), "spec.autoscaling.maxUnits"),
    # Absurd sizes (issue 8): 10^12 of anything countable.
    *[(f"absurd {path.rsplit('.', 1)[-1]}", _with(path, 10**12), re.sub(r"\.([0-9]+)", r"[\1]", path))
      for path in ABSURD],
]


def test_committed_crds_and_the_charts_copy_are_generated_from_the_models():
    rendered = schema.render()
    for folder in ("crds", "charts/decoupled-diloco/crds"):
        assert sorted(p.name for p in (ROOT / folder).iterdir()) == sorted(rendered), f"{folder}/ holds other files"
        for name, text in rendered.items():
            assert (ROOT / folder / name).read_text() == text, \
                f"{folder}/{name} is stale: python -m diloco_operator.api.schema"


def test_the_crd_schema_is_structural_and_carries_the_training_config():
    spec = schema.dilocojob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = json.dumps(spec)
    assert "$ref" not in text and "anyOf" not in text and "additionalProperties\": false" not in text
    outer = spec["properties"]["config"]["properties"]["outer"]["properties"]
    assert set(outer) == set(api.DilocoJobSpec.model_fields["config"].annotation.model_fields["outer"].annotation
                             .model_fields)
    assert outer["compression"]["enum"] == ["none", "bf16", "int8", "int4"]


@pytest.mark.parametrize("what,doc,field", BAD, ids=[b[0] for b in BAD])
def test_the_pydantic_model_rejects_each_bad_manifest_naming_the_field(what, doc, field):
    with pytest.raises(ValidationError) as exc:
        api.DilocoJobSpec.model_validate(doc["spec"])
    leaf = re.split(r"[.\[\]]", field.rstrip("]"))[-1]
    assert leaf in str(exc.value), f"{what}: the operator's error does not name {leaf}: {exc.value}"


def test_every_integer_field_of_both_crds_has_a_maximum():
    def walk(node: dict, path: str):
        if node.get("type") == "integer" or node.get("x-kubernetes-int-or-string"):
            yield path, node
        for key, child in node.get("properties", {}).items():
            yield from walk(child, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from walk(node[key], f"{path}[]")
    for crd in (schema.dilocojob_crd(), schema.learnerunit_crd()):
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        for path, node in walk(spec, "spec"):
            if node.get("x-kubernetes-int-or-string"):  # quantities and durations: a string form, checked apart
                continue
            assert "maximum" in node, f"{crd['spec']['names']['kind']} {path} has no maximum"


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
    assert header[:8] == ["NAME", "PHASE", "READY", "DESIRED", "RESTARTS", "OUTER-STEPS", "GOODPUT", "TOKENS-MERGED"]
    assert kubectl.run("get", "lu", "-n", ns).returncode == 0
    kubectl.run("patch", "dj", "good", "-n", ns, "--subresource=status", "--type=merge", "-p",
                json.dumps({"status": {"phase": "Running", "unitsReady": 3, "unitsDesired": 3, "restarts": 0,
                                       "outerSteps": 8, "goodput": 0.4213, "tokensMergedPerFragment": 1234567}}))
    row = dict(zip(header, kubectl.run("get", "dj", "good", "-n", ns).stdout.splitlines()[1].split()))
    assert (row["GOODPUT"], row["TOKENS-MERGED"]) == ("0.4213", "1234567")
    out = kubectl.run("patch", "dj", "good", "-n", ns, "--subresource=status", "--type=merge", "-p",
                      json.dumps({"status": {"goodput": 1.5}}), check=False)
    assert out.returncode != 0 and "status.goodput" in out.stderr  # a fraction: at most 1


def test_kubectl_get_dj_columns_read_goodput_and_tokens_merged_per_fragment_from_the_status():
    version = schema.dilocojob_crd()["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"] if not c.get("priority")}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for name, field, typ in (("Goodput", "goodput", "number"), ("Tokens-Merged", "tokensMergedPerFragment", "integer")):
        assert columns[name]["jsonPath"] == f".status.{field}" and columns[name]["type"] == typ
        assert status[field]["type"] == typ
    assert "per fragment" in columns["Tokens-Merged"]["description"]


@pytest.mark.cluster
def test_the_apiserver_refuses_to_reshard_an_existing_job_and_keeps_it_as_it_was(kubectl, crds, ns):
    sharded = _with("spec.config.syncer", {"shards": 2})
    kubectl.apply(sharded, "-n", ns)
    out = kubectl.apply(_with("spec.config.syncer", {"shards": 3}), "-n", ns, check=False)
    assert out.returncode != 0 and "spec.config.syncer.shards" in out.stderr and "cannot change" in out.stderr, out.stderr
    assert kubectl.get("dilocojob", "good", ns=ns)["spec"]["config"]["syncer"]["shards"] == 2
    # Other changes to the config are still accepted.
    kubectl.apply(_with("spec.config", {"outer": {"quorum": 1}, "syncer": {"shards": 2}}), "-n", ns)



@pytest.mark.cluster
def test_the_apiserver_keeps_an_inline_transformers_config_whole_and_leaves_its_fragment_count_to_the_syncer(
        kubectl, crds, ns):
    hf = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 50000.0, "rms_norm_eps": 1e-5}
    # Only the built-in GPT's tensor count is known at apply time: 100 fragments are the syncer's to judge here.
    doc = _with("spec.config", {"model": {"seq_len": 32, "hf": hf}, "outer": {"fragments": 100}})
    api.DilocoJobSpec.model_validate(doc["spec"])
    kubectl.apply(doc, "-n", ns)
    stored = kubectl.get("dilocojob", "good", ns=ns)["spec"]["config"]
    assert stored["model"]["hf"] == hf, "fields of model.hf (rope_theta, rms_norm_eps) must not be pruned"
    out = kubectl.apply(_with("spec.config", {"model": {"n_layers": 2}, "outer": {"fragments": 100}}), "-n", ns,
                        check=False)
    assert out.returncode != 0 and "spec.config.outer.fragments" in out.stderr, out.stderr


@pytest.mark.cluster
def test_the_apiserver_refuses_a_plain_http_syncer_url_while_tls_is_on_and_says_which_field(kubectl, crds, ns):
    west = {"name": "west", "kubeconfigSecret": {"name": "w"}, "syncerUrl": "http://syncer.west.example:8470"}
    out = kubectl.apply(_with("spec.clusters", [west]), "-n", ns, check=False)
    assert out.returncode != 0 and "spec.clusters" in out.stderr, out.stderr
    assert "clusters[].syncerUrl must be https://" in out.stderr and "spec.syncer.tls" in out.stderr, out.stderr
    assert kubectl.get("dilocojob", ns=ns) == []
    # A job that chose plain HTTP for every link may name an http:// address; https is fine either way.
    plain = _with("spec.clusters", [west])
    plain["spec"]["syncer"] = {"tls": {"mode": "Disabled"}}
    api.DilocoJobSpec.model_validate(plain["spec"])
    kubectl.apply(plain, "-n", ns)
    kubectl.apply(_with("spec.clusters", [{**west, "syncerUrl": "https://syncer.west.example:8470"}]), "-n", ns)
    # A LearnerUnit (the operator's copy of it) is held to the same rule.
    unit = {"apiVersion": api.API_VERSION, "kind": "LearnerUnit", "metadata": {"name": "good-cpu-0"},
            "spec": {"jobName": "good", "template": "cpu", "index": 0, "unitIndex": 0, "image": "x",
                     "cluster": "west", "syncerUrl": west["syncerUrl"]}}
    out = kubectl.apply(unit, "-n", ns, check=False)
    assert out.returncode != 0 and "spec.syncerUrl" in out.stderr and "https://" in out.stderr, out.stderr
    with pytest.raises(ValidationError, match="syncerUrl must be https://"):
        api.LearnerUnitSpec.model_validate(unit["spec"])
    kubectl.apply({**unit, "spec": {**unit["spec"], "syncerTls": False}}, "-n", ns)
