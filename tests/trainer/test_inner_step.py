"""The inner step: micro-batches equal the full batch, bf16 autocast over fp32 weights, AdamW groups for any model,
and a two-process unit (DDP or FSDP2 over gloo, real processes) whose ranks agree after steps and an adoption."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from torch import nn

from diloco_trainer.config import MODEL_PRESETS, InnerConfig, TrainConfig
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.learner.inner_step import InnerStep, shard_units
from diloco_trainer.model.build import build_model
from diloco_trainer.model.optimizer import decay_groups

from learner_kit import ROOT, child_env, free_port

CPU = torch.device("cpu")


def _batch(seed: int, batch: int = 8, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def _step(**inner) -> tuple[InnerStep, float]:
    cfg = TrainConfig(model=MODEL_PRESETS["tiny"], inner={"batch_size": 8, "grad_clip": 1e9, **inner})
    step = InnerStep(build_model(cfg.model, 0), cfg, CPU, UnitGroup())
    return step, step.step(*_batch(1), lr=0.0)  # lr 0: the gradients stay to compare, the weights do not move


def test_micro_batches_give_the_full_batch_gradient_and_loss():
    whole, loss_whole = _step(micro_batches=1)
    parts, loss_parts = _step(micro_batches=4)
    assert loss_parts == pytest.approx(loss_whole, rel=1e-5)
    for (name, a), b in zip(whole.model.named_parameters(), parts.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(ValidationError, match="inner.micro_batches"):
        InnerConfig(batch_size=8, micro_batches=3)
    with pytest.raises(ValidationError, match="precision"):
        InnerConfig(precision="fp16")


def test_bf16_computes_in_bf16_while_weights_gradients_and_loss_stay_fp32():
    dtypes = []
    fp32, loss32 = _step()
    bf16 = InnerStep(build_model(MODEL_PRESETS["tiny"], 0), TrainConfig(model=MODEL_PRESETS["tiny"],
                     inner={"batch_size": 8, "precision": "bf16"}), CPU, UnitGroup())
    bf16.model.blocks[0].attn.qkv.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    loss16 = bf16.step(*_batch(1), lr=0.0)
    assert dtypes == [torch.bfloat16], "the matmuls must run in bf16 under autocast"
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    assert loss16 == pytest.approx(loss32, abs=0.05) and loss16 != loss32


def test_adamw_decays_matrices_but_not_embeddings_norms_or_biases_of_any_model():
    decayed, plain = decay_groups(build_model(MODEL_PRESETS["tiny"], 0))
    assert {p.dim() for p in plain} == {1, 2} and all(p.dim() == 2 for p in decayed)
    assert sum(p.dim() == 2 for p in plain) == 2, "token and position embeddings (the head is tied to the first)"

    class Other(nn.Module):  # names nothing like the GPT's; an embedding tied to a head, an RMSNorm
        def __init__(self):
            super().__init__()
            self.wte, self.mix, self.norm = nn.Embedding(10, 4), nn.Linear(4, 4), nn.RMSNorm(4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.wte.weight

    model = Other()
    decayed, plain = decay_groups(model)
    assert [id(p) for p in decayed] == [id(model.mix.weight)]
    assert {id(p) for p in plain} == {id(model.wte.weight), id(model.mix.bias), id(model.norm.weight)}


def test_a_transformers_model_with_tied_embeddings_gets_its_groups_and_micro_batched_bf16_steps():
    from diloco_trainer.config import ModelConfig

    cfg = TrainConfig(model=ModelConfig.model_validate({"seq_len": 32, "hf": {
        "model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
        "tie_word_embeddings": True}}), inner={"batch_size": 4, "micro_batches": 2, "precision": "bf16"})
    model = build_model(cfg.model, 0)
    decayed, plain = decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(decayed) + len(plain) == len(names), "every tensor once, the tied head too"
    assert [names[id(p)] for p in plain if p.dim() == 2] == [n for n in names.values() if "embed_tokens" in n]
    assert all(p.dim() == 2 and "proj" in names[id(p)] for p in decayed)
    assert len(shard_units(model)) == 2, "FSDP2 shards each decoder layer"
    step = InnerStep(model, cfg, CPU, UnitGroup())
    x = torch.randint(0, 300, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = [step.step(x[:, :-1], x[:, 1:], 3e-3) for _ in range(4)]
    assert losses[-1] < losses[0] and all(p.dtype == torch.float32 for p in model.parameters())


def test_fsdp_shards_the_blocks_of_a_module_list_apart_from_the_root():
    model = build_model(MODEL_PRESETS["tiny"], 0)
    assert shard_units(model) == list(model.blocks)


def _run_unit(out: Path, inner: dict) -> dict:
    port = free_port()
    procs = []
    out.mkdir(parents=True)
    for rank in (0, 1):
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env["PYTHONPATH"] += f":{ROOT / 'tests' / 'trainer'}"
        log = open(out / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/trainer/unit_worker.py"), str(out),
                                       json.dumps(inner)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=300) == 0, (out / f"rank{rank}.log").read_text()[-3000:]
    return {f"{kind}{r}": load_file(str(out / f"{kind}-rank{r}.safetensors")) for kind in ("adopted", "params")
            for r in (0, 1)} | {f"losses{r}": json.loads((out / f"losses-rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.slow
def test_a_two_process_unit_agrees_after_steps_and_an_adoption_under_ddp_and_under_fsdp2(tmp_path):
    from unit_worker import ADOPTED, adopted_value

    inner = {"micro_batches": 2, "precision": "fp32"}
    ddp = _run_unit(tmp_path / "ddp", inner | {"parallel": "ddp"})
    fsdp = _run_unit(tmp_path / "fsdp", inner | {"parallel": "fsdp"})
    for run in (ddp, fsdp):
        for r in (0, 1):  # rank 0 wrote the adopted values; every rank holds them (each FSDP2 rank its slice)
            for n in ADOPTED:
                assert torch.equal(run[f"adopted{r}"][n], adopted_value(run[f"adopted{r}"][n].shape, n)), (r, n)
        assert all(torch.equal(run["params0"][n], run["params1"][n]) for n in run["params0"])
        assert run["losses0"] == run["losses1"], "the loss reported is the unit's mean"
    # Each rank trained on its own batches: only averaged gradients keep the replicas equal, and sharding must
    # compute the same steps as replication.
    for n, p in ddp["params0"].items():
        assert torch.allclose(p, fsdp["params0"][n], atol=1e-5), n
    assert ddp["losses0"] == pytest.approx(fsdp["losses0"], rel=1e-4)


@pytest.mark.slow
def test_a_two_process_fsdp2_unit_in_bf16_trains_against_a_real_syncer_and_adopts_its_versions(tmp_path):
    import yaml
    from safetensors import safe_open

    from learner_kit import SyncerProcess, finish, metrics, start_learner

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny", "data": {"max_bytes": 200_000},
        "inner": {"batch_size": 8, "warmup_steps": 5, "micro_batches": 2, "precision": "bf16", "parallel": "fsdp"},
        "outer": {"fragments": 4, "sync_every": 8, "compression": "int4"}}))
    syncer = SyncerProcess(config, tmp_path / "syncer", tmp_path / "syncer.log")
    state, dump, port = tmp_path / "u0", tmp_path / "params", free_port()
    try:
        syncer.start()
        procs = [start_learner(syncer.url, "u0", state, 32, "--save-params", str(dump), log_path=tmp_path / f"r{r}.log",
                               env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                                             RANK=str(r)))
                 for r in (0, 1)]
        for r, proc in enumerate(procs):
            finish(proc, tmp_path / f"r{r}.log")
    finally:
        syncer.stop()
    recs = metrics(state)
    final = recs[-1]
    assert final["world_size"] == 2 and final["acked"] > 0 and final["adoptions"] > 0 and final["rejected"] == 0
    assert recs[-2]["loss"] < recs[0]["loss"] - 0.3, "training must reduce the loss"
    rank0, rank1 = (load_file(str(dump / f"params-rank{r}.safetensors")) for r in (0, 1))
    assert all(t.dtype == torch.float32 for t in rank0.values()), "fp32 master weights under bf16 autocast"
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    meta = [safe_open(str(dump / f"params-rank{r}.safetensors"), "pt").metadata() for r in (0, 1)]
    assert meta[0]["versions"] == meta[1]["versions"] == json.dumps(final["versions"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_compiled_inner_step_trains():
    """torch.compile (inductor) on CPU: ~40 s with a warm inductor cache, up to ~5 min cold on a busy 2-core box."""
    from torch._dynamo.utils import counters

    from diloco_trainer.config import ModelConfig

    model = ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2, mlp_ratio=2, vocab_size=64)
    cfg = TrainConfig(model=model, inner={"batch_size": 4, "compile": True, "warmup_steps": 0})
    step = InnerStep(build_model(model, 0), cfg, CPU, UnitGroup())
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = [step.step(x[:, :-1], x[:, 1:], 3e-3) for _ in range(6)]
    assert counters["stats"]["unique_graphs"] >= 1, "the forward must have gone through dynamo"
    assert losses[-1] < losses[0] - 0.1


def _fsdp_unit(syncer_url: str, state: Path, steps: int, logs: Path, *args: str) -> None:
    from learner_kit import finish, start_learner

    port = free_port()
    procs = [start_learner(syncer_url, "u0", state, steps, *args, log_path=logs / f"r{r}.log",
                           env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r)))
             for r in (0, 1)]
    for r, proc in enumerate(procs):
        finish(proc, logs / f"r{r}.log")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_restarted_fsdp2_unit_resumes_its_gathered_adamw_state_instead_of_starting_afresh(tmp_path):
    import yaml

    from diloco_trainer.learner import inner_state
    from learner_kit import SyncerProcess, metrics

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny", "data": {"max_bytes": 200_000},
        "inner": {"batch_size": 8, "warmup_steps": 5, "parallel": "fsdp", "beta2": 0.95},
        "outer": {"fragments": 4, "sync_every": 8, "compression": "int4"}}))
    syncer = SyncerProcess(config, tmp_path / "syncer", tmp_path / "syncer.log")
    state, first_logs, second_logs = tmp_path / "u0", tmp_path / "first", tmp_path / "second"
    first_logs.mkdir()
    second_logs.mkdir()
    try:
        syncer.start()
        _fsdp_unit(syncer.url, state, 20, first_logs)
        saved = load_file(str(state / inner_state.FILE))  # written at exit: AdamW gathered from both ranks' shards
        lr = metrics(state)[-1]["lr"]
        first = len(metrics(state))
        _fsdp_unit(syncer.url, state, 1, second_logs, "--log-every", "1", "--restore-inner-state")
        after = load_file(str(state / inner_state.FILE))
    finally:
        syncer.stop()
    decayed, plain = decay_groups(build_model(MODEL_PRESETS["tiny"], 0))
    shapes = [p.shape for p in decayed + plain]  # the optimizer's order: full shapes, not a rank's shard
    moments = {k: t for k, t in saved.items() if k.startswith("opt.") and not k.endswith(".step")}
    assert len(moments) == 2 * len(shapes) and all(saved[f"opt.{i}.exp_avg"].shape == s for i, s in enumerate(shapes))
    assert all(float(t) == 20 for k, t in saved.items() if k.endswith(".step"))
    assert "resumed AdamW and error feedback after 20 steps" in (second_logs / "r0.log").read_text()
    assert metrics(state)[first]["lr"] == pytest.approx(lr), "no second warm-up: the schedule continues at step 21"
    # One more AdamW step on the restored moments: step 21, and v21 = β2·v20 + (1 − β2)·g² ≥ β2·v20 everywhere (fresh
    # moments would hold (1 − β2)·g² only: far below β2·v20 for nearly every value).
    assert all(float(after[k]) == 21 for k in saved if k.endswith(".step"))
    for k, v20 in saved.items():
        if k.endswith(".exp_avg_sq"):
            assert torch.all(after[k] >= 0.95 * v20 * (1 - 1e-5)), k
            assert not torch.equal(after[k], v20), f"{k}: the restarted unit stepped"


@pytest.mark.slow
def test_an_fsdp2_units_adamw_state_saved_and_restored_into_a_fresh_unit_is_identical_on_every_rank(tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        log = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/trainer/fsdp_state_worker.py"), str(tmp_path)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=300) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    saved = load_file(str(tmp_path / "saved-rank0.safetensors"))
    decayed, plain = decay_groups(build_model(MODEL_PRESETS["tiny"], 0))
    assert len(saved) == 3 * len(decayed + plain) and all(float(t) == 3 for k, t in saved.items() if k.endswith(".step"))
    for i, p in enumerate(decayed + plain):  # full tensors, not a rank's shard, and trained (not zero)
        assert saved[f"opt.{i}.exp_avg_sq"].shape == p.shape and saved[f"opt.{i}.exp_avg_sq"].abs().sum() > 0
    for r in (0, 1):
        restored = load_file(str(tmp_path / f"restored-rank{r}.safetensors"))
        assert restored.keys() == saved.keys()
        assert all(torch.equal(restored[k], saved[k]) for k in saved), f"rank {r} restored other values"
