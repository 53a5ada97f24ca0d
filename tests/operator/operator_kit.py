"""`diloco operator` as a subprocess for the cluster tests (the `operator` fixture and tests that run their own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from polling import stop, wait_for
from cluster_kit import PYTHONPATH, ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`diloco operator` as a subprocess, authenticated as the ServiceAccount from manifests/operator.yaml."""

    def __init__(self, kubeconfig: str, logdir: Path, args: tuple[str, ...] = ()):
        self.kubeconfig = kubeconfig
        # More `diloco operator` flags; by default it follows diloco.dev/syncer-url (the syncers the tests start
        # run on this machine, outside the cluster's Service network).
        self.args = args
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.metrics_port = _free_port()
        self.liveness_port = _free_port()
        self.starts = 0

    def start(self, resync_seconds: float = 10) -> None:
        assert self.proc is None
        self.starts += 1
        log = open(self.logdir / f"operator-{self.starts}.log", "wb")
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONPATH": PYTHONPATH}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_trainer.cli", "operator", "--resync-seconds", str(resync_seconds),
             "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port), "--verbose",
             *(self.args or ("--trust-syncer-url-annotation",))],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        log.close()

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics as {'name{labels}': value}."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_looked_again(self, timeout: float = 60) -> None:
        """Wait until the operator has taken up every object it knows for a reconcile since this call, so that what
        a test then finds unchanged is what the operator decided, not what it has not got to yet. Proof from its
        /metrics: a resync (it queues every known object) after the call, a second one a resync period later, and
        its queue empty after that: each object queued by the first resync has been taken up (and had a period to
        finish its pass), or it was queued again and taken up since."""
        start = self.metrics().get("diloco_operator_resyncs_total", 0.0)

        def looked() -> bool:
            m = self.metrics()
            return m.get("diloco_operator_resyncs_total", 0.0) >= start + 2 and m["diloco_operator_queue_depth"] == 0
        wait_for(looked, timeout, "two operator resyncs after now and its queue drained", 0.2)

    def log_tail(self, lines: int = 40) -> str:
        text = (self.logdir / f"operator-{self.starts}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])
