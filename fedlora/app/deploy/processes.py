"""Process supervision: long-running processes in sessions of their own, logging to files, waited on and stopped.

A :class:`Daemon` runs one command in its own session with stdout + stderr in a log file (files,
never pipes: a full pipe blocks the process writing to it); :meth:`Daemon.wait_for` waits for a
line of that log, :func:`port_open` for a port. :func:`stop_daemons` stops processes with every
descendant they started, in bounded time: SIGTERM to every process group and descendant at once,
SIGKILL to what is left after a grace period (:data:`STOP_GRACE` after a finished run,
:data:`INTERRUPT_GRACE` after Ctrl-C, so that an interrupted deployment is gone within seconds on
a loaded machine too). :func:`terminate_on_signals` turns SIGTERM / SIGHUP into :class:`Terminated`
(a KeyboardInterrupt that knows its signal: the command exits 128 + signal, 143 for SIGTERM) so that
``finally`` blocks get to stop them; :func:`signals_held` keeps a second Ctrl-C from cutting that
stop short. A Daemon given ``on_line`` also hands every line of its output, as it comes, to a
callback (a thread drains the pipe into the log file: the pipe never fills). Nothing here knows Flower.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import psutil

STOP_GRACE = 10.0  # seconds a process gets to exit after SIGTERM when a finished run is shut down
INTERRUPT_GRACE = 2.0  # seconds it gets after Ctrl-C (SIGTERM, SIGHUP): then SIGKILL, loaded machine or not
KILL_WAIT = 3.0  # seconds to wait for SIGKILLed processes to be gone (they cannot refuse; a busy kernel delays)


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that ``finally`` blocks stop what was started; the
    command exits with 128 + :attr:`signum` (143 for SIGTERM), as a shell reports a terminated program."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by ``interrupt``: 130 for Ctrl-C, 128 + signal otherwise."""
    return 128 + (interrupt.signum if isinstance(interrupt, Terminated) else signal.SIGINT)


class Daemon:
    """A long-running process in its own session; stdout + stderr go to a log file. With ``on_line``
    every line of its output also goes, as it comes, to that callback (from a reader thread)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 share_log: Daemon | None = None, on_line: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # share_log: write into another daemon's open log (one offset, as a child it started would)
        self._log: BinaryIO = share_log._log if share_log is not None else log_path.open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            cmd, env=env, stdout=self._log if on_line is None else subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._reader: threading.Thread | None = None
        if on_line is not None:
            self._reader = threading.Thread(target=self._relay, args=(on_line,), daemon=True, name=f"{name}-lines")
            self._reader.start()

    def _relay(self, on_line: Callable[[str], None]) -> None:
        """Copy the process's output into its log, line by line, and hand each line to ``on_line``."""
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            with contextlib.suppress(OSError, ValueError):
                self._log.write(raw)
                self._log.flush()
            with contextlib.suppress(Exception):  # a callback's failure must not stop the draining
                on_line(raw.decode("utf-8", errors="replace").rstrip("\n"))

    def drained(self, timeout: float = 5.0) -> None:
        """Wait until the reader thread has passed on the process's last line (after it exited)."""
        if self._reader is not None:
            self._reader.join(timeout)

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

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def close_log(self) -> None:
        self.drained(1.0)
        with contextlib.suppress(OSError):
            self._log.close()


def stop_daemons(daemons: Sequence[Daemon], grace: float = STOP_GRACE,
                 others: Callable[[], Iterable[psutil.Process]] = tuple) -> None:
    """Stop ``daemons`` with every process they started, in at most about ``grace + 2 * KILL_WAIT``
    seconds: SIGTERM to each daemon's process group and to every descendant and every process of
    ``others()`` (all at once); after ``grace`` seconds, or as soon as all are gone, SIGKILL to the
    groups and to every process left, collected again (descendants and ``others()`` started
    meanwhile too); wait for them at most :data:`KILL_WAIT`.

    A descendant may run in a session of its own (the SuperLink's SuperExec) or be orphaned when
    its parent stops (a run's ``flwr-serverapp``), so descendants are collected before the first
    signal; ``others`` finds what even that misses (e.g. every process with the deployment's
    ``FLWR_HOME``, :func:`processes_with_home`).
    """
    running = [daemon for daemon in daemons if daemon.alive()]
    procs = _collect(running, others)
    for daemon in running:
        daemon.signal_group(signal.SIGTERM)
    _signal(procs.values(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(d.alive() for d in running) or _alive(procs.values())):
        time.sleep(0.1)
    left = [daemon for daemon in running if daemon.alive()]
    procs.update(_collect(left, others))
    for daemon in left:
        daemon.signal_group(signal.SIGKILL)
    _signal(procs.values(), signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT
    for daemon in daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.process.wait(timeout=max(0.1, deadline - time.monotonic()))  # reap
        daemon.close_log()
    while _alive(procs.values()) and time.monotonic() < deadline:  # a zombie is gone (psutil.wait_procs
        time.sleep(0.05)  # would wait for an orphan's zombie until the timeout where no init reaps it)


def _collect(daemons: Sequence[Daemon], others: Callable[[], Iterable[psutil.Process]]) -> dict[int, psutil.Process]:
    """Every descendant of ``daemons`` and every process of ``others()``, by pid; never this process."""
    procs = {proc.pid: proc for daemon in daemons for proc in daemon.descendants()}
    with contextlib.suppress(psutil.Error):
        procs |= {proc.pid: proc for proc in others()}
    procs.pop(os.getpid(), None)
    return procs


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` still running (a zombie has exited; psutil checks the start time, so
    a reused pid is not mistaken for the process)."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in _alive(procs):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def processes_with_home(home: Path) -> Callable[[], list[psutil.Process]]:
    """A finder of the processes (of this user) whose ``FLWR_HOME`` lies under ``home``: every process
    a deployment starts has one, however it was started (also a ClientApp a SuperExec forked
    while the deployment was being stopped)."""
    prefix = str(home)

    def find() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("FLWR_HOME", "").startswith(prefix):
                    found.append(proc)
        return found

    return find


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP while the block runs (a bounded stop: a second Ctrl-C must
    not leave half of the processes running); only in the main thread, where Python handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP raise :class:`Terminated` (a KeyboardInterrupt, like Ctrl-C) so ``finally``
    blocks stop the processes; only in the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
