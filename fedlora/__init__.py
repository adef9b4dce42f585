"""fedlora: federated LoRA fine-tuning on Flower.

Public Python API (for notebooks): ``fedlora.run(config, overrides=None, out_dir=None)`` runs one
experiment in Flower's simulation engine and returns its results dict; ``fedlora.load_config``
reads and validates a TOML config; ``fedlora.compare(config, strategies, seeds, ...)`` runs a
strategy comparison and returns its table (see :mod:`fedlora.compare`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def run(config: Any, overrides: list[str] | None = None, out_dir: Any = None, verbose: bool = False) -> dict:
    """Run one experiment (see :func:`fedlora.runner.run`)."""
    from fedlora.runner import run as _run

    return _run(config, overrides=overrides, out_dir=out_dir, verbose=verbose)


def load_config(path: Any, overrides: list[str] | None = None):
    """Read and validate a TOML experiment config (see :func:`fedlora.config.load_config`)."""
    from fedlora.config import load_config as _load

    return _load(path, overrides)


# The function shadows the submodule name on purpose (``fedlora.compare(...)``); import the
# module's other names with ``from fedlora.compare import summarize, run_jobs``.
from fedlora.compare import compare

__all__ = ["__version__", "compare", "load_config", "run"]
