"""`diloco export --format hf` (issue 18): a syncer checkpoint becomes a directory transformers loads, whose logits
equal the trainer's forward (fp32, max abs diff <= 1e-5): an inline Llama with tied embeddings and a BPE tokenizer,
the built-in GPT mapped onto GPT-2, and a sharded syncer's global model from every shard's state dir."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from diloco_trainer.cli import main as diloco
from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.model.build import build_model
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.syncer.store import write_checkpoint

LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 64, "tie_word_embeddings": True}


def _trained_checkpoint(state_dir, cfg: TrainConfig, shard: int = 0) -> dict[str, torch.Tensor]:
    """A syncer's checkpoint whose Θ moved away from Θ₀ (every tensor, norms included, so a mapping mistake shows)."""
    state = SyncerState(cfg, state_dir, shard=shard)
    g = torch.Generator().manual_seed(100 + shard)
    state.theta = {n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in state.theta.items()}
    write_checkpoint(state_dir, state.checkpoint_job().checkpoint)
    return dict(state.theta)


def _trainer_logits(cfg: TrainConfig, theta: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model, cfg.seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(theta[n])
        return model.eval()(idx)[0]


def _max_diff(out, cfg: TrainConfig, theta, vocab: int) -> float:
    idx = torch.randint(0, vocab, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(7))
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    with torch.no_grad():
        theirs = loaded.eval()(input_ids=idx).logits
    return float((theirs - _trainer_logits(cfg, theta, idx)).abs().max())


def _bpe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog"] * 50 + ["decoupled diloco trains on many learners"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_an_inline_llama_exports_with_its_tokenizer_and_transformers_gives_the_trainers_logits(tmp_path, capsys):
    cfg = TrainConfig.model_validate({"model": {"hf": LLAMA, "seq_len": 32}, "outer": {"fragments": 4}, "seed": 4})
    theta = _trained_checkpoint(tmp_path / "syncer", cfg)
    out = tmp_path / "export"
    assert diloco(["export", str(tmp_path / "syncer"), "--format", "hf", str(out),
                   "--tokenizer", str(_bpe(tmp_path))]) == 0
    assert "LlamaForCausalLM and its tokenizer" in capsys.readouterr().out
    assert _max_diff(out, cfg, theta, 300) <= 1e-5
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(), "the head stays tied"
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.decode(tok("the lazy fox")["input_ids"]).strip() == "the lazy fox"


def test_the_built_in_gpt_exports_as_gpt2_with_the_same_logits(tmp_path):
    cfg = TrainConfig(model=MODEL_PRESETS["tiny"].model_copy(), seed=2)
    theta = _trained_checkpoint(tmp_path / "syncer", cfg)
    out = tmp_path / "export"
    assert diloco(["export", str(tmp_path / "syncer" / "checkpoint"), str(out)]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "gpt2"
    assert _max_diff(out, cfg, theta, 256) <= 1e-5


def test_a_sharded_syncers_model_needs_every_shards_state_dir(tmp_path, capsys):
    cfg = TrainConfig.model_validate({"model": MODEL_PRESETS["tiny"].model_dump(), "outer": {"fragments": 4},
                                      "syncer": {"shards": 2}})
    theta = _trained_checkpoint(tmp_path / "s0", cfg, 0) | _trained_checkpoint(tmp_path / "s1", cfg, 1)
    assert diloco(["export", str(tmp_path / "s0"), str(tmp_path / "half")]) == 2
    assert "for a sharded syncer give every shard's state dir" in capsys.readouterr().out
    assert diloco(["export", str(tmp_path / "s0"), str(tmp_path / "s1"), str(tmp_path / "whole")]) == 0
    assert _max_diff(tmp_path / "whole", cfg, theta, 256) <= 1e-5
    assert diloco(["export", str(tmp_path / "nothing-here"), str(tmp_path / "x")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().out


def test_a_state_dir_whose_latest_checkpoint_is_damaged_exports_the_previous_one(tmp_path, capsys):
    from diloco_trainer.model.export import read_global_theta
    from diloco_trainer.syncer.store import read_checkpoint

    cfg = TrainConfig(model=MODEL_PRESETS["tiny"].model_copy(), seed=3)
    _trained_checkpoint(tmp_path / "syncer", cfg)
    first = read_checkpoint(tmp_path / "syncer").theta
    _trained_checkpoint(tmp_path / "syncer", cfg)  # the second write keeps the first as checkpoint.old/
    latest = tmp_path / "syncer" / "checkpoint" / "theta.safetensors"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    theta, _ = read_global_theta([tmp_path / "syncer"])
    assert all(torch.equal(theta[n], first[n]) for n in first)
    assert "passed over a damaged checkpoint" in capsys.readouterr().out


def test_a_checkpoint_naming_an_entrypoint_model_is_refused_before_its_module_is_imported(tmp_path, capsys,
                                                                                         monkeypatch):
    """Issue 38 (10): a checkpoint's state.json is data; an untrusted one naming model.entrypoint must not make the
    exporter import the module it names (which would run its code) before refusing the model kind."""
    import json
    import sys

    from safetensors.torch import save_file

    marker = tmp_path / "imported.marker"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hostile_entry_38.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "def build(vocab_size, seq_len):\n    raise RuntimeError('never built')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.delitem(sys.modules, "hostile_entry_38", raising=False)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.zeros(2)}, str(ckpt / "theta.safetensors"))
    cfg = TrainConfig.model_validate({"model": {"entrypoint": "hostile_entry_38:build", "vocab_size": 64,
                                                "seq_len": 16}})
    (ckpt / "state.json").write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
    assert diloco(["export", str(ckpt), str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert "model.entrypoint" in out and "hostile_entry_38:build" in out and "not imported" in out
    assert not marker.exists()
    assert "hostile_entry_38" not in sys.modules
    assert not (tmp_path / "out").exists()
