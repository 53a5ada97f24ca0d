"""A remote cluster's kubeconfig (from a user's Secret) is loaded only with inline credentials: exec plugins,
auth-providers and file paths are refused by name before any client is built (kubeconfig_policy)."""

from __future__ import annotations

import base64

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from diloco_operator.remote.clusters import parse_kubeconfig
from diloco_operator.remote.kubeconfig_policy import KubeconfigRefused, check_inline

CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()


def kubeconfig(user: dict, cluster: dict | None = None, extra_users: tuple = ()) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "west",
            "clusters": [{"name": "west", "cluster": cluster or {"server": "https://west.example:6443",
                                                                 "certificate-authority-data": CA}}],
            "contexts": [{"name": "west", "context": {"cluster": "west", "user": "u"}}],
            "users": [{"name": "u", "user": user}, *extra_users]}


def refusal(config) -> str:
    with pytest.raises(KubeconfigRefused) as exc:
        check_inline(config)
    return str(exc.value)


def test_inline_token_and_client_certificate_users_are_accepted():
    check_inline(kubeconfig({"token": "t"}))
    check_inline(kubeconfig({"client-certificate-data": CA, "client-key-data": CA}))
    check_inline(kubeconfig({"token": "t"}, {"server": "https://10.0.0.1", "certificate-authority-data": CA,
                                            "tls-server-name": "kubernetes"}))


@pytest.mark.parametrize("field, value, why", [
    ("exec", {"apiVersion": "client.authentication.k8s.io/v1", "command": "/bin/sh"}, "run a program"),
    ("auth-provider", {"name": "oidc", "config": {"cmd-path": "/bin/sh"}}, "runs a command"),
    ("tokenFile", "/var/run/secrets/kubernetes.io/serviceaccount/token", "file path"),
    ("client-certificate", "/etc/ssl/private/cert.pem", "file path"),
    ("client-key", "/etc/ssl/private/key.pem", "file path"),
])
def test_a_user_that_runs_a_program_or_reads_a_file_is_refused_naming_the_field(field, value, why):
    message = refusal(kubeconfig({"token": "t", field: value} if field != "exec" else {field: value}))
    assert message.startswith(f"users[0].user.{field}: ") and why in message and "inline" in message


def test_every_user_is_checked_not_only_the_one_in_use():
    message = refusal(kubeconfig({"token": "t"}, extra_users=({"name": "other", "user": {"exec": {}}},)))
    assert message.startswith("users[1].user.exec: ")


@pytest.mark.parametrize("field, value", [("certificate-authority", "/etc/ssl/ca.pem"),
                                          ("insecure-skip-tls-verify", True), ("proxy-url", "http://proxy:3128")])
def test_a_cluster_that_reads_a_file_or_skips_verification_is_refused(field, value):
    message = refusal(kubeconfig({"token": "t"}, {"server": "https://west.example", field: value}))
    assert message.startswith(f"clusters[0].cluster.{field}: ")


@pytest.mark.parametrize("server", ["http://169.254.169.254", "west.example:6443", None, "https://"])
def test_a_server_that_is_not_https_is_refused(server):
    assert refusal(kubeconfig({"token": "t"}, {"server": server})).startswith("clusters[0].cluster.server: ")


def test_an_unknown_field_is_refused_rather_than_passed_to_the_client():
    assert refusal(kubeconfig({"token": "t", "as": "system:admin"})).startswith("users[0].user.as: not accepted")
    assert refusal({**kubeconfig({"token": "t"}), "include": "/etc"}).startswith("kubeconfig.include: ")


def test_malformed_documents_are_refused_with_a_reason():
    assert "mapping" in refusal(["not", "a", "kubeconfig"])
    assert refusal({"users": {"u": {}}}) == "users: must be a list"
    assert "client-key-data" in refusal(kubeconfig({"client-certificate-data": CA}))


def test_a_secret_that_is_not_yaml_is_refused_without_echoing_its_content():
    raw = base64.b64encode(b"users: [\n  secret-value-xyz: {").decode()
    with pytest.raises(KubeconfigRefused) as exc:
        parse_kubeconfig(raw)
    assert "line" in str(exc.value) and "secret-value-xyz" not in str(exc.value)


def test_an_exec_plugin_the_official_client_would_run_never_runs(tmp_path):
    marker = tmp_path / "ran"
    config = kubeconfig({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "/bin/sh",
                                  "args": ["-c", f"touch {marker}; echo '{{}}'"], "interactiveMode": "Never"}})
    raw = base64.b64encode(yaml.safe_dump(config).encode()).decode()
    with pytest.raises(KubeconfigRefused, match=r"users\[0\]\.user\.exec"):
        parse_kubeconfig(raw)
    assert not marker.exists()
    # What the check stands between: the official client, given the same document, runs the plugin.
    try:
        k8s_config.load_kube_config_from_dict(config, client_configuration=k8s.Configuration())
    except Exception:  # noqa: BLE001 - the plugin printed no credential; it ran all the same
        pass
    assert marker.exists()
