"""Decoupled DiLoCo trainer: learner units, the syncer, baselines and the local runtime."""

__version__ = "0.1.0"
