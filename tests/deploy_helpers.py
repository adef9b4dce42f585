"""Helpers of the deployment tests (tests/test_deploy*.py): processes a test started, the
``no_leftovers`` fixture (tests/conftest.py) uses them, a started TLS + auth federation, and the
faults the tests inject into one: a SuperNode probed for refusal, a machine killed, a silo restarted.

fedlora is imported inside the functions: tests/conftest.py imports this module on every run."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]


def processes_of(folder: Path) -> list[psutil.Process]:
    """Processes whose FLWR_HOME or command line points into ``folder`` (every Flower process
    the deployment starts has one or the other, including per-message ClientApps)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            home = proc.environ().get("FLWR_HOME", "")
            if home.startswith(str(folder)) or str(folder) in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def rounds_written(out: Path) -> list[int]:
    try:
        return [r["round"] for r in json.loads((out / "results.json").read_text())["rounds"]]
    except (OSError, ValueError, KeyError):
        return []


def clients_of(out: Path) -> list[int]:
    try:
        return [r["clients"] for r in json.loads((out / "results.json").read_text())["rounds"]] or [0]
    except (OSError, ValueError, KeyError):
        return [0]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def federation(folder: Path, config, nodes: int):
    """A started TLS + auth federation (SuperLink, registered keys, SuperNodes); the deployment and keys."""
    from fedlora.app.deploy.federation import LocalDeployment
    from fedlora.app.deploy.local import node_configs

    deployment = LocalDeployment(folder, nodes)
    deployment.start_superlink()
    keys = list(deployment.require_certs().node_keys)
    deployment.register(keys)
    deployment.start_supernodes(node_configs(config, nodes), keys)
    return deployment, keys


def with_superexec(deployment, daemon) -> list:
    """A SuperNode and its warm SuperExec (if any): what stops together."""
    return [daemon] + ([deployment.superexecs[daemon.name]] if daemon.name in deployment.superexecs else [])


def kill_tree(daemon) -> None:
    """SIGKILL a process, its group and every descendant, wherever their session (a machine that
    dies: the SuperLink's SuperExec and the ServerApps it started go with it)."""
    descendants = daemon.descendants()
    daemon.signal_group(signal.SIGKILL)
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(descendants, timeout=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        daemon.process.wait(timeout=5)


def restart_supernode(deployment, index: int, node_config: dict[str, Any], key: Path | None,
                      patience: float | None = None):
    """Start SuperNode ``index`` of ``deployment`` again after it died, as a silo's supervisor would
    (systemd ``Restart=on-failure``, a Kubernetes pod): Flower keeps a killed SuperNode online until
    its heartbeat lapses (2 x 30 s by default) and refuses to activate the same key meanwhile (the
    SuperNode exits), so this retries until the SuperLink accepts it or ``patience`` s pass (None:
    Flower's heartbeat patience x interval + 30 s). With SuperNode authentication the node keeps its
    node id (it is the key's). The new SuperNode's Daemon."""
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    from fedlora.app.deploy.flwr_cli import SUPERNODE_READY, DeployError, failure_reason
    from fedlora.app.deploy.processes import stop_daemons

    if patience is None:
        patience = float(HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL) + 30.0
    deadline = time.monotonic() + patience
    attempt = 0
    while True:
        attempt += 1
        daemon = deployment.spawn_supernode(f"supernode-{index}-restart-{attempt}", node_config, key,
                                            not deployment.insecure)
        if daemon.wait_for(SUPERNODE_READY, deployment.start_timeout) and daemon.alive():
            deployment.supernodes[index] = daemon
            return daemon
        stop_daemons(with_superexec(deployment, daemon))
        if time.monotonic() > deadline:
            raise DeployError(f"SuperNode {index} was not accepted again within {patience:.0f}s: "
                              f"{failure_reason(daemon.text())} (log: {daemon.log_path})")
        time.sleep(5.0)


@dataclass
class Refusal:
    """A SuperNode the SuperLink did not accept."""

    name: str
    returncode: int | None
    seconds: float
    reason: str
    log_path: Path


def try_supernode(deployment, name: str, key: Path | None, tls: bool, timeout: float = 90.0) -> Refusal | None:
    """Start one SuperNode against ``deployment`` and wait until it is accepted (None) or gives up
    (its Refusal). Bounded: ``--max-retries`` makes a SuperNode that cannot connect exit;
    ``timeout`` stops one that neither connects nor exits."""
    from fedlora import protocol
    from fedlora.app.deploy.flwr_cli import SUPERNODE_READY, failure_reason
    from fedlora.app.deploy.processes import stop_daemons

    config = {protocol.NODE_PARTITION_ID: 0, protocol.NODE_NUM_PARTITIONS: max(1, deployment.num_nodes)}
    daemon = deployment.spawn_supernode(name, config, key, tls)
    accepted = daemon.wait_for(SUPERNODE_READY, timeout)
    seconds = time.monotonic() - daemon.started
    if accepted:
        stop_daemons(with_superexec(deployment, daemon))
        return None
    alive = daemon.alive()
    stop_daemons(with_superexec(deployment, daemon))
    reason = failure_reason(daemon.text())
    reason = reason if not alive else f"no answer within {timeout:.0f}s; {reason}"
    return Refusal(name, daemon.process.returncode, round(seconds, 2), reason, daemon.log_path)
