"""One learner unit: the training loop, its outer-step bookkeeping, its devices and its link to the syncer."""
