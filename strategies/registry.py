"""Strategies by name: the one place that maps ``strategy.name`` to a class.

A strategy registers itself by existing: every module of the ``strategies`` package is scanned
for :class:`~strategies.base.LoRAStrategy` subclasses with a ``name``, so adding a method means
adding one module, with no list to edit.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import cache
from typing import TYPE_CHECKING

from pydantic import ValidationError

from fedlora.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from strategies.base import InitialAdapter, LoRAStrategy

_NOT_STRATEGIES = {"base", "registry"}


@cache
def _discover() -> dict[str, type[LoRAStrategy]]:
    import strategies
    from strategies.base import LoRAStrategy

    found: dict[str, type[LoRAStrategy]] = {}
    for info in pkgutil.iter_modules(strategies.__path__):
        if info.name in _NOT_STRATEGIES:
            continue
        module = importlib.import_module(f"strategies.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, LoRAStrategy) and cls.name and cls.__module__ == module.__name__:
                if cls.name in found and found[cls.name] is not cls:
                    raise RuntimeError(f"strategy name '{cls.name}' registered twice")
                found[cls.name] = cls
    return found


def strategy_names() -> list[str]:
    return sorted(_discover())


def strategy_class(name: str) -> type[LoRAStrategy]:
    """The class registered under ``name`` (ConfigError listing the known names otherwise)."""
    registered = _discover()
    if name not in registered:
        raise ConfigError(f"unknown strategy '{name}'; known: {', '.join(strategy_names())}")
    return registered[name]


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
    _check_rank_policy(cls, config)
    _check_privacy(cls, config)
    cls.check_config(config)


def _check_privacy(cls: type[LoRAStrategy], config: ExperimentConfig) -> None:
    """``privacy.dp`` with a strategy whose client step Opacus cannot make private."""
    if config.privacy.dp and not cls.capabilities.dp_compatible:
        usable = ", ".join(n for n in strategy_names() if strategy_class(n).capabilities.dp_compatible)
        raise ConfigError(f"privacy.dp = true is not supported by strategy '{cls.name}' (its client step is "
                          f"not DP-SGD compatible); use one of {usable}, or set privacy.dp = false")


def _check_rank_policy(cls: type[LoRAStrategy], config: ExperimentConfig) -> None:
    """A same-rank method with ``clients.mixed_rank_policy = refuse`` and mixed configured ranks."""
    declared = set(config.clients.ranks) or {r for r, share in config.clients.rank_tiers.items() if share > 0}
    if cls.capabilities.mixed_ranks or config.clients.mixed_rank_policy != "refuse" or len(declared) < 2:
        return
    raise ConfigError(
        f"strategy '{cls.name}' needs one LoRA rank for every client but clients declare ranks "
        f"{sorted(int(r) for r in declared)}; use flexlora, hetlora, flora or fedhera, or set "
        "clients.mixed_rank_policy=smallest"
    )


def create_strategy(
    config: ExperimentConfig,
    initial_adapter: InitialAdapter,
    module_shapes: dict[str, tuple[int, int]],
) -> LoRAStrategy:
    """Instantiate the configured strategy."""
    return strategy_class(config.strategy.name)(config, initial_adapter, module_shapes)
