"""A local Ray's start on a busy machine (fedlora.app.ray_start, ``federation.ray_start_timeout``).

Ray's own limits (30 s for its raylet to register, 30 s for the raylet's agent) ended runs on a
loaded 2-core machine in a traceback. The start now waits up to the setting, is cleaned up and
tried once more when it fails, and a start that still fails is one line saying what to do. The
retry and the wait are checked with stand-ins for Ray's calls (a start that fails once, a node
lookup that answers on its third call); the one line through the CLI with ``ray.init`` failing as
Ray fails; and a real Ray start and run beside one CPU-bound process per core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlora.app import ray_start

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
               "failed to startup or the GCS has become overloaded.")


@pytest.fixture
def no_clean_up(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``clean_up`` recorded instead of run (it stops this process's Ray children)."""
    cleaned: list[int] = []
    monkeypatch.setattr(ray_start, "clean_up", lambda: cleaned.append(1))
    return cleaned


def test_a_start_that_fails_is_cleaned_up_and_tried_once_more(no_clean_up: list[int]) -> None:
    # Prepare: a start that fails as Ray's does on a busy machine, then succeeds
    calls: list[float] = []

    def init() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise Exception(RAY_TIMEOUT)  # noqa: TRY002 - what Ray raises

    # Execute
    ray_start.start_local_ray(init, timeout=60.0)
    # Assert
    assert len(calls) == 2 and no_clean_up == [1]


def test_a_start_that_keeps_failing_is_one_line_saying_what_to_do(no_clean_up: list[int]) -> None:
    calls: list[int] = []

    def init() -> None:
        calls.append(1)
        raise Exception(RAY_TIMEOUT + "\nmore of Ray's text")  # noqa: TRY002 - what Ray raises

    with pytest.raises(ray_start.RayStartError) as raised:
        ray_start.start_local_ray(init, timeout=60.0)
    message = str(raised.value)
    assert len(calls) == ray_start.ATTEMPTS == 2 and no_clean_up == [1, 1]
    assert "\n" not in message and message.startswith("Ray did not start within ")
    assert f"({RAY_TIMEOUT})" in message and f"on {os.cpu_count()} cores" in message
    assert "federation.ray_start_timeout above 60 s" in message and "--engine inprocess" in message


def test_no_second_attempt_once_the_time_is_up(no_clean_up: list[int]) -> None:
    calls: list[int] = []

    def init() -> None:
        calls.append(1)
        time.sleep(0.2)
        raise Exception(RAY_TIMEOUT)  # noqa: TRY002 - what Ray raises

    with pytest.raises(ray_start.RayStartError, match="Ray did not start within 0 s"):
        ray_start.start_local_ray(init, timeout=0.1)
    assert calls == [1]


def test_the_node_lookup_waits_for_the_raylet_until_the_deadline_or_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: Ray's node lookup answering on its third call (the raylet registers late)
    from ray._private import services

    calls: list[int] = []

    def lookup(address: str, node_id: str) -> dict[str, str]:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("node not found")
        return {"node_id": node_id}

    monkeypatch.setattr(services, "get_node", lookup)
    monkeypatch.setattr(ray_start, "RETRY_PAUSE", 0.01)
    alive = [True]
    monkeypatch.setattr(ray_start, "raylet_alive", lambda: alive[0])
    # Execute / Assert: inside the start, Ray's call waits (as Ray's start loop calls it)
    with ray_start.patient_node_start(time.monotonic() + 30):
        assert services.get_node("gcs", "n1") == {"node_id": "n1"} and len(calls) == 3
        calls.clear()
        alive[0] = False  # the raylet crashed: no use waiting for it
        with pytest.raises(RuntimeError, match="node not found"):
            services.get_node("gcs", "n1")
        assert len(calls) == 1
    assert services.get_node is lookup  # Ray's own function again after the start
    # past the deadline: Ray's own behaviour, at once
    alive[0], calls[:] = True, []
    with ray_start.patient_node_start(time.monotonic() - 1), pytest.raises(RuntimeError):
        services.get_node("gcs", "n1")
    assert len(calls) == 1


def test_ray_waits_between_its_processes_are_raised_for_the_start_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_agent_register_timeout_ms", raising=False)
    monkeypatch.setenv("RAY_worker_register_timeout_seconds", "999")  # the user's own: kept
    with ray_start.ray_waits(300.0):
        assert os.environ["RAY_agent_register_timeout_ms"] == "300000"
        assert os.environ["RAY_worker_register_timeout_seconds"] == "999"
    assert "RAY_agent_register_timeout_ms" not in os.environ
    monkeypatch.delenv("RAY_worker_register_timeout_seconds")
    with ray_start.ray_waits(5.0):  # never below Ray's own defaults
        assert os.environ["RAY_agent_register_timeout_ms"] == "30000"
        assert os.environ["RAY_worker_register_timeout_seconds"] == "60"


def test_cli_run_whose_ray_does_not_start_ends_in_one_line(tmp_path: Path) -> None:
    # Prepare: the CLI with ray.init failing as it fails on an overloaded machine
    script = ("import sys, ray\n"
              "def init(*args, **kwargs):\n"
              f"    raise Exception({RAY_TIMEOUT!r})\n"
              "ray.init = init\n"
              "from fedlora.app.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "run"
    # Execute
    proc = subprocess.run([sys.executable, "-c", script, "run", str(SMOKE), "--engine", "ray", "--out", str(out),
                           "--set", "federation.ray_start_timeout=30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    # Assert: exit 2, one line on stderr saying what to do, no traceback, no half-made run folder
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("fedlora: error: Ray did not start within ") and "Traceback" not in proc.stdout
    assert "federation.ray_start_timeout above 30 s" in lines[0] and "--engine inprocess" in lines[0]
    assert not (out / "results.json").exists()



@pytest.mark.slow
def test_ray_starts_and_runs_beside_a_cpu_burner_on_every_core(busy_cores: int, tmp_path: Path) -> None:
    # Prepare: every core busy (on a shared machine, on top of whatever else runs)
    out = tmp_path / "run"
    # Execute: a real local Ray start and a one-round run on Flower's simulation engine
    proc = subprocess.run([sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--engine", "ray",
                           "--out", str(out), "--set", "train.rounds=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    # Assert
    assert proc.returncode == 0, f"{busy_cores} burners, load {os.getloadavg()}: {proc.stderr[-3000:]}"
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1] and results["rounds"][0]["clients"] == 3
