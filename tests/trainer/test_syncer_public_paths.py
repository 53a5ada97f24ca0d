"""The syncer's auth is an allow-list of public paths (`/healthz`, `/metrics`): every other path, an unknown one or
a route added later, needs the token. A real `diloco syncer` process over a real socket, and the app with a route
added the way a future change would add one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from diloco_trainer.protocol.tokens import learner_token
from diloco_trainer.syncer.app import PUBLIC_PATHS, make_app
from polling import wait_for
from syncer_kit import AUTH, TOKEN, make_syncer

TRAINER = Path(__file__).resolve().parents[2] / "trainer"


def _get(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_only_healthz_and_metrics_answer_without_a_token_on_a_real_syncer(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n")
    state = tmp_path / "state"
    env = {**os.environ, "DILOCO_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(TRAINER), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config),
                             "--host", "127.0.0.1", "--port", "0", "--state-dir", str(state)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = state / "endpoint.json"
        url = wait_for(lambda: endpoint.exists() and json.loads(endpoint.read_text())["url"], 120,
                       "the syncer to listen", 0.1)
        assert {p: _get(url + p) for p in sorted(PUBLIC_PATHS)} == {"/healthz": 200, "/metrics": 200}
        # Anything else is 401 without the token, served or not: no route is public by accident.
        unknown = ["/", "/admin", "/debug/state", "/v2/state", "/healthz/", "//healthz", "/metrics/x", "/v1"]
        for path in ["/v1/status", "/v1/state", "/v1/versions", "/v1/fragments/0", *unknown]:
            assert _get(url + path) == 401, path
            assert _get(url + path, "wrong") == 401, path
        # With the token an unknown path is an honest 404; a learner's token opens the reads too.
        assert {p: _get(url + p, TOKEN) for p in unknown[:4]} == {p: 404 for p in unknown[:4]}
        assert _get(url + "/v1/versions", learner_token(TOKEN, "learner-0")) == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_a_route_added_to_the_syncer_app_needs_the_token_by_default(aiohttp_client, tmp_path):
    app = make_app(make_syncer(tmp_path))

    async def secret_dump(request: web.Request) -> web.Response:
        return web.Response(text="the global model, for free")
    app.router.add_get("/debug/dump", secret_dump)  # a future route that forgot about auth
    client = await aiohttp_client(app)
    r = await client.get("/debug/dump")
    assert r.status == 401 and (await r.json())["error"] == "missing or wrong bearer token"
    assert (await client.get("/debug/dump", headers=AUTH)).status == 200
