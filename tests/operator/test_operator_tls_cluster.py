"""spec.syncer.tls on a real control plane, the operator running for real: the Auto certificate Secret (its names
are the syncer Service's, a real syncer serves it and the operator reads its status over verified TLS), a
cert-manager style Secret mounted as given, plain HTTP only when asked for (Warning and condition), and a
manifest mixing the modes refused by the apiserver naming the field."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import datetime, timezone

import aiohttp
import pytest

from diloco_kube.labels import POOL_LABEL
from diloco_operator.objects import certs

from polling import wait_for
from cluster_kit import PYTHONPATH
from test_operator_cluster import condition, cpu_units, events, job, pods, wait_job_ready

pytestmark = pytest.mark.cluster


def secret_data(kubectl, ns: str, name: str) -> dict[str, str] | None:
    obj = kubectl.get("secret", name, ns=ns)
    return None if obj is None else {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}


def syncer_pod_spec(kubectl, ns: str, name: str) -> dict:
    return kubectl.get("deployment", f"{name}-syncer", ns=ns)["spec"]["template"]["spec"]


def learner_containers(kubectl, ns: str, name: str) -> list[dict]:
    return [p["spec"]["containers"][0] for p in pods(kubectl, ns, f"diloco.dev/job={name},diloco.dev/component=learner")]


async def register(url: str, ca: str, token: str, learner: str) -> tuple[int, str | None]:
    """POST /v1/register over TLS verified against `ca` as the Service's name: (status, error)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/register", ssl=ssl.create_default_context(cadata=ca),
                                server_hostname="tls-syncer", headers={"Authorization": f"Bearer {token}"},
                                json={"learner_id": learner, "unit": 0, "world_size": 1, "device": "cpu"}) as r:
            return r.status, None if r.status == 200 else (await r.json())["error"]


def arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_auto_mode_issues_a_certificate_for_the_syncer_service_that_the_syncer_serves(kubectl, operator, ns,
                                                                                      tmp_path):
    tiny = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}, "outer": {"fragments": 2}}
    kubectl.apply(job("tls", cpu_units(2), config=tiny), "-n", ns)
    dj = wait_job_ready(kubectl, ns, "tls", 2)
    link = condition(dj, "LinkEncrypted")
    assert link["status"] == "True" and link["reason"] == "AutoCertificate" and "tls-syncer-tls" in link["message"]
    secret = kubectl.get("secret", "tls-syncer-tls", ns=ns)
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["ownerReferences"][0]["name"] == "tls"  # deleted with the job
    data = secret_data(kubectl, ns, "tls-syncer-tls")
    assert set(certs.inspect(data["tls.crt"]).hosts) == {
        "tls-syncer", f"tls-syncer.{ns}", f"tls-syncer.{ns}.svc", f"tls-syncer.{ns}.svc.cluster.local"}
    assert kubectl.get("services", "tls-syncer", ns=ns)["metadata"]["name"] == "tls-syncer"
    assert kubectl.get("configmap", "tls-syncer-ca", ns=ns)["data"] == {"ca.crt": data["ca.crt"]}
    wait_for(lambda: [e for e in events(kubectl, ns, "CertificateIssued") if e["involvedObject"]["name"] == "tls"],
             30, "the CertificateIssued Event", 0.2)

    spec = syncer_pod_spec(kubectl, ns, "tls")
    syncer = spec["containers"][0]
    assert arg(syncer["command"], "--tls-cert") == "/etc/diloco/tls/tls.crt"
    assert arg(syncer["command"], "--tls-key") == "/etc/diloco/tls/tls.key"
    assert next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "tls-syncer-tls"
    assert syncer["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    syncer_pods = pods(kubectl, ns, "diloco.dev/job=tls,diloco.dev/component=syncer")
    assert syncer_pods and all(any(v.get("secret", {}).get("secretName") == "tls-syncer-tls"
                                   for v in p["spec"]["volumes"]) for p in syncer_pods)

    learners = learner_containers(kubectl, ns, "tls")
    assert len(learners) == 2
    units = {p["metadata"]["labels"]["diloco.dev/unit"]: p for p in pods(kubectl, ns, "diloco.dev/component=learner")}
    assert sorted(units) == ["tls-cpu-0", "tls-cpu-1"]
    for unit, pod in units.items():  # the unit's own token, never the job's
        container = pod["spec"]["containers"][0]
        assert not any("TOKEN" in e["name"] or "valueFrom" in e for e in container["env"]), "never in the environment"
        assert arg(container["command"], "--token-file") == "/etc/diloco-token/token"
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "token"]
        assert volume["secret"] == {"secretName": f"{unit}-learner-token", "defaultMode": 0o440,
                                    "items": [{"key": "token", "path": "token"}]}
        owner = kubectl.get("secret", f"{unit}-learner-token", ns=ns)["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "LearnerUnit" and owner["name"] == unit
    for c in learners:
        assert arg(c["command"], "--syncer") == "https://tls-syncer:8470"
        assert arg(c["command"], "--ca") == "/etc/diloco/ca/ca.crt"
        assert {"name": "syncer-ca", "mountPath": "/etc/diloco/ca", "readOnly": True} in c["volumeMounts"]

    # A real syncer serving that Secret's pair (kwok runs no containers); the operator reads its status over
    # TLS verified against the CA under the Service's name, whatever address it dials.
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_text(data[key])
    (tmp_path / "config.yaml").write_text(kubectl.get("configmap", "tls-config", ns=ns)["data"]["config.yaml"])
    token = secret_data(kubectl, ns, "tls-token")["token"]
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(tmp_path / "config.yaml"),
         "--host", "127.0.0.1", "--port", "0", "--state-dir", str(state), "--tls-cert", str(tmp_path / "tls.crt"),
         "--tls-key", str(tmp_path / "tls.key")],
        env={**os.environ, "DILOCO_TOKEN": token, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for(lambda: (state / "endpoint.json").exists() and
                       json.loads((state / "endpoint.json").read_text())["url"], 60, "the syncer to listen", 0.2)
        assert url.startswith("https://127.0.0.1:")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # no system CA vouches for it
            urllib.request.urlopen(f"{url}/healthz", timeout=10)
        kubectl.run("annotate", "dj", "tls", "-n", ns, f"diloco.dev/syncer-url={url}")
        dj = wait_for(lambda: (d := kubectl.get("dj", "tls", ns=ns))["status"].get("outerSteps") is not None and d,
                      30, "outerSteps read by the operator over TLS", 0.2)
        assert dj["status"]["outerSteps"] == 0
        # Each unit's pods read the unit's own token: over this TLS link it acts as that unit and no other.
        for unit, other in (("tls-cpu-0", "tls-cpu-1"), ("tls-cpu-1", "tls-cpu-0")):
            mine = secret_data(kubectl, ns, f"{unit}-learner-token")["token"]
            assert asyncio.run(register(url, data["ca.crt"], mine, unit)) == (200, None)
            status, error = asyncio.run(register(url, data["ca.crt"], mine, other))
            assert status == 403 and error == f"the token of learner {unit!r} cannot act as learner {other!r}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_secret_mode_mounts_the_given_secret_and_says_what_is_wrong_until_it_is_usable(kubectl, operator, ns):
    kubectl.apply(job("byo", cpu_units(1), syncer={"nodeSelector": {POOL_LABEL: "cpu"},
                                                   "tls": {"secretName": "byo-cert"}}), "-n", ns)
    dj = wait_for(lambda: (d := kubectl.get("dj", "byo", ns=ns)) and condition(d, "LinkEncrypted").get("reason")
                  == "TLSSecretInvalid" and d, 30, "LinkEncrypted=False/TLSSecretInvalid", 0.2)
    message = condition(dj, "LinkEncrypted")["message"]
    assert message.startswith("spec.syncer.tls.secretName: Secret byo-cert") and "does not exist" in message
    warned = wait_for(lambda: [e for e in events(kubectl, ns, "TLSSecretInvalid") if e["involvedObject"]["name"]
                               == "byo"], 30, "the TLSSecretInvalid Warning", 0.2)  # posted after the status
    assert warned[0]["type"] == "Warning" and warned[0]["message"] == message
    assert kubectl.get("secret", "byo-syncer-tls", ns=ns) is None  # the operator issues nothing in this mode
    # What cert-manager would write for a Certificate with dnsNames [byo-syncer, ...] and a CA issuer.
    issued, _ = certs.auto_secret_data(None, certs.service_hosts("byo-syncer", ns), datetime.now(timezone.utc),
                                       "cert-manager CA")
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                   "metadata": {"name": "byo-cert"},
                   "stringData": {k: issued[k] for k in ("tls.crt", "tls.key", "ca.crt")}}, "-n", ns)
    dj = wait_for(lambda: (d := kubectl.get("dj", "byo", ns=ns)) and condition(d, "LinkEncrypted").get("status")
                  == "True" and d, 60, "LinkEncrypted=True once the Secret is usable", 0.2)
    assert condition(dj, "LinkEncrypted")["reason"] == "SecretCertificate"
    spec = syncer_pod_spec(kubectl, ns, "byo")
    assert next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "byo-cert"
    assert "--tls-cert" in spec["containers"][0]["command"]
    assert kubectl.get("configmap", "byo-syncer-ca", ns=ns)["data"] == {"ca.crt": issued["ca.crt"]}
    wait_job_ready(kubectl, ns, "byo", 1)
    (learner,) = learner_containers(kubectl, ns, "byo")
    assert arg(learner["command"], "--syncer") == "https://byo-syncer:8470" and "--ca" in learner["command"]


def test_plain_http_only_when_asked_for_with_a_warning_and_a_condition(kubectl, operator, ns):
    kubectl.apply(job("plain", cpu_units(1), syncer={"nodeSelector": {POOL_LABEL: "cpu"},
                                                     "tls": {"mode": "Disabled"}}), "-n", ns)
    dj = wait_job_ready(kubectl, ns, "plain", 1)
    link = condition(dj, "LinkEncrypted")
    assert link["status"] == "False" and link["reason"] == "TLSDisabled" and "unencrypted" in link["message"]
    warned = wait_for(lambda: [e for e in events(kubectl, ns, "TLSDisabled") if e["involvedObject"]["name"] == "plain"],
                      30, "the TLSDisabled Warning", 0.2)
    assert warned[0]["type"] == "Warning" and len(warned) == 1
    assert "--tls-cert" not in syncer_pod_spec(kubectl, ns, "plain")["containers"][0]["command"]
    assert kubectl.get("secret", "plain-syncer-tls", ns=ns) is None
    (learner,) = learner_containers(kubectl, ns, "plain")
    assert arg(learner["command"], "--syncer") == "http://plain-syncer:8470" and "--ca" not in learner["command"]


def test_a_secret_name_with_tls_disabled_is_refused_by_the_apiserver_naming_the_field(kubectl, operator, ns):
    bad = job("mixed", cpu_units(1), syncer={"tls": {"mode": "Disabled", "secretName": "some-cert"}})
    out = kubectl.apply(bad, "-n", ns, check=False)
    assert out.returncode != 0
    assert "spec.syncer.tls.secretName" in out.stderr and "applies only with mode Secret" in out.stderr
    out = kubectl.apply(job("half", cpu_units(1), syncer={"tls": {"mode": "Secret"}}), "-n", ns, check=False)
    assert out.returncode != 0 and "spec.syncer.tls.secretName" in out.stderr and "needs secretName" in out.stderr
    assert kubectl.get("dj", "mixed", ns=ns) is None and kubectl.get("dj", "half", ns=ns) is None


class Listener:
    """A plain-HTTP server on a real socket that records who called it (path, Authorization) and answers 503."""

    def __init__(self):
        import http.server
        import threading
        calls = self.calls = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                calls.append((self.path, self.headers.get("Authorization")))
                self.send_response(503)
                self.end_headers()

            def log_message(self, *args):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_trusted_plain_http_syncer_url_annotation_gets_no_token_while_tls_is_on(kubectl, operator, ns):
    # The test operator trusts the annotation (--trust-syncer-url-annotation); the job's TLS is on (Auto).
    listener = Listener()
    try:
        spec = job("plain", cpu_units(1))
        spec["metadata"]["annotations"] = {"diloco.dev/syncer-url": listener.url}
        kubectl.apply(spec, "-n", ns)
        wait_job_ready(kubectl, ns, "plain", 1)  # its syncer is ready: the operator would poll it now

        def refused():
            c = condition(kubectl.get("dj", "plain", ns=ns), "SyncerUrlAnnotation")
            return c.get("reason") == "PlainHttpRefused" and c
        cond = wait_for(refused, 30, "SyncerUrlAnnotation=False/PlainHttpRefused", 0.2)
        assert cond["status"] == "False" and "annotation diloco.dev/syncer-url" in cond["message"]
        assert repr(listener.url) in cond["message"] and "plain HTTP" in cond["message"]
        (event,) = wait_for(lambda: events(kubectl, ns, "PlainHttpRefused"), 30, "the Warning Event", 0.2)
        assert event["type"] == "Warning" and "diloco.dev/syncer-url" in event["message"]
        # Once the same job chooses plain HTTP for every link, the operator does follow that address, with the
        # job's token: what it held back above.
        token = secret_data(kubectl, ns, "plain-token")["token"]
        assert listener.calls == []
        kubectl.apply({**spec, "spec": {**spec["spec"], "syncer": {**spec["spec"]["syncer"],
                                                                   "tls": {"mode": "Disabled"}}}}, "-n", ns)
        wait_for(lambda: listener.calls, 60, "the operator's poll at the annotated address", 0.2)
        assert listener.calls[0] == ("/v1/status", f"Bearer {token}")
        followed = wait_for(lambda: (c := condition(kubectl.get("dj", "plain", ns=ns), "SyncerUrlAnnotation"))
                            .get("status") == "True" and c, 30, "SyncerUrlAnnotation=True", 0.2)
        assert followed["reason"] == "AnnotationFollowed"
    finally:
        listener.close()
