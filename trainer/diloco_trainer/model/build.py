"""The one model builder the learner, the syncer (Θ₀, on CPU) and the tools call: the built-in GPT, a transformers
causal LM (model.hf / model.path) or a user's module (model.entrypoint), all with forward(idx, targets) ->
(logits, loss). Also what fragments and merges need to know of any model: its tensors by bytes and its embeddings."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from diloco_trainer.config import ModelConfig
from diloco_trainer.model.gpt import GPT


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model of `cfg`; the same seed and config always give the same initial parameters (the syncer's Θ₀).
    A config that cannot be built raises a ValueError naming the field."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if cfg.kind == "gpt":
            return GPT(cfg)
        if cfg.kind == "entrypoint":
            return _from_entrypoint(cfg)
        from diloco_trainer.model import hf

        return hf.from_inline(cfg) if cfg.kind == "hf" else hf.from_directory(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def _from_entrypoint(cfg: ModelConfig) -> nn.Module:
    """build(vocab_size=, seq_len=, **model.options) from the user's module, checked against the contract."""
    module_name, _, attr = cfg.entrypoint.partition(":")
    where = f"model.entrypoint {cfg.entrypoint!r}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import {module_name}: {exc}") from exc
    build = getattr(module, attr, None)
    if not callable(build):
        raise ValueError(f"{where}: {module_name} has no callable {attr}")
    try:
        model = build(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, **(cfg.options or {}))
    except TypeError as exc:
        raise ValueError(f"{where}: calling it with vocab_size, seq_len and model.options failed: {exc}") from exc
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        raise ValueError(f"{where} must return a torch.nn.Module with parameters, got {type(model).__name__}")
    _check_interface(model, cfg, where)
    return model


def _check_interface(model: nn.Module, cfg: ModelConfig, where: str) -> None:
    """One forward on a short sequence: (logits [B, T, vocab_size], scalar loss) is what the loop relies on."""
    t = min(8, cfg.seq_len)
    idx = torch.zeros(1, t, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(idx, idx)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{where}: forward(idx, targets) must return (logits of shape (B, T, vocab_size), a scalar "
                         f"loss); for idx of shape (1, {t}) it raised {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    ok = isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)
    if not ok or tuple(out[0].shape) != (1, t, cfg.vocab_size) or out[1].dim() != 0:
        got = tuple(getattr(o, "shape", type(o).__name__) for o in out) if isinstance(out, tuple) else type(out)
        raise ValueError(f"{where}: forward(idx, targets) must return (logits of shape (B, T, vocab_size), "
                         f"a scalar loss); for idx of shape (1, {t}) it returned {got}")


def vocab_size_of(model: nn.Module, cfg: ModelConfig) -> int:
    """Token ids the model embeds: from its transformers config for model.hf / model.path, else model.vocab_size."""
    return int(getattr(model, "vocab_size", cfg.vocab_size)) if cfg.kind in ("hf", "path") else cfg.vocab_size


def tensor_bytes(model: nn.Module) -> list[tuple[str, int]]:
    """(name, bytes) of every parameter tensor in the model's order; a tied tensor appears once, under its first name
    (what Θ, fragments and checkpoints hold)."""
    return [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]


def embedding_names(model: nn.Module) -> set[str]:
    """Parameters merged by weighted mean instead of RDA (the paper treats embeddings apart): the weights of every
    nn.Embedding and of the model's input embeddings (transformers' get_input_embeddings), under their Θ names."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for m in model.modules():
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            try:
                emb = get()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(emb, nn.Module):
                modules.append(emb)
    return {name_of[id(m.weight)] for m in modules if id(getattr(m, "weight", None)) in name_of}


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model, a tied tensor counted once."""
    return sum(p.numel() for p in model.parameters())
