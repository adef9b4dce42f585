"""fedlora: federated LoRA fine-tuning on Flower.

Public Python API (for notebooks): ``fedlora.run(config, overrides=None, out_dir=None, resume=None,
overwrite=False)`` runs one experiment and returns its results dict (an output folder holding an
earlier run is refused unless resumed or, with ``overwrite``, moved aside); ``fedlora.load_config``
reads and validates a TOML config; ``fedlora.compare(config, strategies, seeds, ...)`` runs a strategy comparison and
returns its table (see :mod:`fedlora.app.compare`).

This module is the package's facade: it sits above everything (the application layer
included) and imports lazily, so that importing a core module (``fedlora.lora``,
``fedlora.config``, ...) never loads the application.
"""

from __future__ import annotations

import os
from typing import Any

from fedlora.version import __version__

# Flower's usage telemetry is read once, when Flower is first imported: off unless the user set it
# (fedlora runs offline and its users' silos should not call out). Set before anything imports flwr.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def run(config: Any, overrides: list[str] | None = None, out_dir: Any = None, verbose: bool = False,
        engine: str = "ray", resume: Any = None, overwrite: bool = False) -> dict:
    """Run one experiment (see :func:`fedlora.app.runner.run`): ``out_dir`` must be new or empty
    unless ``resume`` (that folder: continue its run) or ``overwrite`` (move the earlier run aside)."""
    from fedlora.app.runner import run as _run

    return _run(config, overrides=overrides, out_dir=out_dir, verbose=verbose, engine=engine, resume=resume,
                overwrite=overwrite)


def load_config(path: Any, overrides: list[str] | None = None) -> Any:
    """Read and validate a TOML experiment config (see :func:`fedlora.config.load_config`)."""
    from fedlora.config import load_config as _load

    return _load(path, overrides)


def compare(*args: Any, **kwargs: Any) -> Any:
    """Run strategies x seeds on the same partitions and summarise (see :func:`fedlora.app.compare.compare`)."""
    from fedlora.app.compare import compare as _compare

    return _compare(*args, **kwargs)


__all__ = ["__version__", "compare", "load_config", "run"]
