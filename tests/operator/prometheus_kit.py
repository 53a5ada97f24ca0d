"""A real Prometheus for the monitoring tests: Debian's binary (hack/prometheus.sh installs it once), run with a
config and data directory of the test's own on loopback, scraping static targets every second; queries go through
its HTTP API (/api/v1/query), as Grafana's do."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from cluster_kit import ROOT
from polling import stop, wait_for


def prometheus_binary() -> str:
    """DILOCO_PROMETHEUS, else /usr/bin/prometheus, installed from Debian's package when missing (root)."""
    out = subprocess.run(["bash", str(ROOT / "hack" / "prometheus.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise AssertionError(f"hack/prometheus.sh failed (exit {out.returncode}); its log is above")
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static(name: str, address: str) -> dict:
    """A scrape job of one plain-http target ("host:port", /metrics)."""
    return {"job_name": name, "static_configs": [{"targets": [address]}]}


def annotated_pods(name: str, pods: list[dict]) -> list[dict]:
    """Scrape jobs for the running `pods` that say prometheus.io/scrape "true", as the usual kubernetes-pods job's
    relabeling makes them: pod IP and prometheus.io/port, /path and /scheme (https unverified: a job's syncer
    certificate is its own CA's), the pod's labels as target labels (diloco.dev/job becomes diloco_dev_job) plus
    namespace and pod. Static targets read from the API: Debian's prometheus is built without Kubernetes discovery."""
    jobs: dict[tuple[str, str], dict] = {}
    for pod in pods:
        meta, ip = pod["metadata"], (pod.get("status") or {}).get("podIP")
        ann = meta.get("annotations") or {}
        if ann.get("prometheus.io/scrape") != "true" or not ip or meta.get("deletionTimestamp"):
            continue
        scheme, path = ann.get("prometheus.io/scheme", "http"), ann.get("prometheus.io/path", "/metrics")
        job = jobs.setdefault((scheme, path), {
            "job_name": f"{name}-{len(jobs)}", "scheme": scheme, "metrics_path": path,
            "tls_config": {"insecure_skip_verify": True}, "static_configs": []})
        labels = {re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in (meta.get("labels") or {}).items()}
        job["static_configs"].append({"targets": [f"{ip}:{ann['prometheus.io/port']}"],
                                      "labels": {**labels, "namespace": meta["namespace"], "pod": meta["name"]}})
    return list(jobs.values())


class Prometheus:
    """`prometheus` running `scrape_configs` (static() and annotated_pods() make them), scraping every second."""

    def __init__(self, binary: str, workdir: Path, scrape_configs: list[dict]):
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": scrape_configs}
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GOMAXPROCS": "1"})
        wait_for(self._ready, 60, "prometheus ready", 0.2)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc, timeout=20)
        self.proc = None

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def _get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (a query Prometheus refuses fails the test with its error)."""
        try:
            data = self._get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"prometheus refused {expr!r}: {e.read().decode()}") from e
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def targets(self) -> list[dict]:
        """The active targets: each one's labels (job, instance, ...) and health ("up", "down", "unknown")."""
        return self._get("/api/v1/targets")["activeTargets"]
