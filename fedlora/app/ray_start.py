"""Starting a local Ray on a busy machine (``federation.ray_start_timeout``).

``ray.init`` starts Ray's GCS, a raylet and its agents, then waits for the raylet to register with
the GCS, and Ray's processes wait for each other, each with a fixed limit: the driver 30 s for the
registration (a number in Ray's code, ``ray._private.node``), the raylet ``agent_register_timeout_ms``
for its metrics agent to come up (a Python process: it crashed the raylet with "Timed out waiting
for file .../metrics_agent_port" on this 2-core machine at load 12 to 16), a new worker process
``worker_register_timeout_seconds`` (60 s) to import Ray and register. On a 2-core machine with
other work running (a test suite, a benchmark: load 5 to 16) every one of those processes shares
the cores with everything else; the start then fails with "The current node timed out during
startup ... the GCS has become overloaded" and the run ended in a traceback.

:func:`start_local_ray` gives the start ``federation.ray_start_timeout`` seconds instead (default
300): Ray's two waits between its own processes get that limit (``RAY_agent_register_timeout_ms``
and ``RAY_worker_register_timeout_seconds`` in the environment of the processes Ray starts, unless
the user set them), and while ``ray.init`` waits for its raylet, Ray's node lookup
(``ray._private.services.get_node``, which it calls in that wait) retries until the raylet answers,
the raylet process is gone, or the time is up, so Ray's own 30 s check only fires after ours. A
start that fails all the same (the time is up, or a part of Ray gave up) is cleaned up
(``ray.shutdown``, and any GCS or raylet process it left behind) and tried once more while time is
left; a start that still fails is one line (:class:`RayStartError`) saying how busy the machine
was and what to do. A Ray whose internals moved (no ``get_node``) starts with Ray's own wait and
still gets the second attempt and the one line.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

ATTEMPTS = 2  # a start that failed with time left is cleaned up and tried once more
RETRY_PAUSE = 0.5  # seconds between two node lookups while the raylet registers
RAY_PROCESSES = ("gcs_server", "raylet")  # what a failed start may leave running
AGENT_WAIT = 30.0  # Ray's agent_register_timeout_ms on Linux, in seconds (src/ray/common/ray_config_def.h)
WORKER_WAIT = 60.0  # Ray's worker_register_timeout_seconds


class RayStartError(RuntimeError):
    """Ray did not start on this machine within ``federation.ray_start_timeout`` (one line)."""


@contextlib.contextmanager
def ray_waits(timeout: float) -> Iterator[None]:
    """Ray's waits between its own processes (the raylet for its agent, a worker's registration)
    raised to ``timeout`` seconds (never below Ray's own defaults) in the environment the processes
    it starts inherit, for the duration of the start; a value the user set is kept."""
    wanted = {"RAY_agent_register_timeout_ms": str(int(max(timeout, AGENT_WAIT) * 1000)),
              "RAY_worker_register_timeout_seconds": str(int(max(timeout, WORKER_WAIT)))}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def raylet_alive() -> bool:
    """Whether a raylet this process started is running (a crashed one never registers)."""
    return bool(left_behind(("raylet",)))


@contextlib.contextmanager
def patient_node_start(deadline: float) -> Iterator[None]:
    """While active, Ray's node lookup retries a missing node until ``deadline`` (``time.monotonic``)
    or until the raylet is gone, instead of failing at once: Ray's start loop then waits for its
    raylet until our deadline."""
    from ray._private import services

    original: Callable[..., Any] | None = getattr(services, "get_node", None)
    if original is None:  # another Ray: its own wait
        yield
        return
    lookup: Callable[..., Any] = original

    def get_node(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return lookup(*args, **kwargs)
            except RuntimeError:  # "node not found" while the raylet registers
                if time.monotonic() >= deadline or not raylet_alive():
                    raise
                time.sleep(RETRY_PAUSE)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def left_behind(names: tuple[str, ...] = RAY_PROCESSES) -> list[Any]:
    """This process's child processes (psutil) named like one of ``names``: the GCS and raylet of
    a start that failed, by default."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(name in child.name() for name in names):
                found.append(child)
    return found


def clean_up() -> None:
    """Shut Ray down after a failed start and stop what it left running (this process's own children)."""
    import psutil
    import ray

    with contextlib.suppress(Exception):  # a half-started Ray may fail to shut down: its processes go below
        ray.shutdown()
    processes = left_behind()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def load_line() -> str:
    """'load 7.2 on 2 cores' (the 1-minute load average), or '' where the system has none."""
    if not hasattr(os, "getloadavg"):
        return ""
    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count() or 1} cores"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def start_local_ray(init: Callable[[], None], timeout: float) -> None:
    """Call ``init`` (a ``ray.init`` of a local Ray) with up to ``timeout`` seconds for the node to
    start, over at most :data:`ATTEMPTS` attempts; :class:`RayStartError` when it does not."""
    started = time.monotonic()
    deadline = started + timeout
    reason = ""
    for _ in range(ATTEMPTS):
        try:
            with ray_waits(timeout), patient_node_start(deadline):
                init()
            return
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception when its node start times out
            reason = first_line(error)
            clean_up()
        if time.monotonic() >= deadline:
            break
    busy = load_line()
    raise RayStartError(
        f"Ray did not start within {time.monotonic() - started:.0f} s ({reason}){'; ' + busy if busy else ''}: "
        f"set federation.ray_start_timeout above {timeout:g} s (--set federation.ray_start_timeout=600), "
        "run again when the machine is less busy, or run without Ray (--engine inprocess)")
