"""`helm` for the chart tests: the binary hack/build-helm.sh builds and caches (DILOCO_HELM wins when set), run with
its own config and cache folders so that a test never reads or writes the user's helm setup."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from cluster_kit import ROOT

CHART = ROOT / "charts" / "decoupled-diloco"
RELEASE = "decoupled-diloco"


def helm_binary() -> str:
    """DILOCO_HELM, else the cached build (hack/build-helm.sh builds it on the first call: a few minutes)."""
    if os.environ.get("DILOCO_HELM"):
        return os.environ["DILOCO_HELM"]
    # Its progress goes to stderr as it happens (shown with -s, and in the report of a failed test).
    out = subprocess.run(["bash", str(ROOT / "hack" / "build-helm.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise AssertionError(f"hack/build-helm.sh failed (exit {out.returncode}); its log is above")
    return out.stdout.strip().splitlines()[-1]


class Helm:
    """helm with private HELM_* homes; `kubeconfig` for the commands that reach a cluster."""

    def __init__(self, binary: str, home: Path, kubeconfig: str | None = None):
        self.binary = binary
        self.env = {**os.environ, **{f"HELM_{kind}_HOME": str(home / kind.lower())
                                     for kind in ("CACHE", "CONFIG", "DATA")}}
        if kubeconfig:
            self.env["KUBECONFIG"] = kubeconfig

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([self.binary, *args], env=self.env, capture_output=True, text=True, timeout=180)
        if check and out.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed: {out.stderr}")
        return out

    def render(self, *values: str, namespace: str = "diloco-system") -> list[dict]:
        """The chart's objects as `helm template` renders them with `values` (--set/--values arguments)."""
        out = self.run("template", RELEASE, str(CHART), "--namespace", namespace, *values)
        return [d for d in yaml.safe_load_all(out.stdout) if d]
