"""Throwaway TLS material for tests and benchmarks: a CA, and certificates it signs for 127.0.0.1.

Never for production: keys are unencrypted files and certificates live a day. Needs ``cryptography``
(the ``dev`` and ``bench`` extras).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from memstore.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str


def _key():  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key) -> None:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key_path.chmod(0o600)


def make_tls(directory: str | Path, name: str = "memstore", hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, TlsFiles]:
    """A CA ``<dir>/<name>-ca.pem`` and two identities it signed for ``hosts``: ``"server"`` (stores) and
    ``"client"`` (trainers, CLI). Both may serve and connect (stores use theirs as client certificate too)."""
    try:
        from cryptography import x509
    except ImportError:
        raise ConfigError("throwaway TLS certificates need 'cryptography' (in the dev extra): pip install cryptography") from None
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / f"{name}-ca", ca, ca_key)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    files: dict[str, TlsFiles] = {}
    for role in ("server", "client"):
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} {role}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(out / f"{name}-{role}", cert, key)
        files[role] = TlsFiles(str(out / f"{name}-ca.pem"), str(out / f"{name}-{role}.pem"), str(out / f"{name}-{role}.key"))
    return files
