"""Decoupled DiLoCo trainer: the learner (learner/), the syncer (syncer/), the contracts between them (protocol/),
models (model/), data (data/), the baselines (baselines/), the local runtime (runtime/) and the `diloco` command."""

__version__ = "0.1.0"
