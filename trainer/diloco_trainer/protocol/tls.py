"""TLS between learners and the syncer: the contexts each side uses, and a certificate authority plus a server
certificate for a syncer (what `diloco local --tls` and the tests use; in a cluster, cert-manager or the operator).

Files are named as cert-manager names a Secret's keys: `ca.crt`, `tls.crt`, `tls.key`. Torch-free.

Tokens travel inside TLS. Learners started by the operator hold per-learner tokens (tokens.py), so a leaked
learner credential acts only as that learner; the job's token stays with the syncer and the operator.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # ca.crt: what clients verify the syncer against
    cert: Path  # tls.crt: the syncer's certificate (chain)
    key: Path  # tls.key: its private key (mode 0600)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The syncer's context: TLS 1.2 or newer, its certificate and key (ValueError naming the file if unusable)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use the TLS certificate {cert} with key {key}: {exc}") from exc
    return ctx


def client_context(ca: Path | None) -> ssl.SSLContext:
    """A client's context: verifies the syncer's certificate and host name against `ca` (else the system's CAs)."""
    try:
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot read the CA certificate {ca}: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def is_loopback(url_or_host: str) -> bool:
    """True for a URL or host on this machine's loopback (where plain HTTP never leaves the machine)."""
    host = (urlsplit(url_or_host).hostname if "://" in url_or_host else url_or_host) or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def warn_if_plain(url: str, who: str) -> None:
    """Say so when the token and the model would cross a network in clear text."""
    if urlsplit(url).scheme == "http" and not is_loopback(url):
        log.warning("%s: plain HTTP to %s: the token and the model travel unencrypted; use https with a CA "
                    "(--ca) across any network you do not control", who, url)


def make_authority(directory: Path, hosts: list[str], days: int = 365) -> TlsFiles:
    """Write a new CA and a syncer certificate for `hosts` (DNS names or IP addresses) signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("a syncer certificate needs at least one host name or address")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "decoupled-diloco CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return files
