"""The Flower way: ``flwr run .`` as the README writes it, on a fresh Flower home.

Flower 1.39's default local simulation federation has 2 SuperNodes; ``configs/smoke.toml`` needs 3.
End to end (one test, its own ``FLWR_HOME`` and ports; ``flwr`` starts its managed local SuperLink,
which the test stops): on the default federation the run stops within 60 s with one line naming the
SuperNodes it needs and how to set them; the README's command (``--federation-config
"num-supernodes=3"``) runs the ServerApp and ClientApp, logs every round through Flower's logger
(what ``flwr log`` shows) and gives the results of the same config on the in-process engine (FedIT)
to 1e-6. No run leaves a process behind. The unit tests: Flower's flat run-config keys
(``train.rounds=5``), the wait for SuperNodes, and a fedlora error as one line on Flower's logger.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import types
import typing
from logging import ERROR, INFO
from pathlib import Path

import psutil
import pytest
from flwr.supercore import log as flower_log

from fedlora import methods
from fedlora.app.runner import run_inprocess
from fedlora.app.server import config_from_run_config, report_error
from fedlora.config import ConfigError, load_config
from fedlora.schema import ExperimentConfig
from strategies.roster import MissingClientsError, wait_for_nodes

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down",
           "clients", "failures")
SMOKE = "configs/smoke.toml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plain(text: str) -> str:
    """``text`` without the terminal colour codes of Flower's log lines."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def processes_of(home: Path) -> list[psutil.Process]:
    """Live processes whose FLWR_HOME or command line points into ``home``: the local SuperLink, its
    SuperExec, a run's flwr-simulation and the Ray processes it starts (they inherit FLWR_HOME)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("FLWR_HOME", "").startswith(str(home)) or str(home) in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


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
    keeps those for the next ``flwr run`` / ``flwr log``), given 10 s to exit."""
    def of_a_run(proc: psutil.Process) -> bool:
        command = " ".join(proc.cmdline())
        return "flower-superlink" not in command and "flower-superexec" not in command

    _, alive = psutil.wait_procs([p for p in processes_of(home) if of_a_run(p)], timeout=10)
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


# ---------------------------------------------------------------- end to end: flwr run . on a fresh Flower home
@pytest.mark.slow
def test_flwr_run_dot_on_a_fresh_flower_home_refuses_in_one_line_or_runs_the_readme_command(tmp_path: Path) -> None:
    # Prepare: a fresh Flower home (no config.toml: Flower's default local federation, 2 SuperNodes)
    home = tmp_path / "flwr-home"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # the README's export: use this environment
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    out = tmp_path / "out"
    refused_out = tmp_path / "refused"

    def flwr_run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        # from another folder: the config path is found in the app
        return subprocess.run(["flwr", "run", str(ROOT), "--stream", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    try:
        # Execute 1: smoke.toml (3 clients) on the default federation; a flat key shortens the wait
        started = time.monotonic()
        refused = flwr_run("--run-config", f'config="{SMOKE}" federation.connect_timeout=2 '
                                           f'output.dir="{refused_out}"', timeout=120)
        refused_seconds = time.monotonic() - started
        left_by_refused = run_processes(home)
        # Execute 2: the README's command
        proc = flwr_run("--federation-config", "num-supernodes=3",
                        "--run-config", f'config="{SMOKE}" set="output.dir={out}"', timeout=900)
        left_by_run = run_processes(home)
    finally:
        stop_local_superlink(home)
    left_at_all = names(processes_of(home))

    # Assert: the refusal is one line, with the SuperNodes it needs and Flower's setting, within 60 s
    refusal = plain(refused.stdout + refused.stderr)
    lines = [line for line in refusal.splitlines() if "fedlora: error:" in line]
    assert len(lines) == 1, refusal[-3000:]
    assert "needs 3 SuperNodes" in lines[0] and "2 connected within 2 s" in lines[0], lines[0]
    assert '--federation-config "num-supernodes=3"' in lines[0]
    assert "Traceback" not in refusal and "Exit Code" not in refusal, refusal[-3000:]
    assert refused_seconds < 60, refused_seconds
    assert not refused_out.exists()  # nothing written before the clients are there
    # Assert: the README's command finished and wrote the smoke experiment's results, equal to the in-process engine's
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
    # Assert: no run left a process behind (the SuperLink and its SuperExec stay until stopped)
    assert left_by_refused == [] and left_by_run == [] and left_at_all == []
