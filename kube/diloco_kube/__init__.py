"""Kubernetes access shared by the operator, chaos and the dev cluster: the API client, the label keys, and a pod's
phase as the kubelet will report it."""
