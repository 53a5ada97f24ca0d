"""Unit tests of spec.syncer.tls (no cluster): the Auto certificate (issued, kept, renewed under the same CA), the
checks of a user's Secret, the LinkEncrypted condition, and what the syncer and learner pods mount and run."""

from __future__ import annotations

import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pydantic
import pytest
from cryptography import x509

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import certs, builders as objects
from diloco_operator.plan import jobplan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}
HOSTS = certs.service_hosts("demo-syncer", "ns")


def job_spec(tls: dict | None = None) -> api.DilocoJobSpec:
    syncer = {"tls": tls} if tls is not None else {}
    return api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu"}], "syncer": syncer})


def handshake(data: dict[str, str], host: str, tmp: Path) -> str:
    """A real TLS handshake (in memory) of a server holding data's tls.crt/tls.key with a client trusting only
    data's ca.crt and dialling `host`; returns the negotiated version, or raises ssl.SSLError."""
    (tmp / "tls.crt").write_text(data["tls.crt"])
    (tmp / "tls.key").write_text(data["tls.key"])
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    client_ctx = ssl.create_default_context(cadata=data["ca.crt"])
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, end in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return client.version()
    raise AssertionError("handshake did not finish")


def test_auto_mode_issues_a_ca_and_a_certificate_for_every_service_name(tmp_path):
    data, why = certs.auto_secret_data(None, HOSTS, datetime.now(timezone.utc), "demo CA")
    assert why == "new CA"
    assert set(certs.inspect(data["tls.crt"]).hosts) == {"demo-syncer", "demo-syncer.ns", "demo-syncer.ns.svc",
                                                         "demo-syncer.ns.svc.cluster.local"}
    for host in HOSTS:
        assert handshake(data, host, tmp_path) in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError):  # a name the certificate does not carry
        handshake(data, "other-syncer", tmp_path)
    other, _ = certs.auto_secret_data(None, HOSTS, datetime.now(timezone.utc), "another CA")
    with pytest.raises(ssl.SSLCertVerificationError):  # a client trusting another job's CA refuses it
        handshake({**data, "ca.crt": other["ca.crt"]}, "demo-syncer", tmp_path)


def test_a_valid_auto_certificate_is_kept_and_one_near_expiry_is_renewed_under_the_same_ca():
    now = datetime.now(timezone.utc)
    data, _ = certs.auto_secret_data(None, HOSTS, now, "demo CA")
    kept, why = certs.auto_secret_data(data, HOSTS, now + timedelta(days=300), "demo CA")
    assert why is None and kept == data
    later = now + timedelta(days=certs.CERT_DAYS - certs.RENEW_BEFORE_DAYS + 1)
    renewed, why = certs.auto_secret_data(data, HOSTS, later, "demo CA")
    assert "renewed" in why
    assert renewed["ca.crt"] == data["ca.crt"] and renewed["ca.key"] == data["ca.key"]  # learners keep trusting it
    assert renewed["tls.crt"] != data["tls.crt"]
    assert certs.inspect(renewed["tls.crt"]).not_after > later + timedelta(days=300)
    # (issued in the future, so no handshake today:) signed by the CA the learners already trust
    x509.load_pem_x509_certificate(renewed["tls.crt"].encode()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(data["ca.crt"].encode()))


def test_an_auto_certificate_for_other_names_or_a_damaged_secret_is_reissued():
    now = datetime.now(timezone.utc)
    data, _ = certs.auto_secret_data(None, certs.service_hosts("old-syncer", "ns"), now, "demo CA")
    moved, why = certs.auto_secret_data(data, HOSTS, now, "demo CA")
    assert "not the Service's" in why and set(certs.inspect(moved["tls.crt"]).hosts) == set(HOSTS)
    assert moved["ca.crt"] == data["ca.crt"]
    broken, why = certs.auto_secret_data({**data, "ca.key": "garbage"}, HOSTS, now, "demo CA")
    assert "CA" in why and broken["ca.crt"] != data["ca.crt"]


def test_a_user_secret_is_checked_for_keys_and_the_service_name():
    now = datetime.now(timezone.utc)
    good, _ = certs.auto_secret_data(None, HOSTS, now, "cert-manager CA")
    user = {k: good[k] for k in ("tls.crt", "tls.key", "ca.crt")}  # what cert-manager writes
    assert certs.secret_problem(user, "mine", "demo-syncer") is None
    missing = certs.secret_problem(None, "mine", "demo-syncer")
    assert missing.startswith("spec.syncer.tls.secretName: Secret mine") and "does not exist" in missing
    lacks = certs.secret_problem({"tls.crt": user["tls.crt"], "tls.key": user["tls.key"]}, "mine", "demo-syncer")
    assert "spec.syncer.tls.secretName" in lacks and "ca.crt" in lacks
    elsewhere, _ = certs.auto_secret_data(None, ["syncer.example.com"], now, "CA")
    wrong = certs.secret_problem(elsewhere, "mine", "demo-syncer")
    assert "does not name the syncer Service demo-syncer" in wrong
    assert "no usable PEM" in certs.secret_problem({**user, "tls.crt": "not a certificate"}, "mine", "demo-syncer")


def test_tls_mode_defaults_to_auto_and_inconsistent_fields_are_refused_naming_the_field():
    assert job_spec().syncer.tls.effective_mode == "Auto"
    assert job_spec({"secretName": "mine"}).syncer.tls.effective_mode == "Secret"
    with pytest.raises(pydantic.ValidationError, match="syncer.tls.secretName applies only with mode Secret"):
        job_spec({"mode": "Disabled", "secretName": "mine"})
    with pytest.raises(pydantic.ValidationError, match="needs syncer.tls.secretName"):
        job_spec({"mode": "Secret"})


def test_the_syncer_serves_the_auto_certificate_and_learners_dial_https_with_the_ca():
    spec = job_spec()
    dep = objects.syncer_deployment(JOB, spec, tls_hash="abc")
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[cmd.index("--tls-cert") + 1] == "/etc/diloco/tls/tls.crt"
    assert cmd[cmd.index("--tls-key") + 1] == "/etc/diloco/tls/tls.key"
    tls_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == "demo-syncer-tls"
    assert [i["key"] for i in tls_volume["secret"]["items"]] == ["tls.crt", "tls.key"]  # never ca.key
    assert {"name": "tls", "mountPath": "/etc/diloco/tls", "readOnly": True} in container["volumeMounts"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert pod["metadata"]["annotations"][objects.ANNOTATION_TLS_HASH] == "abc"
    renewed = objects.syncer_deployment(JOB, spec, tls_hash="def")["spec"]["template"]["metadata"]["annotations"]
    assert renewed[objects.ANNOTATION_TLS_HASH] == "def"  # a new certificate rolls the syncer
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"
    learner = objects.unit_pod(unit, 0, 0)["spec"]
    lcmd = learner["containers"][0]["command"]
    assert lcmd[lcmd.index("--syncer") + 1] == "https://demo-syncer:8470"
    assert lcmd[lcmd.index("--ca") + 1] == "/etc/diloco/ca/ca.crt"
    assert {"name": "syncer-ca", "configMap": {"name": "demo-syncer-ca"}} in learner["volumes"]
    # A learner's node never gets the syncer's key: the one Secret it mounts is its unit's token.
    assert [v["secret"]["secretName"] for v in learner["volumes"] if "secret" in v] == ["demo-cpu-0-learner-token"]


def test_secret_mode_mounts_the_given_secret_and_disabled_mode_is_plain_http():
    dep = objects.syncer_deployment(JOB, job_spec({"secretName": "from-cert-manager"}))
    assert next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")["secret"][
        "secretName"] == "from-cert-manager"
    plain = job_spec({"mode": "Disabled"})
    container = objects.syncer_deployment(JOB, plain)["spec"]["template"]["spec"]["containers"][0]
    assert "--tls-cert" not in container["command"] and container["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", plain, plain.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"
    cmd = objects.unit_pod(unit, 0, 0)["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--syncer") + 1] == "http://demo-syncer:8470" and "--ca" not in cmd


def test_link_encrypted_says_why_and_warns_once_when_the_link_is_plain():
    conds, events = jobplan.link_encrypted([], job_spec().syncer.tls, "demo-syncer-tls", None, T0, 1)
    assert C.is_true(conds, C.LINK_ENCRYPTED) and events == []
    assert C.get_condition(conds, C.LINK_ENCRYPTED)["reason"] == C.Reason.AUTO_CERTIFICATE
    off = job_spec({"mode": "Disabled"}).syncer.tls
    conds, events = jobplan.link_encrypted(conds, off, None, None, T0, 2)
    cond = C.get_condition(conds, C.LINK_ENCRYPTED)
    assert cond["status"] == "False" and cond["reason"] == C.Reason.TLS_DISABLED
    assert "spec.syncer.tls.mode" in cond["message"] and "unencrypted" in cond["message"]
    assert events == [("Warning", C.Reason.TLS_DISABLED, cond["message"])]
    again, events = jobplan.link_encrypted(conds, off, None, None, T0 + timedelta(seconds=30), 2)
    assert events == [] and again == conds  # one Warning, not one per reconcile
    problem = "spec.syncer.tls.secretName: Secret mine does not exist (the syncer pod waits for it)"
    conds, events = jobplan.link_encrypted(conds, job_spec({"secretName": "mine"}).syncer.tls, "mine", problem, T0, 3)
    assert C.get_condition(conds, C.LINK_ENCRYPTED)["reason"] == C.Reason.TLS_SECRET_INVALID
    assert events == [("Warning", C.Reason.TLS_SECRET_INVALID, problem)]
