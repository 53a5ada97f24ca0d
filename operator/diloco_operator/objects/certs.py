"""The syncer's certificate in `spec.syncer.tls.mode: Auto` (pure: PEM in, PEM out): a self-signed CA per job
and a serving certificate for the syncer Service's DNS names, and when to renew it. Keys are cert-manager's
(`ca.crt`, `tls.crt`, `tls.key`) plus `ca.key`, so the serving certificate can be renewed under the same CA
(learners keep trusting it)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CRT, CA_KEY, TLS_CRT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
CA_DAYS = 3650
CERT_DAYS = 365
RENEW_BEFORE_DAYS = 30  # renewed (and the syncer rolled onto it) this long before it expires
CLUSTER_DOMAIN = "cluster.local"


def service_hosts(service: str, namespace: str) -> list[str]:
    """The DNS names a Service answers to from inside the cluster, shortest (what learners use) first."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def new_ca(common_name: str, now: datetime.datetime) -> dict[str, str]:
    """A new CA key pair: {ca.crt, ca.key} (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return {CA_CRT: _pem_cert(cert), CA_KEY: _pem_key(key)}


def _san(host: str) -> x509.GeneralName:
    """A host name as a DNS name, an address as an IP address (a remote cluster may reach the syncer by IP)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def serving_cert(ca: dict[str, str], hosts: list[str], now: datetime.datetime) -> dict[str, str]:
    """A serving certificate for `hosts` signed by `ca` ({ca.crt, ca.key}): {tls.crt, tls.key} (PEM)."""
    ca_cert = x509.load_pem_x509_certificate(ca[CA_CRT].encode())
    ca_key = serialization.load_pem_private_key(ca[CA_KEY].encode(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=CERT_DAYS), ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return {TLS_CRT: _pem_cert(cert), TLS_KEY: _pem_key(key)}


@dataclass(frozen=True)
class CertInfo:
    """What the operator checks of a serving certificate."""

    hosts: list[str]
    not_after: datetime.datetime


def inspect(cert_pem: str) -> CertInfo:
    """SAN DNS names (and IP addresses) and expiry of a PEM certificate (ValueError if it is not one)."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = san.get_values_for_type(x509.DNSName) + [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        hosts = []
    return CertInfo(hosts=list(hosts), not_after=cert.not_valid_after_utc)


def auto_secret_data(current: dict[str, str] | None, hosts: list[str], now: datetime.datetime,
                     ca_name: str) -> tuple[dict[str, str], str | None]:
    """The Auto Secret's data given what it holds now: (data, why it changed or None if kept). A usable CA is
    kept (learners trust it); the serving certificate is reissued when missing, unreadable, not for `hosts`,
    or within RENEW_BEFORE_DAYS of expiry, and when the CA itself is near its end."""
    data = dict(current or {})
    why = None
    try:
        ca_left = x509.load_pem_x509_certificate(data[CA_CRT].encode()).not_valid_after_utc - now
        serialization.load_pem_private_key(data[CA_KEY].encode(), password=None)
        if ca_left < datetime.timedelta(days=RENEW_BEFORE_DAYS):
            why = "the CA expires soon: new CA"
    except (KeyError, ValueError, TypeError):
        why = "new CA" if not current else "the CA is missing or unreadable: new CA"
    if why:
        data = new_ca(ca_name, now)
    else:
        try:
            info = inspect(data[TLS_CRT])
            serialization.load_pem_private_key(data[TLS_KEY].encode(), password=None)
            if set(info.hosts) != set(hosts):
                why = f"certificate names {sorted(info.hosts)} are not the Service's {sorted(hosts)}"
            elif info.not_after - now < datetime.timedelta(days=RENEW_BEFORE_DAYS):
                why = f"certificate expires {info.not_after:%Y-%m-%d}: renewed"
        except (KeyError, ValueError, TypeError):
            why = "certificate missing or unreadable: reissued"
        if why is None:
            return data, None
    return {**data, **serving_cert(data, hosts, now)}, why


def secret_problem(data: dict[str, str] | None, secret: str, service: str) -> str | None:
    """What is wrong with a user's Secret (spec.syncer.tls.secretName) for the syncer, or None if usable:
    it must exist, hold tls.crt, tls.key and ca.crt, and its certificate must name the Service learners dial."""
    field = f"spec.syncer.tls.secretName: Secret {secret}"
    if data is None:
        return f"{field} does not exist (the syncer pod waits for it)"
    missing = [k for k in (TLS_CRT, TLS_KEY, CA_CRT) if not data.get(k)]
    if missing:
        return f"{field} lacks the key(s) {', '.join(missing)} (cert-manager writes tls.crt, tls.key and ca.crt)"
    try:
        info = inspect(data[TLS_CRT])
        x509.load_pem_x509_certificates(data[CA_CRT].encode())
    except ValueError as exc:
        return f"{field} holds no usable PEM certificate: {str(exc)[:120]}"
    if service not in info.hosts:
        return (f"{field}: its certificate does not name the syncer Service {service} (DNS names {info.hosts}); "
                f"learners dial https://{service}:PORT and would refuse it")
    return None
