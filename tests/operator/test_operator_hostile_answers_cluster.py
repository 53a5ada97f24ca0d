"""A remote cluster whose apiserver is hostile (issue 38, Medium 4): the job's kubeconfig names a server that answers
every call 503 with a long body full of newlines and control characters. The operator, running for real, says the
cluster does not answer in the unit's and the job's conditions and in its Events, each a short single line, never
the body (the end of the body, a marker, must appear nowhere)."""

from __future__ import annotations

import base64
import ssl
import threading
import unicodedata
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from diloco_kube.labels import POOL_LABEL
from diloco_operator.objects import certs
from test_operator_cluster import condition, job  # helpers only

from polling import wait_for

pytestmark = pytest.mark.cluster
MARKER = "END-OF-THE-HOSTILE-BODY"
BODY = ("line one\nline two\r\n\x1b[31mred\x1b[0m \x00 \u202eevil\u202c " * 20_000 + MARKER).encode()


class Refuse(BaseHTTPRequestHandler):
    """Every request: 503 and BODY."""

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(BODY)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hostile_apiserver(tmp_path):
    """The server, over TLS on 127.0.0.1 (a kubeconfig must name an https:// server): (url, its CA in PEM)."""
    now = datetime.now(timezone.utc)
    ca = certs.new_ca("hostile apiserver CA", now)
    pair = certs.serving_cert(ca, ["127.0.0.1"], now)
    (tmp_path / "tls.crt").write_text(pair[certs.TLS_CRT])
    (tmp_path / "tls.key").write_text(pair[certs.TLS_KEY])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", ca[certs.CA_CRT]
    server.shutdown()
    server.server_close()


def one_short_line(text: str, limit: int) -> bool:
    return len(text) <= limit and MARKER not in text and not any(unicodedata.category(c)[0] == "C" for c in text)


def test_a_hostile_remote_apiserver_leaves_only_a_short_reason_in_status_and_events(kubectl, operator, ns,
                                                                                   hostile_apiserver):
    url, ca = hostile_apiserver
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "evil",
              "clusters": [{"name": "evil", "cluster": {"server": url,
                                                        "certificate-authority-data": base64.b64encode(
                                                            ca.encode()).decode()}}],
              "users": [{"name": "author", "user": {"token": "t"}}],
              "contexts": [{"name": "evil", "context": {"cluster": "evil", "user": "author"}}]}
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "evil-kubeconfig"},
                   "stringData": {"kubeconfig": yaml.safe_dump(config)}}, "-n", ns)
    kubectl.apply(job("far", [{"name": "far", "count": 1, "cluster": "evil", "nodeSelector": {POOL_LABEL: "cpu"}}],
                      clusters=[{"name": "evil", "kubeconfigSecret": {"name": "evil-kubeconfig"},
                                 "syncerUrl": "https://syncer.evil.example:8470"}]), "-n", ns)

    unit = wait_for(lambda: (c := condition(kubectl.get("lu", "far-far-0", ns=ns) or {}, "ClusterReachable"))
                    .get("status") == "False" and c, 60, "ClusterReachable=False on far-far-0", 0.5)
    assert "503" in unit["message"] and one_short_line(unit["message"], 400), unit["message"][:1000]
    dj = wait_for(lambda: (c := condition(kubectl.get("dj", "far", ns=ns) or {}, "ClustersReachable"))
                  .get("status") == "False" and c, 60, "ClustersReachable=False on the job", 0.5)
    assert "503" in dj["message"] and one_short_line(dj["message"], 600), dj["message"][:1000]
    unreachable = [e["message"] for e in kubectl.get("events", ns=ns) if e["reason"] == "ClusterUnreachable"]
    assert unreachable and all(one_short_line(m, 400) for m in unreachable), unreachable

    # Deleting the job: its objects there cannot be removed, and the Event says why in one short line.
    kubectl.run("delete", "dj", "far", "-n", ns, "--wait=false")
    cleanup = wait_for(lambda: [e["message"] for e in kubectl.get("events", ns=ns)
                                if e["reason"] == "RemoteCleanupFailed"], 60, "a RemoteCleanupFailed Event", 0.5)
    assert all("503" in m and one_short_line(m, 700) for m in cleanup), cleanup
    kubectl.run("patch", "dj", "far", "-n", ns, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
    wait_for(lambda: kubectl.get("dj", "far", ns=ns) is None, 60, "the job gone", 0.5)
