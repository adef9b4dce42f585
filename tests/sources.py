"""fedlora's source tree, read as text by the tests: the package and the layers mapped into it.

The repository keeps the protocol and engine layers at its top (``strategies/``, ``clients/``,
``simulations/``, beside ``fedlora/``); installed, they are ``fedlora.strategies``,
``fedlora.clients`` and ``fedlora.simulations`` (pyproject's ``[tool.setuptools.package-dir]``).
Every test that scans the code by path goes through :func:`source_files` and :func:`module_name`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its folder in the repository (``fedlora`` and pyproject's mapping)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    return {"fedlora": ROOT / "fedlora", **{name: ROOT / folder for name, folder in setuptools["package-dir"].items()}}


SOURCE_FOLDERS = tuple(folder.relative_to(ROOT).as_posix() for folder in package_dirs().values())


def source_files() -> list[Path]:
    """Every Python file of the installed package, in the repository."""
    return sorted(path for folder in package_dirs().values() for path in folder.rglob("*.py"))


def module_name(path: Path) -> str:
    """The module a source file installs as (``strategies/base.py`` -> ``fedlora.strategies.base``)."""
    for package, folder in sorted(package_dirs().items(), key=lambda item: -len(item[1].parts)):
        if path.is_relative_to(folder):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(f"{path} is not a source file of fedlora")


def build_wheel(scratch: Path) -> Path:
    """fedlora's wheel, built Flower-free from a copy of the files a build reads (a build in the
    repository would leave ``build/`` there) under ``scratch``; returns the wheel's path."""
    import shutil
    import subprocess
    import sys

    source = scratch / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in SOURCE_FOLDERS:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(scratch / "wheel"), str(source)], capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    return next((scratch / "wheel").glob("fedlora-*.whl"))
