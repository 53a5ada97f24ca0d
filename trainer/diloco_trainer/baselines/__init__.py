"""The baselines Decoupled DiLoCo is measured against: DDP and synchronous DiLoCo."""
