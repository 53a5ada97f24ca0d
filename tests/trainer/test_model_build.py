"""One builder for every model kind (issue 18): the built-in GPT, transformers causal LMs from an inline config or a
local directory, and a user's entrypoint, all with forward(idx, targets) -> (logits, loss), deterministic from the
seed, with a tied embedding held (and fragmented) as one tensor."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from diloco_trainer.config import MODEL_PRESETS, ModelConfig, OuterConfig, TrainConfig, tensor_count
from diloco_trainer.model.build import build_model, embedding_names, tensor_bytes, vocab_size_of
from diloco_trainer.protocol.fragments import fragment_sizes, plan_fragments

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64}
QWEN2_TIED = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 64, "tie_word_embeddings": True}


def _llama(**extra) -> ModelConfig:
    return ModelConfig.model_validate({"hf": {**LLAMA, **extra}, "seq_len": 32})


def _tokens(vocab: int, b: int = 2, t: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_a_llama_style_inline_config_builds_rope_rmsnorm_swiglu_and_grouped_query_attention():
    cfg = _llama()
    model = build_model(cfg, seed=3)
    hf = model.hf
    assert type(hf).__name__ == "LlamaForCausalLM"
    layer = hf.model.layers[0]
    assert type(layer.input_layernorm).__name__ == "LlamaRMSNorm"
    assert hf.config.hidden_act == "silu" and {"gate_proj", "up_proj", "down_proj"} <= set(dict(layer.mlp.named_children()))
    head_dim = 48 // 4
    assert layer.self_attn.q_proj.weight.shape == (4 * head_dim, 48)
    assert layer.self_attn.k_proj.weight.shape == (2 * head_dim, 48)  # grouped-query: 2 key/value heads for 4
    assert hasattr(hf.model, "rotary_emb") and not any("position" in n for n, _ in model.named_parameters())
    x, y = _tokens(320)
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 320)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 320), y.reshape(-1)))
    assert vocab_size_of(model, cfg) == 320
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_same_seed_gives_the_same_initial_parameters_and_another_seed_others():
    a, b, c = build_model(_llama(), seed=5), build_model(_llama(), seed=5), build_model(_llama(), seed=6)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["hf.model.layers.0.self_attn.q_proj.weight"], pc["hf.model.layers.0.self_attn.q_proj.weight"])


def test_a_tied_embedding_is_one_tensor_fragmented_once_and_stays_tied_after_adoption():
    cfg = ModelConfig.model_validate({"hf": QWEN2_TIED, "seq_len": 32})
    model = build_model(cfg, seed=0)
    names = [n for n, _ in tensor_bytes(model)]
    assert "hf.model.embed_tokens.weight" in names and "hf.lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert "hf.model.embed_tokens.weight" in embedding_names(model)
    # Adoption writes Θ into the parameters in place (outer_sync.py): the output head follows.
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["hf.model.embed_tokens.weight"].copy_(torch.randn(300, 32))
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert torch.equal(model.hf.lm_head.weight, params["hf.model.embed_tokens.weight"])


def test_fragments_balance_bytes_over_any_model_with_tied_weights_counted_once():
    model = build_model(ModelConfig.model_validate({"hf": QWEN2_TIED, "seq_len": 32}), seed=0)
    sizes = tensor_bytes(model)
    assert sum(b for _, b in sizes) == 4 * sum(p.numel() for p in model.parameters())
    plan = plan_fragments(sizes, 4)
    loads = fragment_sizes(plan, sizes)
    assert sorted(n for frag in plan for n in frag) == sorted(n for n, _ in sizes)
    # The embedding (300x32 fp32) is the largest tensor: no fragment may exceed it plus the smallest others.
    assert max(loads) <= max(b for _, b in sizes) + sum(sorted(b for _, b in sizes)[: len(sizes) // 4])
    assert max(loads) < sum(loads)  # and nothing puts everything in one fragment


def test_the_built_in_gpt_and_its_presets_build_as_before():
    for name, cfg in MODEL_PRESETS.items():
        if name in ("tiny", "small"):
            model = build_model(cfg, seed=0)
            assert len(tensor_bytes(model)) == tensor_count(cfg)
            assert embedding_names(model) == {"tok_emb.weight", "pos_emb.weight"}
    assert TrainConfig.model_validate({"model": MODEL_PRESETS["tiny"].model_dump()}).model.kind == "gpt"


def test_a_local_directory_continues_from_its_saved_weights(tmp_path):
    saved = build_model(_llama(), seed=11)
    saved.hf.save_pretrained(tmp_path / "ckpt")
    cfg = ModelConfig.model_validate({"path": str(tmp_path / "ckpt"), "seq_len": 32})
    loaded = build_model(cfg, seed=0)  # the seed does not matter: the weights come from the directory
    a, b = dict(saved.named_parameters()), dict(loaded.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert vocab_size_of(loaded, cfg) == 320 and loaded.training


def test_bad_model_configs_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"model\.hf\.hiden_size is not a field of LlamaConfig"):
        build_model(_llama(hiden_size=64))
    with pytest.raises(ValueError, match=r"model\.hf\.model_type 'lama' is not a model type"):
        build_model(ModelConfig.model_validate({"hf": {**LLAMA, "model_type": "lama"}, "seq_len": 32}))
    with pytest.raises(ValueError, match=r"model\.hf\.model_type 't5' has no causal language model"):
        build_model(ModelConfig.model_validate({"hf": {"model_type": "t5", "vocab_size": 100, "d_model": 32}}))
    with pytest.raises(ValueError, match=r"model\.path '.*' has no config\.json"):
        build_model(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"model\.seq_len \(128\) must not exceed model\.hf\.max_position"):
        ModelConfig.model_validate({"hf": LLAMA, "seq_len": 128})
    with pytest.raises(ValueError, match=r"model\.d_model applies to the built-in GPT only"):
        ModelConfig.model_validate({"hf": LLAMA, "d_model": 64})
    with pytest.raises(ValueError, match=r"model\.vocab_size applies to the built-in GPT only.*model\.hf\.vocab_size"):
        ModelConfig.model_validate({"hf": LLAMA, "vocab_size": 64})
    with pytest.raises(ValueError, match=r"model\.hf\.num_attention_heads \(4\) must be a multiple of "
                                         r"model\.hf\.num_key_value_heads \(3\)"):
        ModelConfig.model_validate({"hf": {**LLAMA, "num_key_value_heads": 3}})
    with pytest.raises(ValueError, match=r"model\.hf and model\.entrypoint exclude each other"):
        ModelConfig.model_validate({"hf": LLAMA, "entrypoint": "a.b:c"})


def test_a_non_gpt_config_round_trips_and_leaves_the_fragment_count_to_the_syncer():
    cfg = TrainConfig.model_validate({"model": {"hf": LLAMA, "seq_len": 32}, "outer": {"fragments": 500}})
    dumped = cfg.model_dump(mode="json")
    assert "d_model" not in dumped["model"] and "vocab_size" not in dumped["model"]
    assert TrainConfig.model_validate(dumped) == cfg
    assert tensor_count(cfg.model) is None
    gpt = TrainConfig().model_dump(mode="json")["model"]
    assert set(gpt) == {"vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio", "dropout"}
    with pytest.raises(ValueError, match=r"outer\.fragments \(21\) must not exceed"):
        TrainConfig(model=MODEL_PRESETS["tiny"], outer=OuterConfig(fragments=21))


USER_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size, width):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, idx, targets=None):
        logits = self.out(self.emb(idx))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def build(vocab_size, seq_len, width=16):
    return Bigram(vocab_size, width)


def build_wrong(vocab_size, seq_len):
    return nn.Linear(4, 4)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)


def test_a_users_entrypoint_builds_with_its_options_and_seed(user_module):
    cfg = ModelConfig.model_validate({"entrypoint": f"{user_module}:build", "vocab_size": 50, "seq_len": 16,
                                      "options": {"width": 24}})
    a, b = build_model(cfg, seed=2), build_model(cfg, seed=2)
    assert a.emb.weight.shape == (50, 24) and torch.equal(a.emb.weight, b.emb.weight)
    assert embedding_names(a) == {"emb.weight"}
    x, y = _tokens(50)
    logits, loss = a(x, y)
    assert logits.shape == (2, 16, 50) and loss.dim() == 0


def test_an_entrypoint_that_breaks_the_contract_is_refused_naming_model_entrypoint(user_module):
    with pytest.raises(ValueError, match=r"model\.entrypoint 'my_models:build_wrong': forward\(idx, targets\) must"):
        build_model(ModelConfig(entrypoint=f"{user_module}:build_wrong"))
    with pytest.raises(ValueError, match=r"model\.entrypoint 'my_models:missing': my_models has no callable missing"):
        build_model(ModelConfig(entrypoint=f"{user_module}:missing"))
    with pytest.raises(ValueError, match=r"model\.entrypoint 'nowhere_at_all:build': cannot import"):
        build_model(ModelConfig(entrypoint="nowhere_at_all:build"))
    with pytest.raises(ValueError, match=r"calling it with vocab_size, seq_len and model\.options failed"):
        build_model(ModelConfig(entrypoint=f"{user_module}:build", options={"depth": 3}))


def test_a_syncer_whose_model_has_fewer_tensors_than_fragments_refuses_to_start_naming_outer_fragments(tmp_path):
    from diloco_trainer.syncer.state import SyncerState

    model = {"hf": QWEN2_TIED, "seq_len": 32}
    tensors = len(tensor_bytes(build_model(ModelConfig.model_validate(model))))  # the tied head counted once
    cfg = TrainConfig.model_validate({"model": model, "outer": {"fragments": tensors + 1}})
    with pytest.raises(ValueError, match=rf"outer\.fragments \({tensors + 1}\) must not exceed the model's "
                                         rf"{tensors} parameter tensors"):
        SyncerState(cfg, tmp_path / "syncer")
