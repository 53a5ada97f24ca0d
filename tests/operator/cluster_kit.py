"""Helpers shared by the operator tests: kubectl against the test control plane (waiting: tests/polling.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.parse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
PYTHONPATH = os.pathsep.join(str(ROOT / p) for p in ("trainer", "operator", "chaos", "kube"))


# kind (as the tests name it) -> API path prefix; reads go straight to the API (polling through a kubectl
# process per read would cost more CPU than the control plane itself on a 2-core machine).
PATHS = {
    "dj": "/apis/diloco.dev/v1alpha1", "dilocojob": "/apis/diloco.dev/v1alpha1",
    "lu": "/apis/diloco.dev/v1alpha1", "learnerunits": "/apis/diloco.dev/v1alpha1",
    "deployment": "/apis/apps/v1", "deployments": "/apis/apps/v1",
    "networkpolicies": "/apis/networking.k8s.io/v1",
}
PLURALS = {"dj": "dilocojobs", "dilocojob": "dilocojobs", "lu": "learnerunits", "node": "nodes", "pod": "pods",
           "secret": "secrets", "configmap": "configmaps", "pvc": "persistentvolumeclaims",
           "deployment": "deployments", "serviceaccount": "serviceaccounts"}
CLUSTER_SCOPED = {"nodes", "namespaces"}


class Kubectl:
    """kubectl against the test control plane (reads through the API directly)."""

    def __init__(self, testbed):
        self.testbed = testbed
        self.env = {**os.environ, "KUBECONFIG": testbed.kubeconfig}

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([KUBECTL, *args], input=input, env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out

    def get(self, kind: str, name: str | None = None, ns: str | None = None, selector: str | None = None):
        """One object (None if absent) or the list of objects, like `kubectl get -o json`."""
        plural = PLURALS.get(kind, kind)
        path = PATHS.get(kind, "/api/v1")
        if ns and plural not in CLUSTER_SCOPED:
            path += f"/namespaces/{ns}"
        path += f"/{plural}" + (f"/{name}" if name else "")
        if selector:
            path += "?labelSelector=" + urllib.parse.quote(selector)
        try:
            obj = self.testbed.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and name:
                return None
            raise
        return obj["items"] if name is None else obj

    def apply(self, obj: dict | str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        return self.run("apply", "-f", "-", *extra, input=text, check=check)
