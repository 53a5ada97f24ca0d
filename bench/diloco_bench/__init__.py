"""Benchmarks (`diloco bench`): Decoupled DiLoCo against DDP and synchronous DiLoCo measured side by side, and its
resilience, syncer, WAN and overhead figures; operator scale and harsh failures as their own modules."""
