"""Tokenizers, corpora and per-learner data shards."""
