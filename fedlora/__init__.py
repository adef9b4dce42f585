"""fedlora: federated LoRA fine-tuning on Flower.

Public Python API (for notebooks and scripts), typed:

- ``fedlora.run(config, overrides=None, out_dir=None, verbose=False, engine="ray", resume=None,
  overwrite=False)`` runs one experiment and returns its :class:`RunResults`: the results.json
  dict (``results["final"]["global_accuracy"]``) with ``.per_round`` and ``.per_client`` as
  pandas DataFrames. An output folder holding an earlier run is refused unless resumed or, with
  ``overwrite``, moved aside.
- ``fedlora.compare(config, strategies, seeds=(0,), ...)`` runs a strategy comparison and returns
  its :class:`~fedlora.app.summary.ComparisonTable` (see :mod:`fedlora.app.compare`).
- ``fedlora.load_config(path, overrides)`` reads and validates a TOML config;
  ``fedlora.load_results(folder)`` reads a run's results back as :class:`RunResults`.

``config`` is an :class:`ExperimentConfig` (``fedlora.ExperimentConfig(train={"rounds": 3})``), a
TOML file's path or a mapping of its sections; ``overrides`` are ``section.key=value`` strings (as
``--set`` takes them) or a mapping: ``{"train.lr": 1e-3}`` or ``{"train": {"lr": 1e-3}}``.
In a notebook a run shows a progress bar that updates in place.

This module is the package's facade: it sits above everything (the application layer
included) and imports lazily, so that importing a core module (``fedlora.lora``,
``fedlora.config``, ...) never loads the application; the names below resolve on first use
(their signatures are the real functions', for IDEs and ``help``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fedlora.version import __version__

if TYPE_CHECKING:
    from fedlora.app.compare import compare
    from fedlora.app.runner import run
    from fedlora.app.summary import ComparisonTable
    from fedlora.results import RunResults
    from fedlora.schema import ConfigSource, ExperimentConfig, Settings

# Flower's usage telemetry is read once, when Flower is first imported: off unless the user set it
# (fedlora runs offline and its users' silos should not call out). Set before anything imports flwr.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

# name -> (module, attribute): imported on first use (PEP 562)
_LAZY: dict[str, tuple[str, str]] = {
    "run": ("fedlora.app.runner", "run"),
    "compare": ("fedlora.app.compare", "compare"),
    "ExperimentConfig": ("fedlora.schema", "ExperimentConfig"),
    "RunResults": ("fedlora.results", "RunResults"),
    "ComparisonTable": ("fedlora.app.summary", "ComparisonTable"),
    "ConfigSource": ("fedlora.schema", "ConfigSource"),
    "Settings": ("fedlora.schema", "Settings"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fedlora' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # once: later lookups are plain attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load_config(path: str | os.PathLike[str], overrides: Settings = None) -> ExperimentConfig:
    """Read and validate a TOML experiment config (see :func:`fedlora.config.load_config`);
    ``overrides``: ``section.key=value`` strings or a mapping."""
    from fedlora.config import load_config as _load
    from fedlora.schema import overrides_from

    return _load(path, overrides_from(overrides))


def load_results(path: str | os.PathLike[str]) -> RunResults:
    """A run's results (its folder, or its results.json) as :class:`RunResults`."""
    from fedlora.results import RunResults

    return RunResults.load(path)


__all__ = ["ComparisonTable", "ConfigSource", "ExperimentConfig", "RunResults", "Settings", "__version__", "compare",
           "load_config", "load_results", "run"]
