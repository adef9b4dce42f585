"""A federation of separate hosts, one command per role, on Flower's own processes.

``fedlora deploy operator DIR``: writes the federation (CA, SuperLink certificate, a kit per silo,
:mod:`fedlora.app.deploy.kit`) the first time, checks (:mod:`fedlora.app.deploy.preflight`), starts
``flower-superlink`` with TLS and SuperNode authentication, registers every silo's public key,
writes the node ids the SuperLink assigned (``DIR/nodes.json``: the run's binding of node ids to
partitions), prints the one command each silo runs, and stays up, saying as they happen which
silos joined or left, until Ctrl-C / SIGTERM stop it and everything it started.

``fedlora deploy silo KIT --data FILE``: checks, starts ``flower-supernode`` (TLS, its key, node
config ``partition-id`` / ``num-partitions`` / ``data-path``) and fedlora's warm SuperExec beside it
(or Flower's own, ``--clientapp cold`` or on another Flower), says when the SuperLink accepted it,
and stays up across runs until stopped.

``fedlora deploy run DIR CONFIG``: checks, waits until every silo is online (``silos joined k/n`` as
they come), submits CONFIG with ``flwr run`` (the resolved experiment, the node binding), prints the
ServerApp's round lines as it sends them (``flwr log --stream``) and the results' path.

Each check that fails is one line naming the host and the fix; nothing starts until all passed.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.app.deploy.flwr_cli import (
    HOST,
    SUPERLINK_READY,
    SUPERNODE_READY,
    DeployError,
    FlwrCli,
    failure_reason,
    flower_env,
    log_stream_cmd,
    progress_of,
    superlink_cmd,
    supernode_cmd,
    warm_superexec_cmd,
)
from fedlora.app.deploy.kit import (
    FEDERATION_FILE,
    KIT_KEY,
    NODES_FILE,
    DataContract,
    Federation,
    certs_of,
    load_federation,
    load_kit,
    parse_silos,
    split_address,
    write_federation,
)
from fedlora.app.deploy.preflight import Check, operator_checks, silo_checks
from fedlora.app.deploy.processes import (
    INTERRUPT_GRACE,
    STOP_GRACE,
    Daemon,
    port_open,
    processes_with_home,
    stop_daemons,
    terminate_on_signals,
)
from fedlora.config import ConfigError

logger = logging.getLogger("fedlora")

START_TIMEOUT = 90.0  # seconds a SuperLink or SuperNode may take to come up
ACTIVATED = re.compile(r"\[Fleet\.ActivateNode\] Activated node_id=(\d+)")  # the SuperLink's log line
DEFAULT_CONTROL_PORT = 9093
DEFAULT_SUPERNODE_PORT = 9094


class PreflightFailed(DeployError):
    """Checks that failed: one line each (:attr:`lines`); nothing was started."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def run_checks(checks: Any, where: str) -> None:
    """Say each passed check (``check ok: ...``); :class:`PreflightFailed` with every failed one
    (``where: ...``, one line each) once all ran."""
    failed = []
    for check in checks:
        assert isinstance(check, Check)
        if check.ok:
            logger.info("check ok: %s", check.line)
        else:
            failed.append(f"{where}: {check.line}")
    if failed:
        raise PreflightFailed(failed)


def _stop(daemons: list[Daemon], home: Path, interrupted: bool) -> None:
    stop_daemons(daemons, grace=INTERRUPT_GRACE if interrupted else STOP_GRACE, others=processes_with_home(home))


# ---------------------------------------------------------------------------------------- operator
def data_contract(config: str | Path | None) -> DataContract:
    """The columns and class names of the experiment ``config`` (read from its data.source here)."""
    if config is None:
        return DataContract()
    from fedlora.app.runner import resolve
    from fedlora.data import build_federated_data

    cfg = resolve(config, None)
    labels = build_federated_data(cfg.data).label_names
    return DataContract(text_column=cfg.data.text_column, label_column=cfg.data.label_column, labels=list(labels))


def open_federation(root: Path, address: str | None, listen: str | None, control_port: int | None,
                    silos: list[str], silo_keys: list[str], config: str | None, days: int) -> Federation:
    """The federation in ``root``: written now from the options if there is none yet, else read (and
    the creation options, if given, must agree with it)."""
    if (root / FEDERATION_FILE).is_file():
        federation = load_federation(root)
        if (address and address != federation.address) or silos or silo_keys or config:
            raise ConfigError(f"{root} holds a federation already ({federation.address}, silos "
                              f"{', '.join(s.name for s in federation.silos)}): start it with fedlora deploy operator "
                              f"{root} alone, or write another in a new folder")
        return federation
    if not address:
        raise ConfigError(f"no federation in {root} yet: give --address HOST:PORT (what the silos dial) and --silos")
    host, _ = split_address(address)
    named = parse_silos(silos, silo_keys)
    bind = listen or (host if _is_ip(host) else "0.0.0.0")  # the Fleet API is for the silos' hosts
    federation = write_federation(root, address, bind, control_port or DEFAULT_CONTROL_PORT, named,
                                  data_contract(config), days)
    logger.info("federation written: %s (CA and SuperLink certificate for %s, a kit per silo in %s/silos/)",
                root, host, root)
    return federation


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def handover_lines(root: Path, federation: Federation) -> list[str]:
    """For each silo: the files it gets and the one command it runs."""
    lines = []
    for silo in federation.silos:
        kit = root / "silos" / silo.name
        own = not (kit / KIT_KEY).is_file()
        key = " --key YOUR_PRIVATE_KEY" if own else ""
        lines.append(f"silo {silo.name} (partition {silo.partition}): copy {kit}/ to its host "
                     f"({'silo.json, ca.crt, node.key.pub; it keeps its own private key' if own else 'silo.json, ca.crt, node.key'}),"
                     f" then run there: fedlora deploy silo {silo.name} --data ITS_DATA_FILE{key}")
    return lines


@dataclass
class Roster:
    """The operator's view of who joined: node id -> silo name, the ones that joined."""

    names: dict[int, str]
    joined: set[int]

    def line(self, node_id: int) -> str:
        self.joined.add(node_id)
        name = self.names.get(node_id, f"? (node {node_id} is no silo of this federation)")
        return f"silo {name} joined (node {node_id}): {len(self.joined & set(self.names))}/{len(self.names)} silos"


def operator(root: str | Path, address: str | None = None, listen: str | None = None,
             control_port: int | None = None, silos: list[str] | None = None, silo_keys: list[str] | None = None,
             config: str | None = None, days: int = 365) -> None:
    """``fedlora deploy operator``: see the module's docstring. Returns when stopped (Ctrl-C: a
    KeyboardInterrupt, SIGTERM: :class:`~fedlora.app.deploy.processes.Terminated`, raised on)."""
    root = Path(root).resolve()
    federation = open_federation(root, address, listen, control_port, silos or [], silo_keys or [], config, days)
    run_checks(operator_checks(root, federation, starting=True), f"operator ({federation.listen})")
    homes, certs = root / "flwr", certs_of(root)
    (root / NODES_FILE).unlink(missing_ok=True)  # the binding of an earlier start: node ids change with the SuperLink
    daemons: list[Daemon] = []
    interrupted = False
    try:
        with terminate_on_signals():
            superlink = Daemon("superlink", superlink_cmd(federation.control_port, federation.fleet_port, certs,
                                                          fleet_host=federation.listen),
                               flower_env(homes / "superlink"), root / "logs" / "superlink.log")
            daemons.append(superlink)
            _wait_superlink(superlink, federation)
            logger.info("link up: SuperLink's Fleet API on %s:%d for the silos (%s; TLS, SuperNode authentication), "
                        "Control API on %s:%d", federation.listen, federation.fleet_port, federation.address, HOST,
                        federation.control_port)
            names = _register(root, federation, homes)
            for line in handover_lines(root, federation):
                logger.info("%s", line)
            logger.info("ready: waiting for %d silos; runs: fedlora deploy run %s CONFIG; Ctrl-C stops the "
                        "federation", len(federation.silos), root)
            _follow_joins(superlink, Roster(names, set()))
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        _stop(daemons, homes, interrupted)


def _wait_superlink(superlink: Daemon, federation: Federation) -> None:
    started = time.monotonic()
    ready = superlink.wait_for(SUPERLINK_READY, START_TIMEOUT)
    while ready and not port_open(HOST, federation.control_port):
        if time.monotonic() - started > START_TIMEOUT or not superlink.alive():
            ready = False
        time.sleep(0.1)
    if not ready:
        raise DeployError(f"the SuperLink did not start: {failure_reason(superlink.text())} "
                          f"(log: {superlink.log_path})")


def _register(root: Path, federation: Federation, homes: Path) -> dict[int, str]:
    """Register every silo's public key; write nodes.json (node id -> partition, silo); node id -> name."""
    cli = FlwrCli(homes / "cli", 120.0)
    cli.connect(federation.control_port, certs_of(root).ca_cert)
    nodes: dict[str, dict[str, Any]] = {}
    for silo in federation.silos:
        node_id = cli.register(root / silo.public_key)
        nodes[str(node_id)] = {"partition": silo.partition, "silo": silo.name}
    (root / NODES_FILE).write_text(json.dumps(nodes, indent=2) + "\n", encoding="utf-8")
    return {int(node): entry["silo"] for node, entry in nodes.items()}


def _follow_joins(superlink: Daemon, roster: Roster) -> None:
    """Say which silo joined (again, after a restart), from the SuperLink's own log as it writes it,
    until the SuperLink exits. (Flower 1.39 logs no line when a node leaves: ``flwr supernode list``
    shows who is online, and ``fedlora deploy run`` checks it before it submits.)"""
    offset = 0
    while True:
        text = superlink.text()
        for line in text[offset:].splitlines(keepends=True):
            if not line.endswith("\n"):
                break  # a line being written: read it whole next time
            offset += len(line)
            match = ACTIVATED.search(line)
            if match:
                logger.info("%s", roster.line(int(match.group(1))))
        if not superlink.alive():
            raise DeployError(f"the SuperLink exited: {failure_reason(superlink.text())} (log: {superlink.log_path})")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------- silo
def silo(kit_dir: str | Path, data: str | Path, key: str | Path | None = None, host: str = HOST,
         port: int = DEFAULT_SUPERNODE_PORT, clientapp: str = "warm", rank: int | None = None,
         home: str | Path | None = None) -> None:
    """``fedlora deploy silo``: see the module's docstring. Returns when stopped (raised on)."""
    from fedlora import protocol
    from fedlora.app.deploy.federation import clientapp_mode

    kit_dir = Path(kit_dir).resolve()
    kit = load_kit(kit_dir)
    data_path = Path(data).expanduser().resolve()
    key_path = Path(key).expanduser().resolve() if key else kit_dir / KIT_KEY
    where = f"silo {kit.name} ({host})"
    run_checks(silo_checks(kit_dir, kit, key_path, data_path, host, port), where)
    mode = clientapp_mode(clientapp)
    homes = Path(home).resolve() if home else kit_dir / "flwr"
    node_config: dict[str, Any] = {protocol.NODE_PARTITION_ID: kit.partition,
                                   protocol.NODE_NUM_PARTITIONS: kit.num_partitions,
                                   protocol.NODE_DATA_PATH: str(data_path)}
    if rank is not None:
        node_config[protocol.NODE_RANK] = rank
    daemons: list[Daemon] = []
    interrupted = False
    try:
        with terminate_on_signals():
            cmd = supernode_cmd(0, port, node_config, key_path, kit_dir / "ca.crt", max_retries=3,
                                own_superexec=mode == "warm", superlink=kit.superlink, host=host)
            supernode = Daemon("supernode", cmd, flower_env(homes), kit_dir / "logs" / "supernode.log")
            daemons.append(supernode)
            if mode == "warm":
                daemons.append(Daemon("superexec", warm_superexec_cmd(port, supernode.process.pid, host),
                                      flower_env(homes), supernode.log_path, share_log=supernode))
            if not supernode.wait_for(SUPERNODE_READY, START_TIMEOUT) or not supernode.alive():
                raise DeployError(f"{where}: the SuperLink at {kit.superlink} did not accept this silo: "
                                  f"{failure_reason(supernode.text())} (log: {supernode.log_path})")
            node_id = _node_id(supernode.text())
            logger.info("joined: silo %s is node %s of the federation at %s (partition %d, data %s, %s ClientApps); "
                        "serving runs until stopped (Ctrl-C)", kit.name, node_id, kit.superlink, kit.partition,
                        data_path, mode)
            while all(daemon.alive() for daemon in daemons):
                time.sleep(0.5)
            gone = next(daemon for daemon in daemons if not daemon.alive())
            raise DeployError(f"{where}: its {gone.name} exited: {failure_reason(gone.text())} (log: {gone.log_path})")
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        _stop(daemons, homes, interrupted)


def _node_id(log: str) -> str:
    match = re.search(rf"{re.escape(SUPERNODE_READY)}\s*(\d+)", log)
    return match.group(1) if match else "?"


# ---------------------------------------------------------------------------------------- run
def submit(root: str | Path, config: str | Path, overrides: list[str] | None = None, out_dir: str | Path | None = None,
           timeout: float = 3600.0, join_timeout: float = 300.0, overwrite: bool = False) -> dict[str, Any]:
    """``fedlora deploy run``: see the module's docstring; the run's results dict."""
    from fedlora.app.deploy.local import app_dir, write_run_config
    from fedlora.app.folders import claim
    from fedlora.app.runner import check_inputs, resolve
    from fedlora.results import load_results

    root = Path(root).resolve()
    federation = load_federation(root)
    experiment = resolve(config, overrides)
    silos = len(federation.silos)
    if experiment.data.num_clients != silos:
        raise ConfigError(f"the federation {root} has {silos} silos, the experiment data.num_clients = "
                          f"{experiment.data.num_clients}: add --set data.num_clients={silos}")
    run_checks(operator_checks(root, federation, starting=False), f"operator ({root})")
    logger.info("link up: SuperLink at %s (Control API %s:%d)", federation.address, HOST, federation.control_port)
    out = Path(out_dir or experiment.output.dir).resolve()
    folder = claim(out, what="run", overwrite=overwrite)
    experiment.output.dir = str(out)
    check_inputs(experiment)  # the model and the server's data, here, before anything is submitted
    folder.take()
    out.mkdir(parents=True, exist_ok=True)
    cli = FlwrCli(root / "flwr" / "cli", 120.0)
    nodes = json.loads((root / NODES_FILE).read_text(encoding="utf-8"))
    started = time.monotonic()
    _wait_joined(cli, nodes, join_timeout)
    run_config = write_run_config(experiment, out / "run_config.toml", nodes=nodes)  # with the binding
    run_id = 0
    try:
        with terminate_on_signals():
            run_id = cli.run(app_dir(), run_config)
            logger.info("run %d submitted: %s, %d rounds over %d silos", run_id, experiment.strategy.name,
                        experiment.train.rounds, silos)
            status = _follow(cli, root, run_id, timeout)
    except KeyboardInterrupt:
        if run_id:
            cli.stop(run_id)
        raise
    if status.get("status") != "finished:completed":
        details = " ".join(str(status.get("status-details", "")).split())
        raise DeployError(f"run {run_id} ended {status.get('status')}: {details} (log: {root}/logs/serverapp-{run_id}.log)")
    results = load_results(out / "results.json")
    results["deployment"] = {"run_id": run_id, "silos": silos, "address": federation.address,
                             "flower_run": {k: status.get(k) for k in ("status", "elapsed", "network-traffic")},
                             "seconds": round(time.monotonic() - started, 2)}
    (out / "deployment.json").write_text(json.dumps(results["deployment"], indent=2), encoding="utf-8")
    return results


def _wait_joined(cli: FlwrCli, nodes: dict[str, dict[str, Any]], timeout: float, poll: float = 2.0) -> None:
    """Wait until every silo's node is online, saying ``silos joined k/n`` as the count changes."""
    deadline = time.monotonic() + timeout
    shown = -1
    while True:
        status = cli.nodes()
        online = sorted(entry["silo"] for node, entry in nodes.items() if status.get(int(node)) == "online")
        if len(online) != shown:
            logger.info("silos joined %d/%d%s", len(online), len(nodes), f": {', '.join(online)}" if online else "")
            shown = len(online)
        if len(online) == len(nodes):
            return
        if time.monotonic() > deadline:
            missing = sorted(entry["silo"] for entry in nodes.values() if entry["silo"] not in online)
            raise DeployError(f"silos joined {len(online)}/{len(nodes)} within {timeout:.0f}s: {', '.join(missing)} "
                              "not online: start each on its host (fedlora deploy silo KIT --data FILE)")
        time.sleep(poll)


def _follow(cli: FlwrCli, root: Path, run_id: int, timeout: float, poll: float = 3.0) -> dict[str, Any]:
    """The ServerApp's progress lines as it sends them (``flwr log --stream``), until the run ended;
    its ``flwr ls`` row."""
    def show(line: str) -> None:
        progress = progress_of(line)
        if progress:
            logger.info("%s", progress)

    stream = Daemon(f"serverapp-{run_id}", log_stream_cmd(run_id), flower_env(root / "flwr" / "cli"),
                    root / "logs" / f"serverapp-{run_id}.log", on_line=show)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not stream.alive():
                row = cli.run_status(run_id)
                if str(row.get("status", "")).startswith("finished"):
                    stream.drained()
                    return row
            if time.monotonic() > deadline:
                cli.stop(run_id)
                raise DeployError(f"run {run_id} did not finish within {timeout:.0f}s; stopped it "
                                  f"(log: {stream.log_path})")
            time.sleep(poll if not stream.alive() else 1.0)
    finally:
        stop_daemons([stream], grace=3.0)
