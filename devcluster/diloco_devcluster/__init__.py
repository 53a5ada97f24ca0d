"""The local Kubernetes control plane for tests and `diloco devcluster`: kwok's fake accelerator pools, optionally
a real kubelet node. Dev and test tooling only: no image ships it."""
