"""Process supervision: long-running processes in sessions of their own, logging to files, waited on and stopped.

A :class:`Daemon` runs one command in its own session with stdout + stderr in a log file (files,
never pipes: a full pipe blocks the process writing to it); :meth:`Daemon.wait_for` waits for a
line of that log, :func:`port_open` for a port. :func:`stop_daemons` stops processes with every
descendant they started, :func:`terminate_on_signals` turns SIGTERM / SIGHUP into Ctrl-C so that
``finally`` blocks get to stop them. Nothing here knows Flower.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import psutil


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


class Daemon:
    """A long-running process in its own session; stdout + stderr go to a log file."""

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

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def close_log(self) -> None:
        with contextlib.suppress(OSError):
            self._log.close()


def stop_daemons(daemons: Sequence[Daemon], grace: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL after ``grace``, then end every descendant left.

    A descendant may run in a session of its own (the SuperLink's SuperExec) or be orphaned when
    its parent stops (a run's ``flwr-serverapp``), so descendants are collected before the first signal.
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
