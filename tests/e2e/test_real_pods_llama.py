"""A user's own model in real pods (issue 18): a Llama-style transformers model from an inline config, a BPE
tokenizer trained on local text, and token shards made by `diloco data prepare`, on a data volume (a PVC) that the
operator mounts read-only into the learner and syncer pods. Two learner units train it; the final global model
beats the unigram baseline of those tokens, and `diloco export` turns the syncer's checkpoint into a directory that
transformers loads and generates from.

The tests run in file order on one job."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from polling import wait_for
from diloco_devcluster import realnode
from e2e_kit import job_namespace, learner_step, pv_dir

pytestmark = [pytest.mark.e2e]

JOB = "llama"
UNITS = 2
STEPS = 400
VOCAB = 384
MOUNT = "/data"
DATA_CLAIM = "tokens"
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_trainer.cli", *args], check=True, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """What a user brings: a BPE tokenizer trained on local text and the token shards prepared with it."""
    work = tmp_path_factory.mktemp("llama-data")
    text = work / "text"
    text.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "asyncio/base_events.py", "collections/__init__.py", "dataclasses.py", "enum.py",
                 "functools.py", "inspect.py", "pathlib.py", "subprocess.py", "typing.py"):
        src = stdlib / name
        shutil.copy(src, text / f"{src.parent.name}_{src.stem}.txt")
    out = work / "data"
    out.mkdir()
    diloco("data", "tokenizer", str(text), "--vocab", str(VOCAB), "--out", str(out / "tokenizer.json"))
    diloco("data", "prepare", str(text), "--tokenizer", str(out / "tokenizer.json"), "--out", str(out / "shards"),
           "--no-progress")
    return out


def job_manifest(image: str) -> dict:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoJob", "metadata": {"name": JOB},
        "spec": {
            "image": image, "imagePullPolicy": "IfNotPresent",
            "data": {"mountPath": MOUNT, "persistentVolumeClaim": {"claimName": DATA_CLAIM}},
            "config": {"model": {"hf": LLAMA, "seq_len": 64},
                       "data": {"source": "shards", "path": f"{MOUNT}/shards", "tokenizer": f"{MOUNT}/tokenizer.json"},
                       "inner": {"batch_size": 8, "lr": 0.003, "warmup_steps": 10},
                       "outer": {"fragments": 4, "sync_every": 8, "overlap": 2, "compression": "int4", "quorum": 1,
                                 "lr": 1.0, "momentum": 0.0}},
            "units": [{"name": "cpu", "count": UNITS, "accelerator": {"type": "cpu"}, "steps": STEPS,
                       "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}}],
            "syncer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}, "checkpoint": {"size": "1Gi"}},
        },
    }


def data_claim(kubectl, data: Path) -> dict:
    """A claim bound up front to a free local volume of the real node, filled with the user's data (what copying a
    data set onto a PersistentVolume does)."""
    free = [pv for pv in kubectl.get("persistentvolumes")
            if pv["spec"].get("storageClassName") == realnode.STORAGE_CLASS and pv.get("status", {}).get("phase")
            == "Available" and not pv["spec"].get("claimRef")]
    assert free, "no free local PersistentVolume on the real node"
    pv = free[-1]
    target = Path(pv["spec"]["local"]["path"])
    shutil.copytree(data, target, dirs_exist_ok=True)
    for path in [target, *target.rglob("*")]:  # readable by the image's user (10001), writable by nobody but root
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": DATA_CLAIM},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": realnode.STORAGE_CLASS,
                     "volumeName": pv["metadata"]["name"], "resources": {"requests": {"storage": "1Gi"}}}}


class LlamaJob:
    def __init__(self, kubectl, ns: str):
        self.kubectl, self.ns = kubectl, ns

    def status(self) -> dict:
        return (self.kubectl.get("dj", JOB, ns=self.ns) or {}).get("status") or {}

    def pods(self, component: str) -> list[dict]:
        pods = self.kubectl.get("pod", ns=self.ns, selector=f"diloco.dev/job={JOB},diloco.dev/component={component}")
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def running(self, component: str) -> list[dict]:
        return [p for p in self.pods(component) if p.get("status", {}).get("phase") == "Running"
                and all("running" in (c.get("state") or {}) for c in p["status"].get("containerStatuses", []))]


@pytest.fixture(scope="module")
def job(kubectl, operator_pod, images, data):
    with job_namespace(kubectl, "e2e-llama", data_claim(kubectl, data), job_manifest(images.trainer)) as ns:
        yield LlamaJob(kubectl, ns)


def test_the_data_volume_is_mounted_read_only_and_a_llama_trains_from_its_shards(job):
    wait_for(lambda: len(job.running("syncer")) == 1 and len(job.running("learner")) == UNITS, 300,
             f"the syncer and {UNITS} learner containers running", 1.0)
    for pod in job.running("learner") + job.running("syncer"):
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "data")
        assert volume["persistentVolumeClaim"] == {"claimName": DATA_CLAIM, "readOnly": True}
        for container in pod["spec"]["containers"]:
            mount = next(m for m in container["volumeMounts"] if m["name"] == "data")
            assert mount["mountPath"] == MOUNT and mount["readOnly"] is True
    wait_for(lambda: all((learner_step(p) or 0) >= 1 for p in job.running("learner")), 300,
             "every learner training the Llama", 1.0)
    wait_for(lambda: job.status().get("outerSteps", 0) >= 4, 300, "merges of the Llama's fragments", 1.0)


def test_a_llama_split_into_more_fragments_than_tensors_is_refused_by_its_syncer_without_a_crash_loop(job):
    # Only building the model counts its tensors (2 layers: 21); the CRD admits the job, the syncer refuses it (exit
    # 2, reason in the termination message the kubelet keeps), the operator reports it and stops the syncer.
    manifest = job_manifest(job.kubectl.get("dj", JOB, ns=job.ns)["spec"]["image"])
    manifest["metadata"]["name"] = "too-split"
    manifest["spec"]["config"]["outer"]["fragments"] = 64
    manifest["spec"]["units"][0]["count"] = 1
    job.kubectl.apply(manifest, "-n", job.ns)
    try:
        def refused():
            dj = job.kubectl.get("dj", "too-split", ns=job.ns) or {}
            ready = next((c for c in (dj.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), {})
            return ready if ready.get("reason") == "InvalidSpec" else None
        ready = wait_for(refused, 300, "the refused job Ready=False/InvalidSpec", 1.0)
        assert ready["message"].startswith("spec.config.outer.fragments (64) must not exceed the model's"), ready
        wait_for(lambda: job.kubectl.get("deployment", "too-split-syncer", ns=job.ns)["spec"]["replicas"] == 0
                 and not job.kubectl.get("pod", ns=job.ns, selector="diloco.dev/job=too-split,diloco.dev/component=syncer"),
                 120, "the refused syncer scaled to zero and gone", 1.0)
    finally:
        job.kubectl.run("delete", "dj", "too-split", "-n", job.ns, "--wait=false", check=False)


@pytest.mark.timeout(1500)
def test_the_final_llama_beats_the_unigram_baseline_and_exports_to_transformers(job, kubectl, data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diloco_trainer.config import TrainConfig
    from diloco_trainer.data.corpus import unigram_loss
    from diloco_trainer.data.source import open_tokens
    from diloco_trainer.runtime import report
    from diloco_trainer.syncer.store import read_checkpoint

    wait_for(lambda: job.status().get("phase") in ("Succeeded", "Failed"), 1200, "the job finishing", 2.0)
    assert job.status()["phase"] == "Succeeded", job.status()
    wait_for(lambda: not job.pods("syncer"), 120, "the syncer pod gone after the job finished", 1.0)
    state_dir = pv_dir(kubectl, job.ns, f"{JOB}-checkpoint")
    ckpt = read_checkpoint(state_dir)
    assert ckpt is not None, "no checkpoint in the syncer's PVC"
    cfg = TrainConfig.model_validate(ckpt.state["config"])
    assert cfg.model.hf is not None and cfg.model.hf.model_type == "llama"
    # The same tokens, read here from the user's copy instead of the pods' mount.
    here = cfg.data.model_copy(update={"path": str(data / "shards"), "tokenizer": str(data / "tokenizer.json")})
    tokens = open_tokens(here, VOCAB)
    val = tokens.sample("val", 200_000)
    val_loss = report.evaluate_theta(cfg, ckpt.theta, val, 8, cfg.inner.batch_size)
    unigram = unigram_loss(tokens.sample("train", 2_000_000), val)
    print(f"[e2e llama] final validation loss {val_loss:.3f} vs unigram {unigram:.3f}", file=sys.stderr)
    assert val_loss < unigram

    out = tmp_path / "llama-hf"
    diloco("export", str(state_dir), str(out), "--format", "hf", "--tokenizer", str(data / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("def main(", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 16
    text = tokenizer.decode(generated[0])
    print(f"[e2e llama] generated: {text!r}", file=sys.stderr)
    assert text.startswith("def main(")
