"""Flower's commands as fedlora drives them: command lines, environment, log lines and ``flwr`` replies.

The command lines of ``flower-superlink``, ``flower-supernode`` and fedlora's warm SuperExec
(:mod:`fedlora.app.deploy.warm`), the environment every Flower process gets, the lines of Flower's
logs that say a process is ready or why it failed (Flower 1.39 wording), and :class:`FlwrCli`: the
``flwr`` client (``supernode register``, ``run``, ``ls``, ``log``, ``stop``) with ``--format json``,
its connection in its own ``FLWR_HOME``. docs/deployment.md, "Flower 1.39 behaviour", has the
behaviour these encode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from fedlora.app.deploy.certs import CertPaths

logger = logging.getLogger("fedlora")

HOST = "127.0.0.1"
CONNECTION = "fedlora-local"
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr live next to python
SUPERLINK_READY = "Uvicorn running on"
SUPERNODE_READY = "SuperNode ID:"
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


# The ServerApp's lines (through Flower's logger) a person follows while a run goes: what `fedlora run`
# prints (fedlora.app.driver.progress_line), a client refused or back, a resumed run, a fedlora error.
PROGRESS_PREFIXES = ("round ", "query: ", "resuming ", "fedlora: error:")


def progress_of(line: str) -> str:
    """``line`` of a ServerApp log as fedlora's progress line, its spacing kept ('' when it is not one)."""
    text = _LEVEL.sub("", _ANSI.sub("", line).strip()).rstrip()
    return text if text.startswith(PROGRESS_PREFIXES) else ""


def failure_reason(log: str) -> str:
    """The lines of a Flower process's log that say why it failed (most specific first), as one line."""
    lines = [_plain(line) for line in log.splitlines()]
    hits = [line for line in lines if any(marker in line for marker in REFUSAL_MARKERS)]
    specific = [line for line in hits if not line.startswith(GENERIC_REFUSALS)]
    picked = (specific + hits)[:3] if hits else [line for line in lines if line][-2:]
    return " | ".join(dict.fromkeys(picked)) or "no output"


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


def superlink_cmd(control_port: int, fleet_port: int, certs: CertPaths | None, fleet_host: str = HOST) -> list[str]:
    """``flower-superlink``, its Control API on ``HOST`` (loopback), its Fleet API on ``fleet_host``: with
    ``certs``, TLS and SuperNode authentication; without, insecure."""
    cmd = [str(BIN / "flower-superlink")]
    if certs is None:
        cmd.append("--insecure")
    else:
        cmd += [
            "--ssl-ca-certfile", str(certs.ca_cert),
            "--ssl-certfile", str(certs.server_cert),
            "--ssl-keyfile", str(certs.server_key),
            "--enable-supernode-auth",
        ]  # fmt: skip
    cmd += [
        "--disable-runtime-dependency-installation",
        "--host", HOST, "--port", str(control_port),
        "--fleet-api-address", f"{fleet_host}:{fleet_port}",
    ]  # fmt: skip
    return cmd


def supernode_cmd(fleet_port: int, port: int, node_config: dict[str, Any], key: Path | None,
                  ca_cert: Path | None, max_retries: int, own_superexec: bool, superlink: str = "",
                  host: str = HOST) -> list[str]:
    """``flower-supernode`` against the Fleet API on ``fleet_port`` of ``HOST`` (or at ``superlink``,
    host:port), its Runtime API on ``host:port``: TLS with ``ca_cert`` (None: insecure), authenticated
    with the private ``key`` if any; ``own_superexec``: in ``--isolation process``, for a SuperExec
    started beside it."""
    cmd = [str(BIN / "flower-supernode"), "--superlink", superlink or f"{HOST}:{fleet_port}"]
    if ca_cert is not None:
        cmd += ["--root-certificates", str(ca_cert)]
    else:
        cmd.append("--insecure")
    if key is not None:
        cmd += ["--auth-supernode-private-key", str(key)]
    cmd += [
        "--node-config", node_config_string(node_config),
        "--max-retries", str(max_retries),  # Flower's default retries forever
        "--host", host, "--port", str(port),
    ]  # fmt: skip
    if own_superexec:
        cmd += ["--isolation", "process"]
    return cmd


def warm_superexec_cmd(port: int, parent_pid: int, host: str = HOST) -> list[str]:
    """fedlora's warm SuperExec (:mod:`fedlora.app.deploy.warm`) for the SuperNode whose Runtime API
    is on ``host:port`` and whose process is ``parent_pid`` (it stops when that one exits)."""
    return [sys.executable, "-m", "fedlora.app.deploy.warm", "--runtime-api-address", f"{host}:{port}",
            "--insecure", "--parent-pid", str(parent_pid)]


def log_stream_cmd(run_id: int) -> list[str]:
    """``flwr log RUN --stream``: follows the run's ServerApp log and ends when the run ends."""
    return [str(BIN / "flwr"), "log", str(run_id), CONNECTION, "--stream"]


class FlwrCli:
    """The ``flwr`` command-line client against one SuperLink (the connection ``CONNECTION`` in
    ``home``, its ``FLWR_HOME``); every call waits at most ``timeout`` seconds."""

    def __init__(self, home: Path, timeout: float) -> None:
        self.home = home
        self.timeout = timeout
        self._running: set[subprocess.Popen[str]] = set()  # the calls under way (several: parallel registrations)
        self._lock = threading.Lock()

    def kill_running(self) -> None:
        """SIGKILL every ``flwr`` call under way (a stopping deployment does not wait for its answers)."""
        with self._lock:
            running = list(self._running)
        for process in running:
            with contextlib.suppress(OSError):
                process.kill()

    def connect(self, control_port: int, ca_cert: Path | None) -> None:
        """Write the connection to the Control API on ``control_port``: TLS with ``ca_cert`` (None: insecure)."""
        self.home.mkdir(parents=True, exist_ok=True)
        security = "insecure = true" if ca_cert is None else f'root-certificates = "{ca_cert}"'
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{HOST}:{control_port}"\n{security}\n',
            encoding="utf-8",
        )

    def call(self, *args: str, timeout: float | None = None) -> dict[str, Any]:
        """Run ``flwr ARGS --format json``; the parsed JSON reply."""
        cmd = [str(BIN / "flwr"), *args, "--format", "json"]
        # subprocess.run's own steps, with the process known to kill_running while it runs
        with subprocess.Popen(cmd, env=flower_env(self.home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL) as process:
            with self._lock:
                self._running.add(process)
            try:
                stdout, stderr = process.communicate(timeout=timeout or self.timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                raise DeployError(f"`flwr {args[0]}` did not answer within {timeout or self.timeout:.0f}s") from None
            except BaseException:  # Ctrl-C: the call dies with the deployment
                process.kill()
                raise
            finally:
                with self._lock:
                    self._running.discard(process)
        done = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
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

    def register(self, public_key: Path) -> int:
        """``flwr supernode register``: the node id the SuperLink assigned to the key."""
        reply = self.call("supernode", "register", str(public_key), CONNECTION)
        return int(reply["node-id"])

    def run(self, app: Path, run_config: Path) -> int:
        """``flwr run APP`` with a run-config file; the run id. The app's pyproject is never changed."""
        pyproject = app / "pyproject.toml"
        before = pyproject.read_bytes()
        try:
            reply = self.call("run", str(app), CONNECTION, "--run-config", str(run_config))
        finally:
            if pyproject.read_bytes() != before:  # e.g. a legacy [tool.flwr.federations] migration
                pyproject.write_bytes(before)
                logger.warning("flwr run rewrote %s; restored it", pyproject)
        return int(reply["run-id"])

    def run_status(self, run_id: int) -> dict[str, Any]:
        """``flwr ls --run-id``: the run's row (status ``unknown`` when it has none)."""
        runs = self.call("ls", CONNECTION, "--run-id", str(run_id)).get("runs", [])
        return runs[0] if runs else {"status": "unknown"}

    def runs(self) -> dict[int, dict[str, Any]]:
        """``flwr ls``: run id -> its row."""
        return {int(r.get("run-id", 0)): r for r in self.call("ls", CONNECTION).get("runs", [])}

    def nodes(self) -> dict[int, str]:
        """``flwr supernode list``: node id -> its status (``registered``, ``online``, ``offline``, ...)."""
        rows = self.call("supernode", "list", CONNECTION).get("nodes", [])
        return {int(row.get("node-id", 0)): str(row.get("status", "")) for row in rows}

    def stop(self, run_id: int) -> None:
        """``flwr stop``; a failure is ignored (the run may have ended meanwhile)."""
        with contextlib.suppress(DeployError):
            self.call("stop", str(run_id), CONNECTION)
