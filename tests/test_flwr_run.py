"""The Flower way: ``flwr run .`` as docs/beyond-one-machine.md writes it, on a fresh Flower home.

Flower 1.39's default local simulation federation has 2 SuperNodes; ``configs/smoke.toml`` needs 3.
End to end (a fresh ``FLWR_HOME`` with its own ports; ``flwr`` starts its managed local SuperLink,
which the module stops): on the default federation the run stops within 60 s with one line naming the
SuperNodes it needs and how to set them; the documented command (``--federation-config
"num-supernodes=3"``) runs the ServerApp and ClientApp, logs every round through Flower's logger
(what ``flwr log`` shows) and gives the results of the same config on the in-process engine (FedIT)
to 1e-6. A user's own ServerApp (examples/flower_serverapp: a fedlora strategy in Flower's ``start``,
fedlora's ClientApp) runs under ``flwr run`` as docs/flower.md writes it: both rounds, its final model
saved as safetensors, trained. Both end-to-end tests use one Flower home and the local SuperLink
the first ``flwr run`` starts there (stopped at the end). No run leaves a process behind. The unit
tests: Flower's flat run-config keys (``train.rounds=5``), the wait for SuperNodes, and a fedlora
error as one line on Flower's logger.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from logging import ERROR, INFO
from pathlib import Path

import numpy as np
import psutil
import pytest
from deploy_helpers import processes_of
from flwr.supercore import log as flower_log

from fedlora import methods
from fedlora.app.run_config import config_from_run_config
from fedlora.app.runner import run_inprocess
from fedlora.app.server import report_error
from fedlora.config import ConfigError, load_config
from fedlora.schema import ExperimentConfig
from fedlora.strategies.roster import MissingClientsError, wait_for_nodes

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down",
           "clients", "failures")
SMOKE = "configs/smoke.toml"
USER_APP = ROOT / "examples/flower_serverapp"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plain(text: str) -> str:
    """``text`` without the terminal colour codes of Flower's log lines."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def names(procs: list[psutil.Process]) -> list[str]:
    shown = []
    for proc in procs:
        try:
            shown.append(" ".join(proc.cmdline()[:3])[:120])
        except psutil.Error:
            continue
    return shown


def run_processes(home: Path) -> list[str]:
    """What a finished run must not leave: anything but the local SuperLink and its SuperExec (Flower
    keeps those for the next ``flwr run`` / ``flwr log``), given 60 s to exit (``flwr run --stream``
    returns when the run's log ends; its flwr-simulation process then shuts Ray down, which takes
    seconds on a loaded machine)."""
    def of_a_run(proc: psutil.Process) -> bool:
        command = " ".join(proc.cmdline())
        return "flower-superlink" not in command and "flower-superexec" not in command

    _, alive = psutil.wait_procs([p for p in processes_of(home) if of_a_run(p)], timeout=60)
    return names([p for p in alive if p.is_running()])


def stop_local_superlink(home: Path) -> None:
    """Kill the detached SuperLink that ``flwr run`` started for ``home``, its children and any
    process still pointing into ``home``."""
    for proc in processes_of(home):
        try:
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(processes_of(home), timeout=10)


# ---------------------------------------------------------------- unit: the run config, the wait, the error line
def test_flat_run_config_keys_are_config_overrides_and_set_wins() -> None:
    # Prepare: what Flower hands the ServerApp for `--run-config "config='configs/smoke.toml' train.rounds=5
    # strategy.name='fedhera' train.lr=0.5 output.save_adapters=false set='train.lr=0.01'"` (undeclared
    # keys stay "", the config's own value)
    run_config = {"config": SMOKE, "experiment": "", "resume": False, "set": "train.lr=0.01",
                  "train.rounds": 5, "strategy.name": "fedhera", "train.lr": 0.5, "output.save_adapters": False,
                  "data.dirichlet_alpha": 1e-05, "model.lora_rank": "", "train.batch_size": ""}
    # Execute
    config = config_from_run_config(run_config)
    from_json = config_from_run_config({"experiment": config.to_json(), "train.rounds": 3, "set": ""})
    # Assert: typed values from the dotted keys, smoke.toml's where "" (lora_rank 4, batch 16), `set` last
    assert (config.train.rounds, config.strategy.name, config.output.save_adapters) == (5, "fedhera", False)
    assert config.data.dirichlet_alpha == 1e-05 and config.train.lr == 0.01
    assert (config.model.lora_rank, config.train.batch_size, config.data.num_clients) == (4, 16, 3)
    assert from_json.train.rounds == 3 and from_json.strategy.name == "fedhera"
    with pytest.raises(ConfigError, match=r"invalid config 'train.rounds'"):
        config_from_run_config({"config": SMOKE, "train.rounds": 0})
    with pytest.raises(ConfigError, match=r"unknown option 'strategy.warmup_rounds' for strategy 'fedit'"):
        config_from_run_config({"config": SMOKE, "strategy.warmup_rounds": 1})


def _scalar(annotation: object) -> bool:
    """A type a Flower run-config value can have: a number, a string, a boolean (or None of them)."""
    origin = typing.get_origin(annotation)
    if annotation in (str, int, float, bool) or origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return all(arg is type(None) or _scalar(arg) for arg in typing.get_args(annotation))
    return False


def test_pyproject_declares_every_scalar_config_key_for_flwr_run() -> None:
    # Prepare: the dotted keys [tool.flwr.app.config] declares (Flower refuses any other key)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    flat = {f"{section}.{key}": value for section, table in declared.items() if isinstance(table, dict)
            for key, value in table.items()}
    # Execute: every schema key whose value is a number, string or boolean, and every method's option
    wanted = {f"{section}.{key}" for section, field in ExperimentConfig.model_fields.items()
              for key, sub in typing.cast(typing.Any, field.annotation).model_fields.items() if _scalar(sub.annotation)}
    wanted |= {f"strategy.{key}" for name in methods.method_names()
               for key, field in methods.method(name).options.model_fields.items() if _scalar(field.annotation)}
    # Assert: exactly those, each "" (= the config's own value)
    assert sorted(set(flat) - wanted) == [], "declared in pyproject.toml but not a config key"
    assert sorted(wanted - set(flat)) == [], "config keys missing from [tool.flwr.app.config.<section>] in pyproject.toml"
    assert {value for value in flat.values()} == {""}
    assert {"train.rounds", "strategy.name", "federation.connect_timeout", "strategy.warmup_rounds"} <= set(flat)
    assert {"config", "experiment", "resume", "set"} <= set(declared)


class _Grid:
    """get_node_ids() of a federation whose third node connects at the ``joins``-th look (never: 0)."""

    def __init__(self, joins: int = 0) -> None:
        self.looks, self.joins = 0, joins

    def get_node_ids(self) -> list[int]:
        self.looks += 1
        return [11, 12, 13] if self.joins and self.looks >= self.joins else [11, 12]


def test_too_few_supernodes_stop_after_connect_timeout_with_one_line() -> None:
    # Execute: 2 of 3 SuperNodes for 0.3 s; then a third one joining at the second look
    started = time.monotonic()
    with pytest.raises(MissingClientsError) as missing:
        wait_for_nodes(typing.cast(typing.Any, _Grid()), 3, 0.3)
    waited = time.monotonic() - started
    late = _Grid(joins=2)
    nodes = wait_for_nodes(typing.cast(typing.Any, late), 3, 5.0)
    # Assert: refused after the bounded wait, in one line with the count and Flower's setting
    assert 0.3 <= waited < 1.5
    line = str(missing.value)
    assert "\n" not in line and "needs 3 SuperNodes" in line and "2 connected within 0.3 s" in line
    assert '--federation-config "num-supernodes=3"' in line and "--num-supernodes 3" in line
    assert nodes == [11, 12, 13] and late.looks == 2  # it waited for the late one


def test_a_fedlora_error_under_flowers_runtime_is_one_line_without_flowers_traceback() -> None:
    # Prepare: a handler on Flower's logger, as Flower's runtime has (what `flwr log` gets)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    flower = logging.getLogger("flwr")
    flower.addHandler(handler)
    saved_filters = list(flower.filters)
    error = MissingClientsError("the experiment needs 3 SuperNodes,\n one per client")
    try:
        # Execute: the ServerApp reports; then Flower reports the exception, its exit code, and goes on
        report_error(error)
        flower_log(ERROR, "ServerApp raised an exception", exc_info=error)
        flower_log(ERROR, "Exit Code: 201\nAn unhandled exception occurred in the ServerApp.")
        flower_log(INFO, "something else")
        flower_log(ERROR, "another failure", exc_info=ValueError("not reported"))
    finally:
        flower.removeHandler(handler)
        flower.filters[:] = saved_filters
    # Assert: fedlora's line (on one line), then only what is not Flower's report of it
    assert [r.getMessage() for r in records] == [
        "fedlora: error: the experiment needs 3 SuperNodes, one per client", "something else", "another failure"]
    assert records[0].levelno == ERROR


# ---------------------------------------------------------------- end to end: flwr run on a fresh Flower home
@dataclass
class FlowerHome:
    """A fresh Flower home with its own ports; the local SuperLink the module's first ``flwr run``
    starts in it serves the module's later ones (as it serves a user's)."""

    home: Path
    cwd: Path
    env: dict[str, str]

    def run(self, app: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """``flwr run <app> --stream <args>`` from another folder than the app's."""
        return subprocess.run(["flwr", "run", str(app), "--stream", *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def flower_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowerHome]:
    """No config.toml (Flower's default local federation, 2 SuperNodes); at the end the local SuperLink
    is stopped and no process may be left that points into the home."""
    cwd = tmp_path_factory.mktemp("flwr")
    home = cwd / "flwr-home"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # the documented export: use this environment
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        yield FlowerHome(home, cwd, env)
    finally:
        stop_local_superlink(home)
    assert names(processes_of(home)) == []


@pytest.mark.slow
def test_flwr_run_dot_on_a_fresh_flower_home_refuses_in_one_line_or_runs_the_documented_command(
        flower_home: FlowerHome, tmp_path: Path) -> None:
    # Prepare: the module's fresh Flower home (Flower's default local federation, 2 SuperNodes)
    home = flower_home.home
    out = tmp_path / "out"
    refused_out = tmp_path / "refused"
    # Execute 1: smoke.toml (3 clients) on the default federation; a flat key shortens the wait
    started = time.monotonic()
    refused = flower_home.run(ROOT, "--run-config", f'config="{SMOKE}" federation.connect_timeout=2 '
                                                    f'output.dir="{refused_out}"', timeout=120)
    refused_seconds = time.monotonic() - started
    left_by_refused = run_processes(home)
    # Execute 2: the documented command (docs/beyond-one-machine.md)
    proc = flower_home.run(ROOT, "--federation-config", "num-supernodes=3",
                           "--run-config", f'config="{SMOKE}" set="output.dir={out}"', timeout=900)
    left_by_run = run_processes(home)

    # Assert: the refusal is one line, with the SuperNodes it needs and Flower's setting, within 60 s
    refusal = plain(refused.stdout + refused.stderr)
    lines = [line for line in refusal.splitlines() if "fedlora: error:" in line]
    assert len(lines) == 1, refusal[-3000:]
    assert "needs 3 SuperNodes" in lines[0] and "2 connected within 2 s" in lines[0], lines[0]
    assert '--federation-config "num-supernodes=3"' in lines[0]
    assert "Traceback" not in refusal and "Exit Code" not in refusal, refusal[-3000:]
    assert refused_seconds < 60, refused_seconds
    assert not refused_out.exists()  # nothing written before the clients are there
    # Assert: the documented command finished and wrote the smoke experiment's results, equal to the in-process engine's
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["output"]["dir"] == str(out)
    run_inprocess(load_config(ROOT / SMOKE), tmp_path / "inprocess")
    golden = json.loads((tmp_path / "inprocess" / "results.json").read_text())["rounds"]
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for got, want in zip(results["rounds"], golden, strict=True):
        for key in METRICS:
            if want.get(key) is not None:
                assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert (out / "tensorboard").is_dir() and (out / "adapters" / "global" / "adapter_config.json").is_file()
    # Assert: every round's figures through Flower's logger (what `flwr log` shows), as results.json has them
    streamed = plain(proc.stdout)
    for record in results["rounds"]:
        pattern = (rf"INFO :\s+round\s+{record['round']}/2  global {record['global_accuracy']:.3f}  "
                   rf"personalised {record['personalized_accuracy']:.3f} .* loss {record['train_loss']:.3f}  "
                   rf"up {record['bytes_up'] / 1e6:.2f} MB  down {record['bytes_down'] / 1e6:.2f} MB")
        assert re.search(pattern, streamed), (pattern, streamed[-3000:])
    assert f"results: {out / 'results.json'}" in streamed
    # Assert: no run left a process behind (the SuperLink and its SuperExec stay until the module ends)
    assert left_by_refused == [] and left_by_run == []


@pytest.mark.slow
def test_a_users_serverapp_under_flwr_run_trains_and_saves_the_final_model(flower_home: FlowerHome,
                                                                          tmp_path: Path) -> None:
    """examples/flower_serverapp (HetLoRA through Flower's ``start``, fedlora's ClientApp) as its
    FAB, on the module's local SuperLink, with docs/flower.md's command (2 rounds, 3 SuperNodes)."""
    from safetensors.numpy import load_file

    # Prepare: the app's run config and the strategy its ServerApp builds (for the initial adapter)
    out = tmp_path / "out"
    run_config = tomllib.loads((USER_APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    spec = importlib.util.spec_from_file_location("flower_serverapp", USER_APP / "server_app.py")
    assert spec is not None and spec.loader is not None
    user_app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_app)
    initial = user_app.build_strategy(run_config).initial_adapter(8)  # r_max: the largest client rank
    # Execute
    proc = flower_home.run(USER_APP, "--federation-config", "num-supernodes=3",
                           "--run-config", f'num-server-rounds=2 out-dir="{out}"', timeout=600)
    left_by_run = run_processes(flower_home.home)
    # Assert: the run finished, both rounds trained on all 3 clients, and the app saved the final model
    log = plain(proc.stdout + proc.stderr)
    assert proc.returncode == 0, log[-3000:]
    assert "Successfully installed fedlora-flower-serverapp" in log  # the example's FAB, not the repository
    assert re.findall(r"\[ROUND (\d+)/(\d+)\]", log) == [("1", "2"), ("2", "2")], log[-3000:]
    assert log.count("aggregate_train: 3 replies, 0 failures") == 2, log[-3000:]
    train = log[log.index("Aggregated ClientApp-side Train Metrics:"):]
    losses = [float(x) for x in re.findall(r"\d: \{'clients': '3', 'train-loss': '([-+.e\d]+)'\}", train)]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), train[:500]
    saved = out / "final_model.safetensors"
    assert f"saved the final global model (10 arrays) to {saved}" in log
    # Assert: the file loads; HetLoRA's rank-8 global adapter (4 modules: A, B) and head, every tensor
    # finite and moved from the seeded initial adapter (whose B and head bias start at zero)
    final = load_file(saved)
    assert sorted(final) == sorted(initial) and len(final) == 10
    for key, value in final.items():
        assert value.shape == initial[key].shape and value.dtype == np.float32, key
        assert np.isfinite(value).all(), key
        assert np.abs(value - initial[key]).max() > 1e-4, f"{key} did not move"
    assert {final[k].shape for k in final if k.endswith("::A")} == {(8, 32)}
    # Assert: the run left no process (the SuperLink stays until the module ends)
    assert left_by_run == []


def test_the_repository_builds_a_fab_of_configs_that_flower_installs_and_that_carries_no_code(tmp_path: Path) -> None:
    """`flwr run .` ships a FAB built from pyproject's [tool.flwr.app] fab-include: Flower's own
    builder and installer (which verifies every file's hash) accept it, and it holds the app's
    pyproject and configs but no code (every node runs its installed fedlora) and no docs/."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab

    # Execute
    fab = build_fab_from_disk(ROOT)
    installed = install_from_fab(fab, tmp_path, skip_prompt=True)
    # Assert
    shipped = {p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.is_file()}
    assert {"configs/smoke.toml", "configs/quickstart.toml", "pyproject.toml"} <= shipped
    assert not any(s.endswith((".py", ".json")) or s.startswith("docs/") for s in shipped), sorted(shipped)
    assert len(fab) < 10 * 2**20  # Flower's FAB size limit
