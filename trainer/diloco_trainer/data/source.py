"""The tokens a run trains on, whatever data.source says: a small corpus in memory (stdlib, folder, tokens) or
memory-mapped shards. Both give `sampler(...)`, `sample(split, n)`, `train_tokens` and `vocab_needed`."""

from __future__ import annotations

from pathlib import Path

from diloco_trainer.config import DataConfig, ModelConfig
from diloco_trainer.data.corpus import Corpus, load_corpus
from diloco_trainer.data.shards import TokenShards
from diloco_trainer.data.tokenizer import BYTES, check_vocab

# Tokens of each split copied for the unigram baseline and the final evaluation (bounded for shards).
SAMPLE_TOKENS = 4_000_000


def config_vocab(model: ModelConfig) -> int | None:
    """The model's vocabulary as far as the config says it without loading anything (None for a model directory)."""
    return None if model.kind == "path" else model.hf.vocab_size if model.hf is not None else model.vocab_size


def open_tokens(cfg: DataConfig, vocab_size: int | None, cache_dir: Path | None = None) -> Corpus | TokenShards:
    """The run's tokens; ValueError naming data.* and model.vocab_size when they do not fit the model (unchecked
    when vocab_size is None)."""
    tokens = TokenShards.open(cfg) if cfg.source == "shards" else load_corpus(cfg, cache_dir)
    if vocab_size is None:
        return tokens
    if isinstance(tokens, TokenShards):
        tokens.vocab_limit = vocab_size
        if tokens.vocab_needed is not None:
            check_vocab(tokens.vocab_needed, vocab_size, tokens.where)
    else:
        what = f"data.tokenizer {cfg.tokenizer!r}" if cfg.tokenizer != BYTES else f"data.source {cfg.source!r}"
        check_vocab(tokens.vocab_needed, vocab_size, what)
    return tokens
