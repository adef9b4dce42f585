"""TLS material and SuperNode authentication keys, generated with ``cryptography`` only.

Layout written by :func:`write_certs` (what ``flower-superlink`` / ``flower-supernode`` of
Flower 1.39 accept, checked end to end on 127.0.0.1)::

    DIR/tls/ca.crt        self-signed CA (EC P-384); every SuperNode and the operator's CLI trust it
    DIR/tls/ca.key        the CA's private key (PKCS8 PEM, mode 0600): keep it offline
    DIR/tls/server.crt    SuperLink certificate signed by the CA; SAN = the given hosts / IPs
    DIR/tls/server.key    its private key (PKCS8 PEM, mode 0600)
    DIR/keys/node_<i>     SuperNode i's private key: EC P-384, OpenSSH private format (0600)
    DIR/keys/node_<i>.pub its public key, OpenSSH format (``flwr supernode register`` takes it)

The SuperLink serves the Fleet API (gRPC), the Control API and its runtime API with the same
certificate; its own SuperExec connects to ``127.0.0.1``, so ``127.0.0.1`` is always in the SAN.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedlora.config import ConfigError

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
LOOPBACK = "127.0.0.1"


@dataclass
class CertPaths:
    """Where :func:`write_certs` put each file."""

    root: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: list[Path] = field(default_factory=list)  # private keys; public = same + ".pub"

    @staticmethod
    def at(root: str | Path, num_nodes: int = 0) -> CertPaths:
        root = Path(root).resolve()
        tls = root / "tls"
        return CertPaths(
            root=root,
            ca_cert=tls / "ca.crt",
            ca_key=tls / "ca.key",
            server_cert=tls / "server.crt",
            server_key=tls / "server.key",
            node_keys=[root / "keys" / f"node_{i}" for i in range(num_nodes)],
        )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:  # create with 0600 directly: the key is never world-readable, not even briefly
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(path, 0o600)
    else:
        path.write_bytes(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def san_entries(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names: IP addresses as IPAddress, everything else as DNSName."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, LOOPBACK]):  # keep order, drop duplicates, always 127.0.0.1
        host = host.strip()
        if not host:
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if any(ch.isspace() or ch in "/:@" for ch in host):
                raise ConfigError(
                    f"--hosts: {host!r} is neither an IP address nor a host name; give e.g. "
                    "--hosts superlink.example.org 10.0.0.5"
                ) from None
            names.append(x509.DNSName(host))
    return names


def make_ca(days: int = 365) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed EC P-384 certificate authority."""
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlora-ca")])
    usage = x509.KeyUsage(
        digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
        key_encipherment=False, data_encipherment=False, key_agreement=False,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: Sequence[str], days: int = 365
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The SuperLink's certificate for ``hosts`` (names and IPs; 127.0.0.1 is always added)."""
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP384R1())
    names = san_entries(hosts)
    common = str(names[0].value)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def write_node_key(path: str | Path) -> Path:
    """A SuperNode key pair: EC P-384, OpenSSH private key at ``path``, public key at ``path.pub``."""
    path = Path(path)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(path, private, private=True)
    _write(public_key_path(path), public + b"\n")
    return path


def public_key_path(private_key: str | Path) -> Path:
    private_key = Path(private_key)
    return private_key.with_name(private_key.name + ".pub")


def write_certs(
    out_dir: str | Path, hosts: Sequence[str] = DEFAULT_HOSTS, num_nodes: int = 0, days: int = 365
) -> CertPaths:
    """Write a CA, a SuperLink certificate for ``hosts`` and ``num_nodes`` SuperNode key pairs."""
    if num_nodes < 0:
        raise ConfigError(f"--nodes must be >= 0, got {num_nodes}")
    if days < 1:
        raise ConfigError(f"--days must be >= 1 (a certificate valid for {days} days is already expired), got {days}")
    paths = CertPaths.at(out_dir, num_nodes)
    if paths.ca_cert.exists():
        raise ConfigError(f"{paths.ca_cert} already exists; choose an empty folder (certificates are never overwritten)")
    ca_key, ca_cert = make_ca(days)
    server_key, server_cert = make_server_cert(ca_key, ca_cert, hosts, days)
    pem = serialization.Encoding.PEM
    _write(paths.ca_cert, ca_cert.public_bytes(pem))
    _write(paths.ca_key, _pem_key(ca_key), private=True)
    _write(paths.server_cert, server_cert.public_bytes(pem))
    _write(paths.server_key, _pem_key(server_key), private=True)
    for key_path in paths.node_keys:
        write_node_key(key_path)
    return paths
