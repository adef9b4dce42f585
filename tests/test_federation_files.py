"""The files of a federation of separate hosts (fedlora/app/deploy/kit.py) and the silo's checks that
need no SuperLink (fedlora/app/deploy/preflight.py): fast, no process started. The checks against a
running SuperLink, end to end: tests/test_federation_hosts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509

from fedlora.app.deploy.certs import write_node_key
from fedlora.app.deploy.kit import DataContract, load_kit, parse_silos, split_address, write_federation
from fedlora.app.deploy.preflight import (
    data_check,
    key_check,
    port_free_check,
    reachable_check,
    version_check,
)
from fedlora.config import ConfigError

CONTRACT = DataContract(text_column="text", label_column="label", labels=["rotten", "fresh"])


@pytest.fixture
def federation(tmp_path: Path):
    # A federation of two silos: alpha's key pair written by the operator, gamma's own public key
    own = write_node_key(tmp_path / "gamma-host" / "gamma")
    root = tmp_path / "fed"
    written = write_federation(root, "superlink.example.org:9092", "0.0.0.0", 9093,
                               parse_silos(["alpha"], [f"gamma={own}.pub"]), CONTRACT)
    return root, written, own


def test_the_operator_writes_a_kit_per_silo_and_keeps_a_silos_own_private_key_out(federation) -> None:
    root, written, own = federation
    # Assert: partitions in the order given; alpha's kit holds its key pair, gamma's only its public key
    assert [(s.name, s.partition) for s in written.silos] == [("alpha", 0), ("gamma", 1)]
    alpha, gamma = load_kit(root / "silos" / "alpha"), load_kit(root / "silos" / "gamma")
    assert (alpha.superlink, alpha.num_partitions, alpha.data.labels) == ("superlink.example.org:9092", 2, ["rotten", "fresh"])
    assert (root / "silos" / "alpha" / "node.key").is_file() and not (root / "silos" / "gamma" / "node.key").exists()
    assert (root / "silos" / "gamma" / "node.key.pub").read_bytes() == Path(f"{own}.pub").read_bytes()
    assert gamma.partition == 1
    # the SuperLink's certificate names the host the silos dial, and 127.0.0.1 (its own processes)
    server = x509.load_pem_x509_certificate((root / "certs" / "tls" / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    assert (root / "silos" / "alpha" / "ca.crt").read_bytes() == (root / "certs" / "tls" / "ca.crt").read_bytes()
    # never overwritten: a second federation into the same folder is refused
    with pytest.raises(ConfigError, match="not empty"):
        write_federation(root, "h:1", "0.0.0.0", 9093, parse_silos(["x"], []), CONTRACT)


def test_a_silos_key_must_be_the_registered_one(federation, tmp_path: Path) -> None:
    root, _, own = federation
    gamma = root / "silos" / "gamma" / "node.key.pub"
    assert key_check(own, gamma).ok
    stranger = write_node_key(tmp_path / "stranger")
    check = key_check(stranger, gamma)
    assert not check.ok and "is not the key the operator registered" in check.line and "--key" in check.line
    assert "pass --key PATH" in key_check(tmp_path / "missing", gamma).line


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        ([{"text": "a", "label": "fresh"}] * 5, ""),
        ([{"text": "a", "label": "sour"}] * 5, "labels 'sour' are not in the server's label set ['rotten', 'fresh']"),
        ([{"body": "a", "label": "fresh"}] * 5, "text"),
        ([{"text": "a", "label": "fresh"}] * 2, "2 rows; a silo needs at least 3"),
    ],
    ids=["good", "unknown-label", "missing-column", "too-few-rows"],
)
def test_a_silos_data_is_checked_against_the_federations_columns_and_classes(tmp_path: Path, rows, problem) -> None:
    path = tmp_path / "silo.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    check = data_check(path, CONTRACT)
    assert check.ok == (problem == ""), check.line
    assert problem in check.line and "\n" not in check.line


def test_versions_ports_and_addresses_in_one_line() -> None:
    from fedlora.app.deploy.kit import Versions

    mismatch = version_check(Versions(fedlora="0.1.0", flower="1.39.0"), Versions(fedlora="0.1.0", flower="1.39.1"),
                             "this host", "the operator")
    assert not mismatch.ok and mismatch.line == ("this host runs Flower 1.39.0, the operator runs Flower 1.39.1: install "
                                                 "flwr 1.39.1 here (every host of a federation runs the same fedlora "
                                                 "and Flower)")
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_free_check("127.0.0.1", port, "the Runtime API").ok
        assert reachable_check(f"127.0.0.1:{port}").ok
    assert "Connection refused" in reachable_check(f"127.0.0.1:{port}").line
    with pytest.raises(ConfigError, match="give HOST:PORT"):
        split_address("superlink.example.org")
    with pytest.raises(ConfigError, match="named twice"):
        parse_silos(["a", "a"], [])
