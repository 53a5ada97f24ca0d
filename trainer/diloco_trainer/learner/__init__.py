"""One learner unit (`diloco learner`): the training loop and inner step, its outer-step bookkeeping, devices,
snapshots and resume, and its link to the syncer (one client per syncer shard)."""
