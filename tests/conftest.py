"""Fixtures shared by test modules, and how `make test` spreads the modules over its workers."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

# One BLAS / OpenMP thread per process, set before anything imports torch: `make test` runs four
# pytest-xdist workers on two cores and the deployment tests start further Flower processes; more
# threads than cores only wait on each other. Subprocesses (CLI, SuperLink, SuperNodes) inherit it.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
# One set of CPU kernels on every x86-64 machine: torch's (ATen, oneDNN, MKL) at AVX2 and OpenBLAS's
# (numpy, scipy) for Haswell, also where the CPU has AVX-512. CI's machines differ (some AVX2 only,
# some AVX-512), and so do their float results, from the first training step (1e-7; 1e-4 after two
# rounds): the numbers pinned in tests/golden/ hold on every machine only with the same kernels.
# test_golden.py checks that they are in force.
for _name, _value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                      ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("OPENBLAS_CORETYPE", "Haswell")):
    os.environ.setdefault(_name, _value)
# Ray's workers at normal priority (Ray's default is nice 15: next to the other workers' processes
# they starved, 24 s Ray runs took 5-20 min). fedlora's runner sets the same for its own Ray
# starts; this covers the Ray the tests start directly (the two-node cluster, Flower's simulation
# under `flwr run`).
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's own 30 s / 60 s waits between its processes (a raylet for its metrics agent, a worker's
# registration), raised as fedlora's runner raises them for its own Ray starts
# (federation.ray_start_timeout, fedlora.app.ray_start): for the Ray that Flower starts under `flwr run`
# and the two-node cluster, beside a CPU burner on every core (on a loaded 2-core machine the agent
# took longer and the raylet died with "Timed out waiting for file .../metrics_agent_port").
os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")

import psutil
import pytest
from deploy_helpers import processes_of


@pytest.fixture
def no_leftovers(tmp_path: Path):
    """Assert after the test that nothing it started is still running (and clean up if so)."""
    yield tmp_path
    left = processes_of(tmp_path)
    _, alive = psutil.wait_procs(left, timeout=5)  # a process exiting right now is not a leak
    names = [" ".join(p.cmdline()[:2]) for p in alive if p.is_running()]
    for proc in alive:
        proc.kill()
    assert names == [], f"processes left behind: {names}"


# Modules that start real Flower deployments (SuperLink, SuperNodes, a process per message) share one
# lane: they run one after the other on one worker, so one deployment runs at a time, beside three
# workers of in-process tests. Flower declares a task whose process has not reported within 30 s of
# being handed it dead and hands the task out again (to a new process, the old one still starting):
# on an overloaded machine that feeds itself (CI: four deployments at once failed; a run with two
# lanes grew to 268 ServerApp processes and a load of 200).
DEPLOYMENT_LANES = {
    "test_deploy_strategies.py": "deployments", "test_deploy.py": "deployments",
    "test_deploy_faults.py": "deployments", "test_output_folders.py": "deployments",
    "test_flwr_run.py": "deployments", "test_deploy_secure.py": "deployments",
    "test_federation_hosts.py": "deployments",
}
# The lane first, then the longest modules (work units are handed out in collection order, see
# pytest_xdist_make_scheduler, so a long module collected last would run alone at the end): module sums measured with `make test`
# (it prints them at the end). Modules not listed keep their order after these.
LONGEST_FIRST = (
    "test_deploy_strategies.py", "test_deploy.py", "test_deploy_faults.py", "test_output_folders.py",
    "test_flwr_run.py", "test_deploy_secure.py", "test_federation_hosts.py", "test_resume.py", "test_compare.py", "test_golden.py", "test_ray_cluster.py",
    "test_bad_input.py", "test_quiet.py", "test_causal_lm.py", "test_protocol.py", "test_run.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept


@pytest.hookimpl(optionalhook=True)  # a plain `pytest -p no:xdist` run has no such hook
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``loadscope`` (a module is one work unit, its module fixtures are built once),
    with each deployment lane as one work unit, handed out in collection order (loadscope's default
    reorders the units by their number of tests, which started the long deployment lanes last)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModulesAndDeploymentLanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return DEPLOYMENT_LANES.get(Path(module).name, module)

    return ModulesAndDeploymentLanes(config, log)


# The deployment lane at normal priority, the other workers at nice 5 (their subprocesses, Ray
# included, inherit it): a deployment mostly waits on Flower starting a process per task within its
# 30-s window, the in-process tests only need the CPU the lane leaves. Lowering a worker's niceness
# again (after an in-process module, for the lane) needs root or CAP_SYS_NICE; without it the lane
# keeps the worker's priority, as before.
OTHERS_NICENESS = 5


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = 0 if item.path.name in DEPLOYMENT_LANES else OTHERS_NICENESS
    if os.getpriority(os.PRIO_PROCESS, 0) != wanted:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, wanted)


# Wall time per module (setup + call + teardown of its tests), printed at the end of the run so CI's
# tail shows where the time went.
_MODULE_SECONDS: dict[str, float] = defaultdict(float)
_STARTED = time.monotonic()


_WORKER_CPU: list[float] = []


def _cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in used)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: report to the controller
        session.config.workeroutput["cpu_seconds"] = _cpu_seconds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _WORKER_CPU.append(getattr(node, "workeroutput", {}).get("cpu_seconds", 0.0))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _MODULE_SECONDS:
        return
    lanes: dict[str, float] = defaultdict(float)
    for module, seconds in _MODULE_SECONDS.items():
        lanes[DEPLOYMENT_LANES.get(Path(module).name, "")] += seconds
    terminalreporter.section("seconds per test module (summed over its tests)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    for lane, seconds in sorted(lanes.items()):
        if lane:
            terminalreporter.write_line(f"{seconds:8.1f}  lane {lane}")
    terminalreporter.write_line(f"{time.monotonic() - _STARTED:8.1f}  wall clock of the whole session")
    if _WORKER_CPU:
        terminalreporter.write_line(f"{sum(_WORKER_CPU):8.1f}  CPU seconds of the workers and the processes they "
                                    "waited for (2 cores: the wall clock cannot go below half of it)")


@pytest.fixture
def busy_cores() -> Iterator[int]:
    """Every core busy with a CPU-bound process beside the test (a loaded machine: a fresh clone's
    `make test` beside other work); killed afterwards. Yields the number of burners."""
    import os
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield len(burners)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
