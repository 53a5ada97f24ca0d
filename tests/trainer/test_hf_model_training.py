"""A transformers Llama-style model (inline config, tied embeddings) trained by a real syncer and two learner processes
over loopback (issue 18); a syncer that cannot build the run's model exits 2, saying why where Kubernetes shows it."""

import subprocess
import sys

import pytest
import yaml
from safetensors import safe_open

from polling import wait_for
from learner_kit import ROOT, SyncerProcess, child_env, finish, metrics, start_learner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 64, "tie_word_embeddings": True}


def _config(path):
    path.write_text(yaml.safe_dump({
        "model": {"hf": LLAMA, "seq_len": 32}, "data": {"max_bytes": 200_000},
        "inner": {"batch_size": 8, "warmup_steps": 5},
        "outer": {"fragments": 4, "sync_every": 8, "compression": "int4"}}))
    return path


def test_two_learners_train_an_inline_llama_with_a_real_syncer_and_the_tied_embedding_stays_one_tensor(tmp_path):
    syncer = SyncerProcess(_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log")
    syncer.start()
    try:
        logs = {lid: tmp_path / f"{lid}.log" for lid in ("l0", "l1")}
        procs = {lid: start_learner(syncer.url, lid, tmp_path / lid, 24, "--unit", str(i), "--units", "2",
                                    log_path=logs[lid]) for i, lid in enumerate(logs)}
        for lid, proc in procs.items():
            finish(proc, logs[lid])
        for lid in procs:
            recs = metrics(tmp_path / lid)
            final = recs[-1]
            assert final["final"] and final["step"] == 24 and final["tokens"] == 24 * 8 * 32
            assert final["acked"] >= 6 and final["rejected"] == final["stale"]
            assert final["adoptions"] > 0 and all(v > 0 for v in final["versions"].values())
            assert recs[-2]["loss"] < recs[0]["loss"] - 0.3, f"{lid} must learn: {[r['loss'] for r in recs]}"
        wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge what is pending")
        learners = syncer.status()["learners"]
        assert all(learners[lid]["tokens_merged"] > 0 for lid in procs), learners
    finally:
        syncer.stop()
    with safe_open(str(tmp_path / "syncer" / "checkpoint" / "theta.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "hf.model.embed_tokens.weight" in names and "hf.lm_head.weight" not in names
    assert "hf.model.layers.1.self_attn.k_proj.weight" in names


@pytest.mark.parametrize("standby", [False, True], ids=["cold", "standby"])
def test_a_syncer_that_cannot_build_the_model_exits_2_naming_the_field_in_its_termination_message(tmp_path, standby):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"entrypoint": "nowhere_at_all:build"}}))
    message = tmp_path / "termination-log"
    message.touch()  # as the kubelet provides /dev/termination-log
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
           "--port", "0", "--state-dir", str(tmp_path / "syncer"), *(["--standby"] if standby else [])]
    done = subprocess.run(cmd, env=child_env(DILOCO_TERMINATION_LOG=str(message)), cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    expected = "diloco syncer: model.entrypoint 'nowhere_at_all:build': cannot import nowhere_at_all"
    assert expected in done.stdout and message.read_text().startswith(expected)
