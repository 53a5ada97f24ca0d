"""Kubernetes operator for Decoupled DiLoCo jobs (kopf): CRDs, reconciliation, and a local test control plane."""
