"""Strategies by name: the one place that maps ``strategy.name`` to a class.

Each strategy module registers itself with :func:`register`; this module imports them all, so
``create_strategy`` and ``validate_strategy_options`` see every method.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pydantic import ValidationError

from fedlora.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from strategies.base import InitialAdapter, LoRAStrategy

# name -> "module:Class"; imported lazily so that listing names costs nothing
STRATEGIES: dict[str, str] = {
    "fedit": "strategies.fedit:FedIT",
}


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def strategy_class(name: str) -> type[LoRAStrategy]:
    """The class registered under ``name`` (ConfigError listing the known names otherwise)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}'; known: {', '.join(strategy_names())}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def validate_strategy_options(config: ExperimentConfig) -> None:
    """Check ``[strategy]`` against the strategy's options model and fill in its defaults."""
    cls = strategy_class(config.strategy.name)
    try:
        options = cls.Options(**config.strategy.options())
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"unknown option 'strategy.{key}' for strategy '{cls.name}'") from None
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"invalid option 'strategy.{key}' for '{cls.name}': {message}, got {first.get('input')!r}") from None
    for key, value in options.model_dump().items():
        setattr(config.strategy, key, value)
    cls.check_config(config)


def create_strategy(
    config: ExperimentConfig,
    initial_adapter: InitialAdapter,
    module_shapes: dict[str, tuple[int, int]],
) -> LoRAStrategy:
    """Instantiate the configured strategy."""
    return strategy_class(config.strategy.name)(config, initial_adapter, module_shapes)
