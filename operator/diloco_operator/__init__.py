"""Kubernetes operator for Decoupled DiLoCo jobs (kopf): the API and CRDs (api/), pure decisions (plan/) and object
builders (objects/), the I/O shell (reconcile/), remote clusters (remote/); `diloco operator` (main.py)."""
