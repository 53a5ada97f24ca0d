"""Tokenizers, corpora, memory-mapped token shards and per-learner samplers; `diloco data prepare` / `tokenizer`."""
