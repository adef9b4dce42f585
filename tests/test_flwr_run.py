"""The Flower way: ``flwr run . --run-config 'config="configs/smoke.toml"'`` on a local simulation
federation runs fedlora's ServerApp and ClientApp (pyproject ``[tool.flwr.app]``), end to end.

``flwr`` starts its managed local SuperLink (simulation mode, detached) on first use; the test
gives it its own ``FLWR_HOME`` and ports, and stops it afterwards. The run's results equal those of
the same config on the in-process engine (FedIT) to 1e-6.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.app.runner import run_inprocess
from fedlora.config import load_config

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down",
           "clients", "failures")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_local_superlink(home: Path) -> None:
    """Kill the detached SuperLink that ``flwr run`` started for ``home`` and its children."""
    import psutil

    marker = str(home / "local-superlink")
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()


@pytest.mark.slow
def test_flwr_run_dot_runs_the_serverapp_and_clientapp_with_a_chosen_config(tmp_path: Path) -> None:
    # Prepare: a Flower home whose default connection is a local 3-SuperNode simulation
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\noptions.num-supernodes = 3\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # use this environment, install nothing
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    out = tmp_path / "out"
    run_config = f'config="configs/smoke.toml" set="output.dir={out}"'

    # Execute: from another folder (the config path is found in the app)
    try:
        proc = subprocess.run(
            ["flwr", "run", str(ROOT), "--stream", "--run-config", run_config],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
        )
    finally:
        stop_local_superlink(home)

    # Assert: the run finished and wrote the smoke experiment's results, equal to the in-process engine's
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["output"]["dir"] == str(out)
    run_inprocess(load_config(ROOT / "configs/smoke.toml"), tmp_path / "inprocess")
    golden = json.loads((tmp_path / "inprocess" / "results.json").read_text())["rounds"]
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for got, want in zip(results["rounds"], golden, strict=True):
        for key in METRICS:
            if want.get(key) is not None:
                assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert (out / "tensorboard").is_dir() and (out / "adapters" / "global" / "adapter_config.json").is_file()
