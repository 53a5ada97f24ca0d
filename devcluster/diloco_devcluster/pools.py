"""Fake accelerator node pools for the local control plane: Node objects that kwok keeps alive.

Labels and taints follow what GKE puts on real GPU/TPU pools, so placement is tested as in production.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco_kube.labels import KWOK_ANNOTATION, POOL_LABEL


@dataclass(frozen=True)
class NodePool:
    """A group of identical fake nodes."""

    name: str
    nodes: int
    capacity: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()


DEFAULT_POOLS: tuple[NodePool, ...] = (
    NodePool(
        "gpu-h100", 2,
        {"cpu": "208", "memory": "1872Gi", "nvidia.com/gpu": "8", "pods": "110"},
        {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "nvidia.com/gpu.present": "true"},
        ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
    ),
    NodePool(
        "gpu-l4", 2,
        {"cpu": "96", "memory": "384Gi", "nvidia.com/gpu": "8", "pods": "110"},
        {"cloud.google.com/gke-accelerator": "nvidia-l4", "nvidia.com/gpu.present": "true"},
        ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
    ),
    NodePool(
        "tpu-v5p", 4,
        {"cpu": "208", "memory": "448Gi", "google.com/tpu": "4", "pods": "110"},
        {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x2"},
        ({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"},),
    ),
    NodePool("cpu", 2, {"cpu": "16", "memory": "64Gi", "pods": "110"}),
)


def node_objects(pools: tuple[NodePool, ...] = DEFAULT_POOLS) -> list[dict]:
    """Node manifests (with status capacity) for every node of every pool; kwok manages them by annotation."""
    out = []
    for pool in pools:
        for i in range(pool.nodes):
            name = f"{pool.name}-{i}"
            out.append({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                        "type": "kwok", POOL_LABEL: pool.name, **pool.labels,
                    },
                },
                "spec": {"taints": [dict(t) for t in pool.taints]},
                "status": {"capacity": dict(pool.capacity), "allocatable": dict(pool.capacity)},
            })
    return out
