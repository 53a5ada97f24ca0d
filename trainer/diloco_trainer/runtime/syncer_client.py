"""A small blocking HTTP client for the supervisor's own calls to the syncer (status, state, metrics).

Blocking on purpose: the supervisor loop is synchronous and calls at most a few times a second.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from diloco_trainer.protocol.messages import SyncerStatus
from diloco_trainer.protocol.tls import client_context


class SyncerClient:
    """Reads the syncer's `/v1/status`, `/v1/state` and `/metrics`; every call has a short timeout."""

    def __init__(self, url: str, token: str, timeout: float = 5.0, ca: Path | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._ssl = client_context(ca) if self.url.startswith("https://") else None

    def _get(self, path: str, auth: bool = True, timeout: float | None = None) -> bytes:
        req = urllib.request.Request(self.url + path)
        if auth:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout or self.timeout, context=self._ssl) as resp:
            return resp.read()

    def status(self) -> SyncerStatus | None:
        """`/v1/status`, or None when the syncer does not answer (down or restarting) or answers garbage."""
        try:
            return SyncerStatus.model_validate_json(self._get("/v1/status"))
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def state_bytes(self) -> bytes | None:
        """All of Θ as safetensors bytes (`/v1/state`), or None if the syncer is away."""
        try:
            return self._get("/v1/state", timeout=30.0)
        except (OSError, urllib.error.URLError):
            return None

    def metrics_text(self) -> str | None:
        """The Prometheus exposition (`/metrics`, no token), or None if the syncer is away."""
        try:
            return self._get("/metrics", auth=False).decode()
        except (OSError, urllib.error.URLError):
            return None


def wait_for_endpoint(path: Path, alive, timeout: float) -> dict:
    """Wait for the syncer's endpoint.json (written once it listens); `alive()` False means it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                doc = json.loads(path.read_text())
                if "url" not in doc:
                    doc["url"] = f"http://{doc['host']}:{doc['port']}"
                return doc
            except (ValueError, KeyError):
                pass  # being written
        if not alive():
            raise RuntimeError("the syncer exited before it started listening")
        time.sleep(0.1)
    raise RuntimeError(f"the syncer did not write {path} within {timeout:.0f}s")
