"""Strategies by name: ``strategy.name`` -> the Flower strategy class of that method.

A strategy registers itself by existing: every module of the ``strategies`` package is scanned
for :class:`~fedlora.strategies.base.LoRAStrategy` subclasses with a ``method``; the names and their
options come from the method homes (:mod:`fedlora.methods`), so adding a method means adding its
home, one module here and its trainer, with no list to edit.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import cache

from fedlora import methods
from fedlora.schema import ExperimentConfig
from fedlora.strategies.base import InitialAdapter, LoRAStrategy

_NOT_STRATEGIES = {"base", "registry", "roster", "validation", "ledger", "replies"}


@cache
def _discover() -> dict[str, type[LoRAStrategy]]:
    from fedlora import strategies

    found: dict[str, type[LoRAStrategy]] = {}
    for info in pkgutil.iter_modules(strategies.__path__):
        if info.name in _NOT_STRATEGIES:
            continue
        module = importlib.import_module(f"{strategies.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, LoRAStrategy) and cls.__module__ == module.__name__ and hasattr(cls, "method"):
                name = cls.method.name
                if name in found and found[name] is not cls:
                    raise RuntimeError(f"two strategies for method '{name}'")
                found[name] = cls
    return found


def strategy_names() -> list[str]:
    return sorted(_discover())


def strategy_class(name: str) -> type[LoRAStrategy]:
    """The class registered under ``name`` (ConfigError listing the known names otherwise)."""
    methods.method(name)  # ConfigError for an unknown name
    return _discover()[name]


def create_strategy(
    config: ExperimentConfig,
    initial_adapter: InitialAdapter,
    module_shapes: dict[str, tuple[int, int]],
) -> LoRAStrategy:
    """Instantiate the configured strategy."""
    return strategy_class(config.strategy.name)(config, initial_adapter, module_shapes)
