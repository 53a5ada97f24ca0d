"""Helpers shared by the operator tests: kubectl against the test control plane, polling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
PYTHONPATH = os.pathsep.join(str(ROOT / p) for p in ("trainer", "operator", "chaos"))


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() returns something truthy; return it, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class Kubectl:
    """kubectl against the test control plane."""

    def __init__(self, kubeconfig: str):
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([KUBECTL, *args], input=input, env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out

    def get(self, kind: str, name: str | None = None, ns: str | None = None, selector: str | None = None):
        args = ["get", kind] + ([name] if name else []) + ["-o", "json"]
        if ns:
            args += ["-n", ns]
        if selector:
            args += ["-l", selector]
        out = self.run(*args, check=False)
        if out.returncode:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(out.stderr)
        obj = json.loads(out.stdout)
        return obj["items"] if name is None else obj

    def apply(self, obj: dict | str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        return self.run("apply", "-f", "-", *extra, input=text, check=check)
