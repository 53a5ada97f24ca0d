"""Kubernetes access shared by the operator, chaos and the dev cluster: the API client and the label keys."""
