"""A federation of separate hosts, on file: what ``fedlora deploy operator`` writes and hands each silo.

    DIR/federation.json         the federation: the address silos dial, the Fleet API's listen address, the
                                Control API's port, the fedlora and Flower versions, the silos, the data contract
    DIR/certs/tls/              CA and SuperLink certificate (:mod:`fedlora.app.deploy.certs`); ca.key stays here
    DIR/silos/<name>/           a silo's kit, copied to that silo's host:
        silo.json               its name, partition, the SuperLink's address, the versions, the data contract
        ca.crt                  the federation's CA (the silo checks the SuperLink's certificate against it)
        node.key, node.key.pub  its SuperNode key pair, written by the operator; a silo that made its own key
                                (``--silo-key NAME=PUB``) gets node.key.pub only and keeps its private key
    DIR/nodes.json              written when the SuperLink starts: node id -> partition and silo (the SuperLink
                                assigns a node id to each registered key; ``fedlora deploy run`` binds them)

The data contract (``--config``): the text and label columns and the class names of the experiment,
so that a silo checks its data file before it joins.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedlora.app.deploy.certs import CertPaths, public_key_path, write_certs, write_node_key
from fedlora.config import ConfigError

FEDERATION_FILE = "federation.json"
KIT_FILE = "silo.json"
NODES_FILE = "nodes.json"
KIT_KEY = "node.key"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class DataContract(BaseModel):
    """What a silo's data file must hold: these columns, labels among these class names."""

    model_config = ConfigDict(extra="forbid")

    text_column: str = "text"
    label_column: str = "label"
    labels: list[str] = Field(default_factory=list)  # empty: not known (the operator gave no --config)


class Versions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fedlora: str
    flower: str


class SiloEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    partition: int
    public_key: str  # relative to the federation folder


class Federation(BaseModel):
    """``DIR/federation.json``."""

    model_config = ConfigDict(extra="forbid")

    address: str  # host:port of the Fleet API, as the silos dial it (the certificate names the host)
    listen: str  # the IP the Fleet API binds
    control_port: int  # the Control API, on 127.0.0.1 of the operator's host
    versions: Versions
    data: DataContract = Field(default_factory=DataContract)
    silos: list[SiloEntry]

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    @property
    def fleet_port(self) -> int:
        return split_address(self.address)[1]


class SiloKit(BaseModel):
    """``<kit>/silo.json``: what one silo needs to join."""

    model_config = ConfigDict(extra="forbid")

    name: str
    partition: int
    num_partitions: int
    superlink: str  # host:port of the Fleet API
    versions: Versions
    data: DataContract = Field(default_factory=DataContract)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); a ConfigError otherwise."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--address {address!r}: give HOST:PORT, e.g. superlink.example.org:9092")
    return host, int(port)


def installed_versions() -> Versions:
    from importlib.metadata import version

    from fedlora.version import __version__

    return Versions(fedlora=__version__, flower=version("flwr"))


def _read(path: Path, model: type[BaseModel], what: str) -> BaseModel:
    try:
        return model.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: {what}") from None
    except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        detail = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
        raise ConfigError(f"{path} is not a fedlora {KIT_FILE if model is SiloKit else FEDERATION_FILE}: "
                          f"{' '.join(detail.split())}") from None


def load_federation(root: Path) -> Federation:
    federation = _read(root / FEDERATION_FILE, Federation,
                       f"no federation in {root}; write one: fedlora deploy operator {root} --address HOST:PORT "
                       "--silos NAME ...")
    assert isinstance(federation, Federation)
    return federation


def load_kit(kit: Path) -> SiloKit:
    loaded = _read(kit / KIT_FILE, SiloKit, f"{kit} is not a silo's kit (the folder fedlora deploy operator wrote for "
                   "this silo under DIR/silos/<name>/)")
    assert isinstance(loaded, SiloKit)
    return loaded


def certs_of(root: Path) -> CertPaths:
    return CertPaths.at(root / "certs")


def parse_silos(names: list[str], own_keys: list[str]) -> dict[str, Path | None]:
    """``--silos a b`` and ``--silo-key c=c.pub``: silo name -> its own public key (None: the operator
    writes its key pair), in the order given (partition 0, 1, ...)."""
    silos: dict[str, Path | None] = {}
    for item in [*names, *own_keys]:
        name, _, key = item.partition("=") if item in own_keys else (item, "", "")
        if not _NAME.match(name):
            raise ConfigError(f"silo name {name!r}: letters, digits, '.', '_' and '-' only (up to 64)")
        if name in silos:
            raise ConfigError(f"silo {name!r} is named twice")
        if item in own_keys and not key:
            raise ConfigError(f"--silo-key {item!r}: give NAME=PATH of the silo's public key (OpenSSH format)")
        silos[name] = Path(key).expanduser().resolve() if key else None
    if not silos:
        raise ConfigError("a federation needs silos: --silos NAME ... (the operator writes their keys) or "
                          "--silo-key NAME=PUBLIC_KEY (a silo's own key)")
    return silos


def write_federation(root: Path, address: str, listen: str, control_port: int, silos: dict[str, Path | None],
                     data: DataContract, days: int = 365) -> Federation:
    """Write a new federation into the empty or new folder ``root``: certificates for the host of
    ``address``, a kit per silo (key pairs unless the silo gave its own public key), federation.json."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    host, _ = split_address(address)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root} is not empty and holds no {FEDERATION_FILE}; choose a new folder for the federation")
    for name, key in silos.items():
        if key is not None:
            try:
                serialization.load_ssh_public_key(key.read_bytes())
            except (OSError, ValueError, TypeError, UnsupportedAlgorithm):
                raise ConfigError(f"--silo-key {name}={key}: not a readable OpenSSH public key (the silo makes it with "
                                  f"ssh-keygen -t ecdsa -b 384 -N '' -f {name})") from None
    certs = write_certs(root / "certs", hosts=[host], days=days)
    versions = installed_versions()
    entries = []
    for partition, (name, key) in enumerate(silos.items()):
        kit = root / "silos" / name
        kit.mkdir(parents=True)
        shutil.copyfile(certs.ca_cert, kit / "ca.crt")
        if key is None:
            write_node_key(kit / KIT_KEY)
        else:
            shutil.copyfile(key, public_key_path(kit / KIT_KEY))
        entries.append(SiloEntry(name=name, partition=partition,
                                 public_key=str(public_key_path(kit / KIT_KEY).relative_to(root))))
        silo = SiloKit(name=name, partition=partition, num_partitions=len(silos), superlink=address,
                       versions=versions, data=data)
        (kit / KIT_FILE).write_text(silo.model_dump_json(indent=2) + "\n", encoding="utf-8")
    federation = Federation(address=address, listen=listen, control_port=control_port, versions=versions, data=data,
                            silos=entries)
    (root / FEDERATION_FILE).write_text(federation.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return federation
