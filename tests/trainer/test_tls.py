"""TLS between learners and the syncer: a real syncer process serving HTTPS with a certificate from tls.make_authority,
a learner that verifies it against the CA and trains, and the ways it must fail: a learner without the CA, a
plain-HTTP client, a certificate for another host, and a syncer given half of its TLS settings."""

import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from diloco_trainer.runtime.syncer_client import SyncerClient as StatusClient
from diloco_trainer.protocol.tls import is_loopback, make_authority

from polling import wait_for
from learner_kit import ROOT, TOKEN, SyncerProcess, child_env, finish, metrics, start_learner, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def tls_syncer(tmp_path):
    files = make_authority(tmp_path / "tls", ["127.0.0.1", "localhost"])
    proc = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log",
                         args=("--tls-cert", str(files.cert), "--tls-key", str(files.key)))
    proc.start()
    yield proc, files
    proc.stop()


def test_a_learner_trains_over_https_verifying_the_syncer_against_its_ca(tmp_path, tls_syncer):
    syncer, files = tls_syncer
    assert syncer.url.startswith("https://127.0.0.1:"), "endpoint.json advertises https"
    assert oct(files.key.stat().st_mode & 0o777) == "0o600", "the private key is readable by its owner only"
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    finish(start_learner(syncer.url, "l0", state, 24, "--ca", str(files.ca), log_path=log), log)
    final = metrics(state)[-1]
    assert final["acked"] == final["sent"] > 0 and final["adoptions"] > 0 and final["rejected"] == 0
    status = StatusClient(syncer.url, TOKEN, ca=files.ca).status()
    assert status is not None and status.learners["l0"].tokens_merged == final["acked_tokens"]


def test_without_the_ca_a_learner_refuses_the_syncer_and_sends_nothing(tmp_path, tls_syncer):
    syncer, files = tls_syncer
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    learner = start_learner(syncer.url, "l0", state, 5, log_path=log)
    try:
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in log.read_text() or "certificate verify failed"
                 in log.read_text(), 60, "the learner to reject the unknown certificate")
        assert learner.poll() is None, "it keeps retrying (the syncer may get a trusted certificate)"
    finally:
        learner.kill()
        learner.wait()
    assert metrics(state) == []
    assert StatusClient(syncer.url, TOKEN, ca=files.ca).status().learners == {}


def test_plain_http_to_the_tls_port_gets_no_answer_and_a_wrong_host_fails_verification(tmp_path, tls_syncer):
    syncer, files = tls_syncer
    plain = syncer.url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(plain + "/healthz", timeout=5).read()
    other = make_authority(tmp_path / "other", ["syncer.example"])
    ctx = ssl.create_default_context(cafile=str(other.ca))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        urllib.request.urlopen(syncer.url + "/healthz", timeout=5, context=ctx)
    ok = ssl.create_default_context(cafile=str(files.ca))
    with urllib.request.urlopen(syncer.url + "/healthz", timeout=5, context=ok) as resp:
        assert resp.status == 200


def test_the_syncer_refuses_half_a_tls_setting_and_an_unreadable_certificate(tmp_path):
    config = write_config(tmp_path / "run.yaml")
    files = make_authority(tmp_path / "tls", ["127.0.0.1"])
    base = [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
            "--port", "0", "--state-dir", str(tmp_path / "s")]
    half = subprocess.run(base + ["--tls-cert", str(files.cert)], env=child_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stdout
    bad = subprocess.run(base + ["--tls-cert", str(files.ca), "--tls-key", str(files.key)], env=child_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot use the TLS certificate" in bad.stdout


def test_a_learner_given_a_ca_for_a_plain_http_syncer_is_told_so(tmp_path):
    files = make_authority(tmp_path / "tls", ["127.0.0.1"])
    out = subprocess.run([sys.executable, "-m", "diloco_trainer.cli", "learner", "--syncer", "http://10.0.0.1:8470",
                          "--learner-id", "l0", "--ca", str(files.ca)], env=child_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--ca needs an https --syncer URL" in out.stdout + out.stderr


def test_loopback_is_recognised_so_plain_http_warns_only_off_the_machine():
    assert is_loopback("http://127.0.0.1:8470") and is_loopback("http://localhost:1") and is_loopback("::1")
    assert not is_loopback("http://syncer.default.svc:8470") and not is_loopback("http://10.0.0.7:8470")
