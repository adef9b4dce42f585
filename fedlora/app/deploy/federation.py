"""The federation on 127.0.0.1: one SuperLink and its SuperNodes, started, watched and stopped as processes.

:class:`LocalDeployment` picks the ports, writes the certificates and SuperNode keys
(:mod:`fedlora.app.deploy.certs`), starts ``flower-superlink`` (TLS and SuperNode authentication
unless ``insecure``), registers the keys, starts the SuperNodes (each with fedlora's warm
SuperExec, or Flower's own), submits runs and waits for them while every process stays alive, and
checks from the SuperLink's log that the Fleet API is gRPC over TLS. Every process gets its own
``FLWR_HOME`` under ``DIR/flwr`` and writes its log to ``DIR/logs/<name>.log``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from fedlora.app.deploy.certs import CertPaths, public_key_path, write_certs
from fedlora.app.deploy.flwr_cli import (
    FLEET_LOG_LINE,
    HOST,
    INSECURE_WARNINGS,
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
from fedlora.app.deploy.processes import (
    INTERRUPT_GRACE,
    STOP_GRACE,
    Daemon,
    port_open,
    processes_with_home,
    signals_held,
    stop_daemons,
)

logger = logging.getLogger("fedlora")


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


def clientapp_mode(wanted: str) -> str:
    """``wanted`` ('warm' or 'cold'), or 'cold' with one line when the installed Flower is not the one
    fedlora's warm SuperExec was built on (:func:`fedlora.app.deploy.warm.unsupported`): Flower's
    public path, its own SuperExec, rather than a failure deep inside a ClientApp."""
    if wanted != "warm":
        return wanted
    from fedlora.app.deploy.warm import unsupported

    reason = unsupported()
    if reason:
        logger.warning("%s: using Flower's own SuperExec (a fresh ClientApp process per message)", reason)
        return "cold"
    return wanted


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
    # the ServerApp's progress (round lines, refusals, a fedlora error) while a run goes, as it comes
    on_progress: Callable[[str], None] | None = None
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
        self.cli = FlwrCli(self.homes / "cli", self.cli_timeout)
        self._next_port = 0
        self.clientapp = clientapp_mode(self.clientapp)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        self.stop(interrupted=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def stop(self, interrupted: bool = False) -> None:
        """Stop every process this deployment started, each with every process it started.

        After a finished run: the SuperNodes first (they outlive a vanished SuperLink), then the
        SuperLink, each given :data:`~fedlora.app.deploy.processes.STOP_GRACE` seconds after
        SIGTERM. ``interrupted`` (Ctrl-C, SIGTERM, SIGHUP): the running ``flwr`` calls are killed,
        every process gets SIGTERM at once and :data:`~fedlora.app.deploy.processes.INTERRUPT_GRACE`
        seconds, then SIGKILL; a second Ctrl-C is ignored meanwhile (the stop is bounded: a few
        seconds). Either way every process whose ``FLWR_HOME`` is this deployment's is ended too
        (a ClientApp or ServerApp started while the others were being stopped). The rounds the
        ServerApp wrote are kept: results and checkpoints are written whole (a temporary file
        renamed), so a process killed mid-write leaves the previous version."""
        started = time.monotonic()
        sweep = processes_with_home(self.homes)
        with signals_held():
            if interrupted:
                self.cli.kill_running()
                stop_daemons(self.daemons, grace=INTERRUPT_GRACE, others=sweep)
            else:
                nodes = [d for d in self.daemons if d is not self.superlink]
                stop_daemons(nodes, grace=STOP_GRACE)
                stop_daemons([self.superlink] if self.superlink is not None else [], grace=STOP_GRACE, others=sweep)
        self.timings["stop_seconds"] = round(time.monotonic() - started, 2)

    def _spawn(self, name: str, cmd: list[str], home: str | None = None, share_log: Daemon | None = None,
               on_line: Callable[[str], None] | None = None) -> Daemon:
        log_path = share_log.log_path if share_log is not None else self.logs / f"{name}.log"
        daemon = Daemon(name, cmd, flower_env(self.homes / (home or name)), log_path, share_log, on_line)
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
        if not self.insecure:
            self.certs = write_certs(self.out_dir / "certs", num_nodes=self.num_nodes)
        cmd = superlink_cmd(self.ports.control, self.ports.fleet, None if self.insecure else self.certs)
        self.superlink = self._spawn("superlink", cmd)
        ready = self.superlink.wait_for(SUPERLINK_READY, self.start_timeout)
        while ready and not (port_open(HOST, self.ports.control) and port_open(HOST, self.ports.fleet)):
            if time.monotonic() - started > self.start_timeout:
                ready = False
                break
            time.sleep(0.1)
        if not ready:
            raise DeployError(
                f"the SuperLink did not start within {self.start_timeout:.0f}s: "
                f"{failure_reason(self.superlink.text())} (log: {self.superlink.log_path})"
            )
        self.cli.connect(self.ports.control, None if self.insecure else self.require_certs().ca_cert)
        self.timings["superlink_start_seconds"] = round(time.monotonic() - started, 2)
        return self.superlink

    def require_certs(self) -> CertPaths:
        """The certificates written when the SuperLink started (TLS mode)."""
        if self.certs is None:
            raise DeployError("no certificates: the SuperLink was not started with TLS")
        return self.certs

    def register(self, private_keys: Sequence[Path]) -> list[int]:
        """``flwr supernode register`` every key (in parallel); the node ids the SuperLink assigned."""
        started = time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        def one(key: Path) -> int:
            return self.cli.register(public_key_path(key))

        pool = ThreadPoolExecutor(max_workers=max(1, min(4, len(private_keys))))
        try:
            ids = list(pool.map(one, private_keys))
        finally:  # on Ctrl-C do not wait here for the running calls: stop() kills them
            pool.shutdown(wait=False, cancel_futures=True)
        self.timings["register_seconds"] = round(time.monotonic() - started, 2)
        return ids

    # ------------------------------------------------------------------ SuperNodes
    def spawn_supernode(self, name: str, node_config: dict[str, Any], key: Path | None, tls: bool) -> Daemon:
        """A SuperNode and, with ``clientapp = 'warm'``, fedlora's SuperExec for it
        (:mod:`fedlora.app.deploy.warm`: its Runtime API on loopback, its log in the SuperNode's,
        stopping when the SuperNode exits), as Flower's own SuperExec would run beside it."""
        port = self._take_port()
        if tls and self.certs is None:
            raise DeployError("a TLS SuperNode needs the deployment's CA; start the SuperLink with TLS")
        ca_cert = self.certs.ca_cert if tls and self.certs is not None else None
        warm = self.clientapp == "warm"
        daemon = self._spawn(name, supernode_cmd(self.ports.fleet, port, node_config, key, ca_cert,
                                                 self.max_retries, own_superexec=warm))
        if warm:
            cmd = warm_superexec_cmd(port, daemon.process.pid)
            self.superexecs[name] = self._spawn(f"{name}-superexec", cmd, home=name, share_log=daemon)
        return daemon

    def dead_superexec(self) -> Daemon | None:
        """The warm SuperExec of a running SuperNode that has exited (its messages would never run)."""
        for node in self.supernodes:
            superexec = self.superexecs.get(node.name)
            if superexec is not None and node.alive() and not superexec.alive():
                return superexec
        return None

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
                raise DeployError(f"SuperNode {daemon.name} {what}: {failure_reason(daemon.text())} "
                                  f"(log: {daemon.log_path})")
        self.supernodes.extend(new)
        self.timings["supernodes_start_seconds"] = round(time.monotonic() - started, 2)
        return new

    # ------------------------------------------------------------------ runs
    def submit(self, app: Path, run_config: Path) -> int:
        """``flwr run APP`` with a run-config file; the run id. The app's pyproject is never changed."""
        started = time.monotonic()
        run_id = self.cli.run(app, run_config)
        self.timings["submit_seconds"] = round(time.monotonic() - started, 2)
        return run_id

    def _check_alive(self, during: str) -> None:
        """DeployError if the SuperLink, a SuperNode or a SuperNode's warm SuperExec has exited."""
        for daemon in [self.superlink, *self.supernodes, self.dead_superexec()]:
            if daemon is not None and not daemon.alive():
                raise DeployError(f"{daemon.name} exited during {during}: {failure_reason(daemon.text())} "
                                  f"(log: {daemon.log_path})")

    def wait_run(self, run_id: int, timeout: float, poll: float = 5.0) -> dict[str, Any]:
        """Wait until the run is finished; fail fast if a SuperNode or the SuperLink dies.

        One ``flwr log RUN --stream`` process follows the ServerApp log into
        ``DIR/logs/serverapp-<run id>.log`` and ends when the run ends (cheap: a CLI call costs about a
        second of CPU); its progress lines go to ``on_progress`` as they arrive. ``flwr ls`` then
        reads the status. If the stream ends early, ``flwr ls`` is polled every ``poll`` seconds.
        """
        started = time.monotonic()
        deadline = started + timeout
        on_line = None
        if self.on_progress is not None:
            report = self.on_progress

            def on_line(line: str) -> None:
                progress = progress_of(line)
                if progress:
                    report(progress)

        stream = self._spawn(f"serverapp-{run_id}", log_stream_cmd(run_id), home="cli", on_line=on_line)
        run: dict[str, Any] = {"status": "unknown"}
        # on Ctrl-C or an error the stream stays one of the daemons: stop() ends it with the others, at once
        while True:
            if not stream.alive():
                run = self.cli.run_status(run_id)
                if str(run.get("status", "")).startswith("finished"):
                    break
            self._check_alive(f"run {run_id}")
            if time.monotonic() > deadline:
                self.cli.stop(run_id)
                raise DeployError(
                    f"run {run_id} did not finish within {timeout:.0f}s (status {run.get('status')}); "
                    f"stopped it (logs: {self.logs})"
                )
            time.sleep(poll if not stream.alive() else 1.0)
        stream.drained()
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
            rows = self.cli.runs()
            status = [str(rows.get(run_id, {}).get("status", "")) for run_id in run_ids]
            if until_running is not None:
                started_all = all(s == "running" or s.startswith("finished") for s in status)
                if started_all and status.count("running") <= until_running:
                    return {run_id: rows[run_id] for run_id in run_ids}
            elif all(s.startswith("finished") for s in status):
                self.timings["run_seconds"] = round(time.monotonic() - started, 2)
                return {run_id: rows[run_id] for run_id in run_ids}
            self._check_alive("the runs")
            if time.monotonic() > deadline:
                for run_id in run_ids:
                    self.cli.stop(run_id)
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
