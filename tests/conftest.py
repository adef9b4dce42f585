"""Fixtures shared by test modules."""

from __future__ import annotations

from pathlib import Path

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


# The longest modules first (pytest-xdist --dist loadscope hands out modules in collection order, so a
# long module collected last would run alone at the end): module sums measured with
# `make test` (--durations), longest first. Modules not listed keep their order after these.
LONGEST_FIRST = (
    "test_deploy_strategies.py", "test_deploy_faults.py", "test_output_folders.py", "test_deploy.py",
    "test_resume.py", "test_compare.py", "test_golden.py", "test_flwr_run.py", "test_ray_cluster.py",
    "test_bad_input.py", "test_quiet.py", "test_causal_lm.py", "test_protocol.py", "test_run.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept
