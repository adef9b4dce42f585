"""Preflight of a federation of separate hosts: one line per check, before anything starts.

A silo, before its SuperNode starts (:func:`silo_checks`): the same fedlora and Flower as the
operator's, the federation's CA valid now, its key the one the operator registered, its data file
readable with the federation's columns and class names, the SuperLink's port reachable, the
SuperLink's certificate signed by the kit's CA, naming the host the silo dials and not expired
(a TLS handshake, as the SuperNode's own), its Runtime API port free. The operator, before its
SuperLink starts and before a run (:func:`operator_checks`): the same versions as the federation
was written with, certificates valid now, the ports free (start) or the SuperLink up (run).

Each check is a :class:`Check`: passed, or one line that names the host and the fix. A check that
depends on an earlier one (the TLS handshake on a reachable port) is skipped after that one
failed, so that one fault is one line. The checks that need the run's config on both sides (the
silo's data against that config's classes, a client that can take part in secure aggregation, the
versions every silo runs) are the run's first step: its query of every silo, before round 1
(:class:`fedlora.strategies.roster.PreflightError`).
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from fedlora.app.deploy.certs import public_key_path
from fedlora.app.deploy.kit import (
    FEDERATION_FILE,
    NODES_FILE,
    DataContract,
    Federation,
    SiloKit,
    Versions,
    certs_of,
    installed_versions,
    split_address,
)

CONNECT_TIMEOUT = 5.0  # seconds a TCP connect or TLS handshake to the SuperLink may take


@dataclass
class Check:
    """One preflight check: ``ok``, and its line (what passed, or the fault and its fix)."""

    ok: bool
    line: str


def version_check(mine: Versions, theirs: Versions, here: str, there: str) -> Check:
    """fedlora and Flower of this host (``here``) against ``theirs`` (``there``: the operator, the federation)."""
    for package, have, want in (("fedlora", mine.fedlora, theirs.fedlora), ("Flower", mine.flower, theirs.flower)):
        if have != want:
            pin = "fedlora" if package == "fedlora" else "flwr"
            return Check(False, f"{here} runs {package} {have}, {there} runs {package} {want}: install {pin} {want} here "
                                "(every host of a federation runs the same fedlora and Flower)")
    return Check(True, f"versions: fedlora {mine.fedlora}, Flower {mine.flower}, as {there}")


def certificate_check(path: Path, what: str, fix: str) -> Check:
    """The PEM certificate at ``path`` readable and valid now."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return Check(False, f"{what} {path} is not a readable PEM certificate: {fix}")
    now = dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        return Check(False, f"{what} {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: {fix}")
    if now < cert.not_valid_before_utc:
        return Check(False, f"{what} {path} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: "
                            "check this host's clock")
    return Check(True, f"{what}: valid until {cert.not_valid_after_utc:%Y-%m-%d}")


def key_check(private_key: Path, registered: Path) -> Check:
    """The silo's private key readable and the private half of the public key the operator registered."""
    try:
        key = serialization.load_ssh_private_key(private_key.read_bytes(), password=None)
    except FileNotFoundError:
        return Check(False, f"no private key at {private_key}: pass --key PATH, the private half of {registered}")
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm):
        return Check(False, f"{private_key} is not a readable OpenSSH private key (unencrypted): pass --key PATH")
    try:
        public = serialization.load_ssh_public_key(registered.read_bytes())
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm):
        return Check(False, f"the kit's public key {registered} is not readable: ask the operator for the kit again")
    mine = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if mine != public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH):
        return Check(False, f"{private_key} is not the key the operator registered ({registered}): pass --key with "
                            "that key's private half")
    return Check(True, f"key: {private_key}, the one the operator registered")


def data_check(path: Path, contract: DataContract) -> Check:
    """The silo's data file readable with the federation's columns and class names (at least 3 rows)."""
    from fedlora.data.silo import encode_to_server_labels
    from fedlora.data.sources import DataError, read_local

    where = f"--data {path}"
    if not path.exists():
        return Check(False, f"{where}: not found on this host: give the silo's CSV / JSONL file or save_to_disk folder")
    try:
        columns = read_local(path, contract.text_column, contract.label_column, where)
        if contract.labels:
            encode_to_server_labels(columns.labels, columns.label_names, contract.labels, where)
    except DataError as error:
        return Check(False, " ".join(str(error).split()))
    if len(columns.texts) < 3:
        return Check(False, f"{where}: {len(columns.texts)} rows; a silo needs at least 3 (train / val / test)")
    labels = f"labels among the federation's {len(contract.labels)} classes" if contract.labels else (
        "labels not checked (the operator gave no --config)")
    return Check(True, f"data: {path}, {len(columns.texts)} rows, columns '{contract.text_column}' / "
                       f"'{contract.label_column}', {labels}")


def reachable_check(address: str) -> Check:
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return Check(False, f"cannot reach the SuperLink at {address} ({reason}): check that the operator's SuperLink "
                            f"runs (fedlora deploy operator) and that TCP port {port} of {host} is open to this host")
    return Check(True, f"SuperLink reachable: {address}")


def tls_check(address: str, ca_cert: Path) -> Check:
    """A TLS handshake with the SuperLink's Fleet API, as the SuperNode's: the chain up to the kit's
    CA, the host name (or IP) the silo dials, the validity dates; HTTP/2 (gRPC) offered."""
    host, port = split_address(address)
    context = ssl.create_default_context(cafile=str(ca_cert))
    context.set_alpn_protocols(["h2"])
    try:
        with (socket.create_connection((host, port), timeout=CONNECT_TIMEOUT) as raw,
              context.wrap_socket(raw, server_hostname=host) as tls):
            version = tls.version()
    except ssl.SSLCertVerificationError as error:
        reason = error.verify_message or str(error)
        if "expired" in reason:
            fix = "the operator writes new certificates (a new federation folder) and hands out the kits again"
        elif "mismatch" in reason:
            fix = f"the certificate does not name {host}: dial the host it names, or the operator writes it for {host}"
        else:
            fix = ("it is not signed by this kit's CA (ca.crt): the kit belongs to another federation, ask the "
                   "operator for this federation's kit")
        return Check(False, f"the SuperLink at {address} presents a certificate that fails verification ({reason}): "
                            f"{fix}")
    except (OSError, ssl.SSLError) as error:
        return Check(False, f"no TLS handshake with the SuperLink at {address} ({' '.join(str(error).split())}): "
                            "check that it is the federation's SuperLink (TLS on)")
    return Check(True, f"TLS: {version}, the SuperLink's certificate is signed by the kit's CA and names {host}")


def port_free_check(host: str, port: int, what: str) -> Check:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            return Check(False, f"{what} {host}:{port} cannot be opened ({error.strerror}): another process holds it; "
                                "choose another port")
    return Check(True, f"{what}: {host}:{port} free")


def silo_checks(kit_dir: Path, kit: SiloKit, key: Path, data: Path, host: str, port: int) -> Iterator[Check]:
    """The checks a silo makes before its SuperNode starts (see the module's docstring)."""
    yield version_check(installed_versions(), kit.versions, "this host", "the federation's operator")
    ca = certificate_check(kit_dir / "ca.crt", "the federation's CA certificate",
                           "the operator writes new certificates (a new federation folder) and hands out the kits again")
    yield ca
    yield key_check(key, public_key_path(kit_dir / "node.key"))
    yield data_check(data, kit.data)
    reachable = reachable_check(kit.superlink)
    yield reachable
    if reachable.ok and ca.ok:
        yield tls_check(kit.superlink, kit_dir / "ca.crt")
    yield port_free_check(host, port, "the SuperNode's Runtime API")


def operator_checks(root: Path, federation: Federation, starting: bool) -> Iterator[Check]:
    """The operator's checks: before its SuperLink starts (``starting``: the ports free) or before a run
    (the SuperLink up, its nodes registered)."""
    yield version_check(installed_versions(), federation.versions, "this host", f"the federation {root}")
    certs = certs_of(root)
    fix = "write a new federation (fedlora deploy operator NEW_DIR ...) and hand out its kits"
    yield certificate_check(certs.ca_cert, "the federation's CA certificate", fix)
    yield certificate_check(certs.server_cert, "the SuperLink's certificate", fix)
    if starting:
        yield port_free_check(federation.listen, federation.fleet_port, "the Fleet API")
        yield port_free_check("127.0.0.1", federation.control_port, "the Control API")
        return
    from fedlora.app.deploy.processes import port_open

    if not (root / NODES_FILE).is_file() or not port_open("127.0.0.1", federation.control_port):
        yield Check(False, f"the federation's SuperLink is not running (no Control API on 127.0.0.1:"
                           f"{federation.control_port}): start it on this host: fedlora deploy operator {root}")
    else:
        yield Check(True, f"SuperLink up: Control API 127.0.0.1:{federation.control_port} ({FEDERATION_FILE}: {root})")
