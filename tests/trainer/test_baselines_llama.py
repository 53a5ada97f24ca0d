"""The baselines on the real-model path (issue 18): `diloco baseline ddp|sync-diloco` train a Llama-style
transformers model from an inline config on token shards of a BPE trained by `diloco data tokenizer`, 2 real gloo
processes on loopback; what `diloco bench --only quality_llama` compares Decoupled DiLoCo against."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from diloco_trainer.data.corpus import stdlib_root
from diloco_trainer.runtime.procs import child_env
from diloco_trainer.runtime.rundir import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~60 s each at load 2, 150 s at load 10

VOCAB = 320
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "tie_word_embeddings": True}
H = 4


def _diloco(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_trainer.cli", *args], env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A BPE trained on a few stdlib modules, their token shards, and a run config with the Llama on them."""
    work = tmp_path_factory.mktemp("llama-baselines")
    files = [str(stdlib_root() / name) for name in ("argparse.py", "dataclasses.py", "enum.py", "functools.py")]
    for args in (("data", "tokenizer", *files, "--vocab", str(VOCAB), "--out", str(work / "tokenizer.json")),
                 ("data", "prepare", *files, "--tokenizer", str(work / "tokenizer.json"), "--out",
                  str(work / "shards"), "--shard-tokens", "20000", "--no-progress")):
        out = _diloco(*args)
        assert out.returncode == 0, out.stderr[-3000:]
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"hf": LLAMA, "seq_len": 32},
        "data": {"source": "shards", "path": str(work / "shards"), "tokenizer": str(work / "tokenizer.json")},
        "inner": {"batch_size": 8, "warmup_steps": 4, "lr": 0.003},
        "outer": {"fragments": 4, "sync_every": H, "lr": 1.0, "momentum": 0.0}}))
    return path


@pytest.mark.parametrize("mode", ["ddp", "sync-diloco"])
def test_a_baseline_trains_an_inline_llama_on_bpe_shards_with_identical_replicas_and_reports_nats_per_token(
        mode, config, tmp_path):
    run_dir = tmp_path / "run"
    out = _diloco("baseline", mode, "--config", str(config), "--learners", "2", "--steps", "24", "--run-dir",
                  str(run_dir), "--plain", "--log-every", "4", "--snapshots", "1", "--eval-batches", "4")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())

    assert len({v["param_sha256"] for v in summary["per_learner"].values()}) == 1, "the replicas diverged"
    for name in ("learner-0", "learner-1"):
        recs = read_jsonl(run_dir / "learners" / name / "metrics.jsonl")
        assert recs[-1]["step"] == 24 and recs[-1]["versions"] == {"all": 24 if mode == "ddp" else 24 // H}
        assert recs[-1]["loss"] < recs[0]["loss"] - 0.3, [r["loss"] for r in recs]
    evals = summary["global_evals"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3 < math.log(VOCAB)  # Θ₀ guesses ~uniformly
    assert summary["tokens_trained"] == 2 * 24 * 8 * 32 and summary["merged_fraction"] == 1.0
    # The unigram baseline is of the BPE tokens (not bytes), and the report says so.
    assert 3.0 < summary["unigram_loss"] < math.log(VOCAB) and summary["loss_unit"] == "nats/token"
    assert f"{summary['val_loss']:.4f} nats/token vs unigram baseline" in out.stdout
    assert "nats/byte" not in out.stdout
    with safe_open(str(run_dir / "final" / "theta.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "hf.model.embed_tokens.weight" in names and "hf.lm_head.weight" not in names  # tied: one tensor
    assert "hf.model.layers.1.self_attn.k_proj.weight" in names
