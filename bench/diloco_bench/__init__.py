"""Benchmarks of Decoupled DiLoCo against DDP and synchronous DiLoCo, measured side by side (`diloco bench`)."""
