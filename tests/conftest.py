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
