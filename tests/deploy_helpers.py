"""Helpers of the deployment tests (tests/test_deploy*.py): processes a test started, the
``no_leftovers`` fixture (tests/conftest.py) uses them, a started TLS + auth federation."""

from __future__ import annotations

import json
import time
from pathlib import Path

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
    from fedlora.app.deploy.local import LocalDeployment, node_configs

    deployment = LocalDeployment(folder, nodes)
    deployment.start_superlink()
    keys = list(deployment.require_certs().node_keys)
    deployment.register(keys)
    deployment.start_supernodes(node_configs(config, nodes), keys)
    return deployment, keys
