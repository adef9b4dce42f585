"""``fedlora deploy local``: a real Flower deployment (SuperLink + N SuperNodes) on 127.0.0.1.

What it does, in order (Flower 1.39; docs/deployment.md, "Flower 1.39 behaviour", has the details):

1. certificates (``fedlora.app.deploy.certs``) in ``DIR/certs`` unless ``insecure``;
2. ``flower-superlink`` with TLS and SuperNode authentication, the Fleet API (gRPC) on an
   explicit 127.0.0.1 port, the Control API on another, runtime dependency install disabled;
3. ``flwr supernode register`` for every SuperNode public key (Control API);
4. N ``flower-supernode`` processes, each with its own node config (``partition-id``,
   ``num-partitions``, ``rank``, ``budget-*`` from the experiment's ``[clients]``);
5. ``flwr run <repo> fedlora-local --run-config DIR/run_config.toml``: the ServerApp gets the
   resolved experiment (JSON) with ``output.dir = DIR`` and writes ``DIR/results.json``;
6. polls ``flwr ls`` until the run is finished, then stops every process it started (process
   groups, then any descendant left), also on an error, Ctrl-C or SIGTERM.

Every process gets its own ``FLWR_HOME`` under ``DIR/flwr``, telemetry and the update check off,
and writes its log to ``DIR/logs/<name>.log`` (files, never pipes: a full pipe blocks Flower).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Self

import psutil
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from fedlora import protocol
from fedlora.app.deploy.certs import CertPaths, public_key_path, write_certs
from fedlora.config import ConfigError, ExperimentConfig

logger = logging.getLogger("fedlora")

HOST = "127.0.0.1"
CONNECTION = "fedlora-local"
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr live next to python
SUPERLINK_READY = "Uvicorn running on"
SUPERNODE_READY = "SuperNode ID:"
# How long the SuperLink keeps a silent SuperNode online: patience x heartbeat interval (Flower's defaults)
HEARTBEAT_SECONDS = float(HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL)
FLEET_LOG_LINE = "Fleet API (gRPC-rere)"
INSECURE_WARNINGS = ("Option --insecure was set", "SuperNode authentication is disabled")
# Lines of a refused SuperNode's log that say why (Flower 1.39 wording).
REFUSAL_MARKERS = ("[code:", "Exit Code", "Giving up reconnection", "Insecure connection is enabled",
                   "SSL/TLS handshake error", "Failed to initialize the connection")


GENERIC_REFUSALS = ("Exit Code", "Failed to initialize the connection")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"^(INFO|WARNING|ERROR|DEBUG|CRITICAL)\s*:\s*")


def _plain(line: str) -> str:
    """A log line without colour codes, log level and repeated blanks."""
    return _LEVEL.sub("", " ".join(_ANSI.sub("", line).split()))


class DeployError(RuntimeError):
    """A deployment step failed; the message is one line and names the log file to read."""


@dataclass
class Ports:
    """Ports picked on 127.0.0.1: the Control/runtime HTTP API, the Fleet API, one per SuperNode."""

    control: int
    fleet: int
    supernodes: list[int]

    @staticmethod
    def pick(num_supernodes: int) -> Ports:
        sockets = []
        try:
            for _ in range(2 + num_supernodes):  # hold all sockets so no port is picked twice
                sock = socket.socket()
                sock.bind((HOST, 0))
                sockets.append(sock)
            numbers = [sock.getsockname()[1] for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        return Ports(control=numbers[0], fleet=numbers[1], supernodes=numbers[2:])


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def flower_env(home: Path) -> dict[str, str]:
    """Environment of every Flower process: own FLWR_HOME, no telemetry, no update check."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    # The SuperLink / SuperNode start flower-superexec, flwr-serverapp and flwr-clientapp by name.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class Daemon:
    """A long-running Flower process in its own session; stdout + stderr go to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 share_log: Daemon | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # share_log: write into another daemon's open log (one offset, as a child it started would)
        self._log: BinaryIO = share_log._log if share_log is not None else log_path.open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_for(self, needle: str, timeout: float) -> bool:
        """True once ``needle`` is in the log; False if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return True
            if not self.alive():
                time.sleep(0.3)  # let the last lines reach the file
                return needle in self.text()
            time.sleep(0.1)
        return False

    def reason(self) -> str:
        """The log lines that say why this process failed (most specific first), as one line."""
        lines = [_plain(line) for line in self.text().splitlines()]
        hits = [line for line in lines if any(marker in line for marker in REFUSAL_MARKERS)]
        specific = [line for line in hits if not line.startswith(GENERIC_REFUSALS)]
        picked = (specific + hits)[:3] if hits else [line for line in lines if line][-2:]
        return " | ".join(dict.fromkeys(picked)) or "no output"

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL this process, its group and every descendant, wherever their session (a
        machine that dies: the SuperLink's SuperExec and the ServerApps it started go with it)."""
        descendants = self.descendants()
        self.signal_group(signal.SIGKILL)
        for proc in descendants:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(descendants, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def close_log(self) -> None:
        with contextlib.suppress(OSError):
            self._log.close()


def stop_daemons(daemons: Sequence[Daemon], grace: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL after ``grace``, then end every descendant left.

    The SuperLink's SuperExec runs in a session of its own and a run's ``flwr-serverapp`` may be
    orphaned when the SuperExec stops, so descendants are collected before the first signal.
    """
    running = [daemon for daemon in daemons if daemon.alive()]
    leftovers: list[psutil.Process] = []
    for daemon in running:
        leftovers.extend(daemon.descendants())
        daemon.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for daemon in running:
        try:
            daemon.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            daemon.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.process.wait(timeout=5)
    for daemon in daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.process.wait(timeout=0.1)  # reap
        daemon.close_log()
    alive = [proc for proc in leftovers if proc.is_running()]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(alive, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP raise KeyboardInterrupt (like Ctrl-C) so ``finally`` blocks stop the
    processes; only in the main thread, where Python delivers signals."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def node_config_string(values: dict[str, Any]) -> str:
    """``--node-config`` text: TOML-typed ``k=v`` pairs (strings quoted, as Flower requires)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def node_configs(config: ExperimentConfig, num_nodes: int) -> list[dict[str, Any]]:
    """Each SuperNode's node config: what a silo declares (partition, rank, budgets).

    Label noise is not declared: it is part of the experiment (``[data]``) the client receives.
    """
    from fedlora.profile import configured_budgets, configured_rank

    configs = []
    for partition_id in range(num_nodes):
        values: dict[str, Any] = {
            protocol.NODE_PARTITION_ID: partition_id,
            protocol.NODE_NUM_PARTITIONS: num_nodes,
            protocol.NODE_RANK: configured_rank(config.clients, config.model.lora_rank, partition_id, num_nodes),
        }
        budgets = configured_budgets(config.clients, partition_id, num_nodes)
        values |= {f"{protocol.NODE_BUDGET_PREFIX}{key}": float(value) for key, value in budgets.items()}
        configs.append(values)
    return configs


def app_dir() -> Path:
    """The repository root: its pyproject.toml declares the Flower app (server + client)."""
    root = Path(__file__).resolve().parents[3]  # fedlora/app/deploy/local.py -> the repository
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or "[tool.flwr.app.components]" not in pyproject.read_text(encoding="utf-8"):
        raise ConfigError(
            f"fedlora's Flower app not found at {root} (pyproject.toml with [tool.flwr.app.components]); "
            "install fedlora editable from its repository: pip install -e ."
        )
    return root


@dataclass
class Refusal:
    """A SuperNode the SuperLink did not accept."""

    name: str
    returncode: int | None
    seconds: float
    reason: str
    log_path: Path


@dataclass
class LocalDeployment:
    """One SuperLink on 127.0.0.1 and the SuperNodes started against it (context manager)."""

    out_dir: Path
    num_nodes: int
    insecure: bool = False
    max_retries: int = 3
    start_timeout: float = 90.0
    cli_timeout: float = 120.0
    clientapp: str = "warm"  # "warm": fedlora's SuperExec forks every ClientApp (fedlora.app.deploy.warm); "cold": Flower's
    daemons: list[Daemon] = field(default_factory=list)
    supernodes: list[Daemon] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir).resolve()
        self.logs = self.out_dir / "logs"
        self.homes = self.out_dir / "flwr"
        self.ports = Ports.pick(self.num_nodes + 4)  # spares for extra (e.g. refused) SuperNodes
        self.certs: CertPaths | None = None
        self.superlink: Daemon | None = None
        self.superexecs: dict[str, Daemon] = {}  # SuperNode name -> its warm SuperExec
        self._next_port = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the SuperNodes first (they outlive a vanished SuperLink), then the SuperLink."""
        started = time.monotonic()
        nodes = [d for d in self.daemons if d is not self.superlink]
        stop_daemons(nodes)
        if self.superlink is not None:
            stop_daemons([self.superlink])
        self.timings["stop_seconds"] = round(time.monotonic() - started, 2)

    def _spawn(self, name: str, cmd: list[str], home: str | None = None, share_log: Daemon | None = None) -> Daemon:
        log_path = share_log.log_path if share_log is not None else self.logs / f"{name}.log"
        daemon = Daemon(name, cmd, flower_env(self.homes / (home or name)), log_path, share_log)
        self.daemons.append(daemon)
        return daemon

    def _take_port(self) -> int:
        if self._next_port >= len(self.ports.supernodes):
            self.ports.supernodes.extend(Ports.pick(4).supernodes)
        port = self.ports.supernodes[self._next_port]
        self._next_port += 1
        return port

    # ------------------------------------------------------------------ SuperLink + CLI
    def start_superlink(self) -> Daemon:
        started = time.monotonic()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cmd = [str(BIN / "flower-superlink")]
        if self.insecure:
            cmd.append("--insecure")
        else:
            self.certs = write_certs(self.out_dir / "certs", num_nodes=self.num_nodes)
            cmd += [
                "--ssl-ca-certfile", str(self.certs.ca_cert),
                "--ssl-certfile", str(self.certs.server_cert),
                "--ssl-keyfile", str(self.certs.server_key),
                "--enable-supernode-auth",
            ]  # fmt: skip
        cmd += [
            "--disable-runtime-dependency-installation",
            "--host", HOST, "--port", str(self.ports.control),
            "--fleet-api-address", f"{HOST}:{self.ports.fleet}",
        ]  # fmt: skip
        self.superlink = self._spawn("superlink", cmd)
        ready = self.superlink.wait_for(SUPERLINK_READY, self.start_timeout)
        while ready and not (port_open(self.ports.control) and port_open(self.ports.fleet)):
            if time.monotonic() - started > self.start_timeout:
                ready = False
                break
            time.sleep(0.1)
        if not ready:
            raise DeployError(
                f"the SuperLink did not start within {self.start_timeout:.0f}s: {self.superlink.reason()} "
                f"(log: {self.superlink.log_path})"
            )
        self._write_cli_config()
        self.timings["superlink_start_seconds"] = round(time.monotonic() - started, 2)
        return self.superlink

    def require_certs(self) -> CertPaths:
        """The certificates written when the SuperLink started (TLS mode)."""
        if self.certs is None:
            raise DeployError("no certificates: the SuperLink was not started with TLS")
        return self.certs

    def _write_cli_config(self) -> None:
        home = self.homes / "cli"
        home.mkdir(parents=True, exist_ok=True)
        security = "insecure = true" if self.insecure else f'root-certificates = "{self.require_certs().ca_cert}"'
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{HOST}:{self.ports.control}"\n{security}\n',
            encoding="utf-8",
        )

    def flwr(self, *args: str, timeout: float | None = None) -> dict[str, Any]:
        """Run ``flwr ARGS --format json`` against this SuperLink; the parsed JSON reply."""
        cmd = [str(BIN / "flwr"), *args, "--format", "json"]
        try:
            done = subprocess.run(
                cmd, env=flower_env(self.homes / "cli"), check=False, capture_output=True, text=True,
                timeout=timeout or self.cli_timeout, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise DeployError(f"`flwr {args[0]}` did not answer within {timeout or self.cli_timeout:.0f}s") from None
        output = done.stdout + done.stderr
        start, end = output.find("{"), output.rfind("}")
        try:
            reply = json.loads(output[start : end + 1])
        except ValueError:
            last = " ".join(output.split())[-300:]
            raise DeployError(f"`flwr {' '.join(args[:2])}` failed (rc {done.returncode}): {last}") from None
        if not reply.get("success", True):
            raise DeployError(f"`flwr {' '.join(args[:2])}` failed: {' '.join(str(reply.get('error-message')).split())}")
        return reply

    def register(self, private_keys: Sequence[Path]) -> list[int]:
        """``flwr supernode register`` every key (in parallel); the node ids the SuperLink assigned."""
        started = time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        def one(key: Path) -> int:
            reply = self.flwr("supernode", "register", str(public_key_path(key)), CONNECTION)
            return int(reply["node-id"])

        with ThreadPoolExecutor(max_workers=max(1, min(4, len(private_keys)))) as pool:
            ids = list(pool.map(one, private_keys))
        self.timings["register_seconds"] = round(time.monotonic() - started, 2)
        return ids

    # ------------------------------------------------------------------ SuperNodes
    def supernode_cmd(self, node_config: dict[str, Any], key: Path | None, tls: bool, port: int) -> list[str]:
        cmd = [str(BIN / "flower-supernode"), "--superlink", f"{HOST}:{self.ports.fleet}"]
        if tls:
            if self.certs is None:
                raise DeployError("a TLS SuperNode needs the deployment's CA; start the SuperLink with TLS")
            cmd += ["--root-certificates", str(self.certs.ca_cert)]
        else:
            cmd.append("--insecure")
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key)]
        cmd += [
            "--node-config", node_config_string(node_config),
            "--max-retries", str(self.max_retries),  # Flower's default retries forever
            "--host", HOST, "--port", str(port),
        ]  # fmt: skip
        if self.clientapp == "warm":
            cmd += ["--isolation", "process"]  # the SuperExec is ours (spawn_supernode)
        return cmd

    def spawn_supernode(self, name: str, node_config: dict[str, Any], key: Path | None, tls: bool) -> Daemon:
        """A SuperNode and, with ``clientapp = 'warm'``, fedlora's SuperExec for it
        (:mod:`fedlora.app.deploy.warm`: its Runtime API on loopback, its log in the SuperNode's,
        stopping when the SuperNode exits), as Flower's own SuperExec would run beside it."""
        port = self._take_port()
        daemon = self._spawn(name, self.supernode_cmd(node_config, key, tls, port))
        if self.clientapp == "warm":
            cmd = [sys.executable, "-m", "fedlora.app.deploy.warm", "--runtime-api-address", f"{HOST}:{port}",
                   "--insecure", "--parent-pid", str(daemon.process.pid)]
            self.superexecs[name] = self._spawn(f"{name}-superexec", cmd, home=name, share_log=daemon)
        return daemon

    def with_superexec(self, daemon: Daemon) -> list[Daemon]:
        """A SuperNode and its warm SuperExec (if any): what stops together."""
        return [daemon] + ([self.superexecs[daemon.name]] if daemon.name in self.superexecs else [])

    def dead_superexec(self) -> Daemon | None:
        """The warm SuperExec of a running SuperNode that has exited (its messages would never run)."""
        for node in self.supernodes:
            superexec = self.superexecs.get(node.name)
            if superexec is not None and node.alive() and not superexec.alive():
                return superexec
        return None

    def restart_supernode(self, index: int, node_config: dict[str, Any], key: Path | None,
                          patience: float = HEARTBEAT_SECONDS + 30.0) -> Daemon:
        """Start SuperNode ``index`` again after it died, as a silo's supervisor would (systemd
        ``Restart=on-failure``, a Kubernetes pod): Flower keeps a killed SuperNode online until its
        heartbeat lapses (2 x 30 s by default) and refuses to activate the same key meanwhile (the
        SuperNode exits), so this retries until the SuperLink accepts it or ``patience`` s pass.
        With SuperNode authentication the node keeps its node id (it is the key's)."""
        deadline = time.monotonic() + patience
        attempt = 0
        while True:
            attempt += 1
            daemon = self.spawn_supernode(f"supernode-{index}-restart-{attempt}", node_config, key, not self.insecure)
            if daemon.wait_for(SUPERNODE_READY, self.start_timeout) and daemon.alive():
                self.supernodes[index] = daemon
                return daemon
            stop_daemons(self.with_superexec(daemon))
            if time.monotonic() > deadline:
                raise DeployError(f"SuperNode {index} was not accepted again within {patience:.0f}s: "
                                  f"{daemon.reason()} (log: {daemon.log_path})")
            time.sleep(5.0)

    def start_supernodes(self, configs: Sequence[dict[str, Any]], keys: Sequence[Path | None]) -> list[Daemon]:
        """Start the SuperNodes in parallel and wait until each has been accepted (``SuperNode ID``)."""
        started = time.monotonic()
        tls = not self.insecure
        first = len(self.supernodes)
        new = [
            self.spawn_supernode(f"supernode-{first + i}", cfg, key, tls)
            for i, (cfg, key) in enumerate(zip(configs, keys, strict=True))
        ]
        for daemon in new:
            if not daemon.wait_for(SUPERNODE_READY, self.start_timeout):
                what = "was refused" if not daemon.alive() else f"was not accepted within {self.start_timeout:.0f}s"
                raise DeployError(f"SuperNode {daemon.name} {what}: {daemon.reason()} (log: {daemon.log_path})")
        self.supernodes.extend(new)
        self.timings["supernodes_start_seconds"] = round(time.monotonic() - started, 2)
        return new

    def try_supernode(self, name: str, key: Path | None, tls: bool, timeout: float = 90.0) -> Refusal | None:
        """Start one SuperNode and wait until it is accepted (None) or gives up (its Refusal).

        Bounded: ``--max-retries`` makes a SuperNode that cannot connect exit; ``timeout`` stops
        one that neither connects nor exits.
        """
        config = {protocol.NODE_PARTITION_ID: 0, protocol.NODE_NUM_PARTITIONS: max(1, self.num_nodes)}
        daemon = self.spawn_supernode(name, config, key, tls)
        accepted = daemon.wait_for(SUPERNODE_READY, timeout)
        seconds = time.monotonic() - daemon.started
        if accepted:
            stop_daemons(self.with_superexec(daemon))
            return None
        alive = daemon.alive()
        stop_daemons(self.with_superexec(daemon))
        reason = daemon.reason() if not alive else f"no answer within {timeout:.0f}s; {daemon.reason()}"
        return Refusal(name, daemon.process.returncode, round(seconds, 2), reason, daemon.log_path)

    # ------------------------------------------------------------------ runs
    def submit(self, app: Path, run_config: Path) -> int:
        """``flwr run APP`` with a run-config file; the run id. The app's pyproject is never changed."""
        pyproject = app / "pyproject.toml"
        before = pyproject.read_bytes()
        started = time.monotonic()
        try:
            reply = self.flwr("run", str(app), CONNECTION, "--run-config", str(run_config))
        finally:
            if pyproject.read_bytes() != before:  # e.g. a legacy [tool.flwr.federations] migration
                pyproject.write_bytes(before)
                logger.warning("flwr run rewrote %s; restored it", pyproject)
        self.timings["submit_seconds"] = round(time.monotonic() - started, 2)
        return int(reply["run-id"])

    def run_status(self, run_id: int) -> dict[str, Any]:
        runs = self.flwr("ls", CONNECTION, "--run-id", str(run_id)).get("runs", [])
        return runs[0] if runs else {"status": "unknown"}

    def wait_run(self, run_id: int, timeout: float, poll: float = 5.0) -> dict[str, Any]:
        """Wait until the run is finished; fail fast if a SuperNode or the SuperLink dies.

        One ``flwr log RUN --stream`` process follows the ServerApp log into
        ``DIR/logs/serverapp-<run id>.log`` and ends when the run ends (cheap: a CLI call costs about a
        second of CPU); ``flwr ls`` then reads the status. If the stream ends early, ``flwr ls``
        is polled every ``poll`` seconds.
        """
        started = time.monotonic()
        deadline = started + timeout
        stream = self._spawn(f"serverapp-{run_id}", [str(BIN / "flwr"), "log", str(run_id), CONNECTION, "--stream"],
                             home="cli")
        run: dict[str, Any] = {"status": "unknown"}
        try:
            while True:
                if not stream.alive():
                    run = self.run_status(run_id)
                    if str(run.get("status", "")).startswith("finished"):
                        break
                for daemon in [self.superlink, *self.supernodes, self.dead_superexec()]:
                    if daemon is not None and not daemon.alive():
                        raise DeployError(
                            f"{daemon.name} exited during run {run_id}: {daemon.reason()} (log: {daemon.log_path})"
                        )
                if time.monotonic() > deadline:
                    with contextlib.suppress(DeployError):
                        self.flwr("stop", str(run_id), CONNECTION)
                    raise DeployError(
                        f"run {run_id} did not finish within {timeout:.0f}s (status {run.get('status')}); "
                        f"stopped it (logs: {self.logs})"
                    )
                time.sleep(poll if not stream.alive() else 1.0)
        finally:
            stop_daemons([stream], grace=3.0)
            self.daemons.remove(stream)
        self.timings["run_seconds"] = round(time.monotonic() - started, 2)
        return run

    def wait_runs(
        self, run_ids: Sequence[int], timeout: float, poll: float = 3.0, until_running: int | None = None
    ) -> dict[int, dict[str, Any]]:
        """Wait until every run of ``run_ids`` (running side by side) is finished; their ``flwr ls``
        rows. Fails fast if a SuperNode or the SuperLink dies, stops the runs after ``timeout``.
        With ``until_running = K``: wait only until no run is still starting (pending or
        starting) and at most K are running."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            if not run_ids:
                return {}
            rows = {int(r.get("run-id", 0)): r for r in self.flwr("ls", CONNECTION).get("runs", [])}
            status = [str(rows.get(run_id, {}).get("status", "")) for run_id in run_ids]
            if until_running is not None:
                started_all = all(s == "running" or s.startswith("finished") for s in status)
                if started_all and status.count("running") <= until_running:
                    return {run_id: rows[run_id] for run_id in run_ids}
            elif all(s.startswith("finished") for s in status):
                self.timings["run_seconds"] = round(time.monotonic() - started, 2)
                return {run_id: rows[run_id] for run_id in run_ids}
            for daemon in [self.superlink, *self.supernodes, self.dead_superexec()]:
                if daemon is not None and not daemon.alive():
                    raise DeployError(f"{daemon.name} exited during the runs: {daemon.reason()} (log: {daemon.log_path})")
            if time.monotonic() > deadline:
                for run_id in run_ids:
                    with contextlib.suppress(DeployError):
                        self.flwr("stop", str(run_id), CONNECTION)
                raise DeployError(f"runs {list(run_ids)} did not all finish within {timeout:.0f}s; stopped them "
                                  f"(logs: {self.logs})")
            time.sleep(poll)

    # ------------------------------------------------------------------ evidence
    def fleet_is_grpc_over_tls(self) -> bool:
        """The SuperLink log names the gRPC Fleet API, serves https and has no insecure warning."""
        text = self.superlink.text() if self.superlink else ""
        return (
            FLEET_LOG_LINE in text
            and f"{SUPERLINK_READY} https://" in text
            and not any(warning in text for warning in INSECURE_WARNINGS)
        )


def write_run_config(config: ExperimentConfig, path: Path, resume: bool = False) -> Path:
    """A ``--run-config`` file: ``experiment`` holds the resolved config (JSON); ``resume = true``
    continues the checkpoint in its output folder."""
    # JSON string escapes (\" \\ \n \uXXXX) are valid TOML basic-string escapes.
    path.write_text(f"experiment = {json.dumps(config.to_json())}\nresume = {str(resume).lower()}\n", encoding="utf-8")
    return path


FEDERATION_FILES = ("certs", "flwr", "logs", "deployment.json")  # + run_config*.toml: one federation's records


def earlier_federation_aside(out: Path) -> Path | None:
    """Move what an earlier federation left in ``out`` (certificates, Flower homes, logs, run
    records; not the runs' results and checkpoints) into ``out/deployment.old-<time>/``, so that a
    new federation can start there and nothing of the old one is lost; that folder (None: nothing)."""
    import time as time_module

    from fedlora.app.folders import OLD_SUFFIX

    entries = [out / name for name in FEDERATION_FILES if (out / name).exists()]
    entries += sorted(out.glob("run_config*.toml")) + sorted(out.glob("*/deployment.json"))
    if not entries:
        return None
    target = out / f"deployment{OLD_SUFFIX}{time_module.strftime('%Y%m%d-%H%M%S')}"
    count = 1
    while target.exists():
        count += 1
        target = out / f"deployment{OLD_SUFFIX}{time_module.strftime('%Y%m%d-%H%M%S')}-{count}"
    for entry in entries:
        destination = target / entry.relative_to(out)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.rename(entry, destination)
    logger.warning("--resume: the earlier federation's certificates, logs and records in %s were moved to %s",
                   out, target)
    return target


def deploy_local(
    config: ExperimentConfig | str | Path | dict,
    num_nodes: int | None = None,
    out_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    insecure: bool = False,
    timeout: float = 3600.0,
    on_ready: Callable[[LocalDeployment], None] | None = None,
    overwrite: bool = False,
    resume: bool = False,
    clientapp: str = "warm",
) -> dict[str, Any]:
    """Run ``config`` on a local SuperLink + ``num_nodes`` SuperNodes; the results dict.

    ``on_ready(deployment)`` is called after the run finished, while every process is still up
    (the tests use it for probes against the live SuperLink). ``overwrite``, ``resume``,
    ``clientapp``: see :func:`deploy_runs`.
    """
    from fedlora.app.runner import resolve

    resolved = resolve(config, overrides)
    return deploy_runs({"": resolved}, num_nodes, out_dir, insecure, timeout, on_ready, overwrite=overwrite,
                       resume=resume, clientapp=clientapp)[""]


def deploy_runs(
    configs: dict[str, ExperimentConfig],
    num_nodes: int | None = None,
    out_dir: str | Path | None = None,
    insecure: bool = False,
    timeout: float = 3600.0,
    on_ready: Callable[[LocalDeployment], None] | None = None,
    side_by_side: int = 0,
    overwrite: bool = False,
    resume: bool = False,
    clientapp: str = "warm",
) -> dict[str, dict[str, Any]]:
    """Run several experiments on ONE local federation (a SuperLink and ``num_nodes`` SuperNodes
    started once), one after the other or, with ``side_by_side = K`` (K > 0), up to K at a time
    (Flower runs them concurrently: their message latencies overlap; a run is submitted once its
    predecessor's ServerApp has started, because Flower declares a task dead whose process has not
    reported within 30 s of being handed it, and many ServerApps importing at once on a small
    machine got there); label -> its results dict. Run
    ``label`` writes into ``OUT/<label>`` (``OUT`` itself for the label ''). The silos' node
    configs come from the first experiment, so the experiments must share their data and
    clients sections. ``OUT`` must be new or empty: an earlier deployment there (its results,
    certificates, logs) is refused, or with ``overwrite`` moved aside (``OUT.old-<time>``; nothing
    is deleted) once every check passed. ``resume``: continue the interrupted runs in ``OUT`` from
    their checkpoints (verified before any process starts) on a new federation; the earlier
    federation's certificates, Flower homes, logs and run records are moved into
    ``OUT/deployment.old-<time>/`` first. The silos' kept state is their own (node config
    ``checkpoint-dir``; without it a resumed silo starts from the global model it receives).
    ``clientapp``: ``'warm'`` (default) runs every SuperNode in ``--isolation process`` beside
    fedlora's SuperExec (:mod:`fedlora.app.deploy.warm`: each message's ClientApp process is forked
    from a parent that imported the heavy libraries once); ``'cold'``: Flower's own SuperExec starts
    a fresh ``flwr-clientapp`` per message."""
    if clientapp not in ("warm", "cold"):
        raise ConfigError(f"clientapp must be 'warm' or 'cold', got {clientapp!r}")
    from fedlora.app.folders import claim
    from fedlora.app.runner import check_inputs
    from fedlora.results import load_results

    first = next(iter(configs.values()))
    nodes = first.data.num_clients if num_nodes is None else num_nodes
    for label, config in configs.items():
        if nodes != config.data.num_clients:
            raise ConfigError(
                f"--nodes {nodes} differs from data.num_clients={config.data.num_clients}; every SuperNode "
                f"holds one partition: use --nodes {config.data.num_clients} or --set data.num_clients={nodes}"
                + (f" --set clients.ranks=[...] ({nodes} ranks)" if config.clients.ranks else "")
            )
        if config.data != first.data or config.clients != first.clients:
            raise ConfigError(f"run '{label}' has other [data] / [clients] than the first: one federation serves both")
    out = Path(out_dir or first.output.dir).resolve()
    claimed = claim(out, what="deployment", overwrite=overwrite, resume=resume)
    for label, config in configs.items():
        config.output.dir = str(out / label if label else out)
    app = app_dir()
    if resume:
        from fedlora.checkpoint import load_server
        from strategies.registry import strategy_class

        for config in configs.values():
            strategy_class(config.strategy.name)  # its state types decode
            load_server(config.output.dir, config)  # a missing, corrupt or tampered checkpoint: one line
    for config in configs.values():
        check_inputs(config)  # one-line errors for a missing model or unreadable data, before any process
    claimed.take()
    if resume:
        earlier_federation_aside(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    evidence: dict[str, dict[str, Any]] = {}
    with terminate_on_signals(), LocalDeployment(out, nodes, insecure=insecure, clientapp=clientapp) as deployment:
        deployment.start_superlink()
        logger.info("SuperLink up: Control API https://%s:%d (loopback only), Fleet API %s:%d",
                    HOST, deployment.ports.control, HOST, deployment.ports.fleet)
        keys: list[Path | None] = [None] * nodes
        if not insecure:
            node_keys = list(deployment.require_certs().node_keys)
            deployment.register(node_keys)
            keys = list(node_keys)
        deployment.start_supernodes(node_configs(first, nodes), keys)
        logger.info("%d SuperNodes accepted; submitting %d run(s)", nodes, len(configs))
        submitted: dict[str, int] = {}
        finished: dict[str, dict[str, Any]] = {}
        for label, config in configs.items():
            run_config = write_run_config(config, out / f"run_config{'-' + label if label else ''}.toml", resume=resume)
            if side_by_side:
                deployment.wait_runs(list(submitted.values()), timeout, until_running=side_by_side - 1)
            submitted[label] = deployment.submit(app, run_config)
            if not side_by_side:
                finished[label] = deployment.wait_run(submitted[label], timeout)
        if side_by_side:
            rows = deployment.wait_runs(list(submitted.values()), timeout)
            finished = {label: rows[run_id] for label, run_id in submitted.items()}
        for label, config in configs.items():
            run_id, run = submitted[label], finished[label]
            server_log = deployment.logs / f"serverapp-{run_id}.log"
            if run.get("status") != "finished:completed":
                details = " ".join(str(run.get("status-details", "")).split())
                raise DeployError(f"run {run_id} ({label or config.strategy.name}) ended {run.get('status')}: "
                                  f"{details} (log: {server_log})")
            evidence[label] = {
                "run_id": run_id,
                "nodes": nodes,
                "clientapp": clientapp,
                "tls": not insecure,
                "supernode_auth": not insecure,
                "fleet_grpc_tls_logged": deployment.fleet_is_grpc_over_tls(),
                "ports": {"control": deployment.ports.control, "fleet": deployment.ports.fleet},
                "flower_run": {k: run.get(k) for k in ("status", "elapsed", "network-traffic", "compute-time")},
            }
        if on_ready is not None:
            on_ready(deployment)
    timings = {**deployment.timings, "total_seconds": round(time.monotonic() - started, 2)}
    results_by_label = {}
    for label, config in configs.items():
        folder = Path(config.output.dir)
        results_path = folder / "results.json"
        if not results_path.is_file():
            raise DeployError(f"run {evidence[label]['run_id']} finished without writing {results_path} "
                              f"(logs: {deployment.logs})")
        (folder / "deployment.json").write_text(json.dumps({**evidence[label], "timings": timings}, indent=2),
                                                encoding="utf-8")
        results = load_results(results_path)
        results["deployment"] = {**evidence[label], "timings": timings}
        results_by_label[label] = results
    return results_by_label
