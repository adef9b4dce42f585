"""fedlora's warm SuperExec (fedlora/app/deploy/warm.py), the parts that need no deployment: what a
forked child keeps of its parent, and bad settings. Every deployment test runs it end to end
(``fedlora deploy local`` uses it by default)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_a_child_forgets_the_projects_modules_and_keeps_the_libraries() -> None:
    # The parent imported fedlora (its own package, and here the config layer); the child must load
    # fedlora from the run's FAB, as a fresh flwr-clientapp does, and keep the preloaded libraries.
    done = run_python(
        "import sys, numpy, fedlora.config, fedlora.app.deploy.warm as warm\n"
        "assert 'fedlora.config' in sys.modules and 'fedlora.schema' in sys.modules\n"
        "warm._forget_project_modules()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fedlora', 'clients', 'strategies', 'simulations')))\n"
        "print('numpy' in sys.modules, 'pydantic' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True True"]


def test_a_bad_poll_interval_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedlora.app.deploy.warm", "--runtime-api-address", "127.0.0.1:1", "--insecure"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "soon"},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "error: FLWR_SUPEREXEC_TASK_POLL_INTERVAL must be a number of seconds"


def test_on_another_flower_a_deployment_falls_back_to_flowers_own_superexec(tmp_path: Path, monkeypatch, caplog) -> None:
    """The warm SuperExec uses Flower 1.39 internals: on another Flower (or one without them) a
    deployment says so in one line and runs Flower's own SuperExec, before any process starts."""
    import logging

    from fedlora.app.deploy import warm
    from fedlora.app.deploy.federation import LocalDeployment

    # Prepare: this Flower passes the check; a later minor and a missing module do not
    assert warm.unsupported() == ""
    assert warm.unsupported("1.40.0") == "Flower 1.40.0 is installed, fedlora's warm SuperExec uses Flower 1.39 internals"
    monkeypatch.setattr(warm, "INTERNAL_MODULES", (*warm.INTERNAL_MODULES, "flwr.supercore.no_such_module"))
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedlora"):
        deployment = LocalDeployment(tmp_path, 1, clientapp="warm")
    # Assert
    assert deployment.clientapp == "cold"
    from importlib.metadata import version

    line = (f"Flower {version('flwr')} has no flwr.supercore.no_such_module, which fedlora's warm SuperExec imports: "
            "using Flower's own SuperExec (a fresh ClientApp process per message)")
    assert [record.getMessage() for record in caplog.records] == [line]
