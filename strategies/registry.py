"""Strategies by name: ``strategy.name`` -> the Flower strategy class its method declares.

The names, options and classes come from the method declarations (:mod:`fedlora.methods`:
``Method.strategy`` is the class's ``"module:Class"``), so there is no list here to edit.
"""

from __future__ import annotations

from fedlora import methods
from fedlora.schema import ExperimentConfig
from fedlora.strategies.base import InitialAdapter, LoRAStrategy


def strategy_names() -> list[str]:
    return methods.method_names()


def strategy_class(name: str) -> type[LoRAStrategy]:
    """The class the method ``name`` declares (ConfigError listing the known names otherwise)."""
    declared = methods.method(name)
    cls = methods.load_reference(declared.strategy)
    if not (isinstance(cls, type) and issubclass(cls, LoRAStrategy)) or getattr(cls, "method", None) is not declared:
        raise TypeError(f"method '{name}': {declared.strategy} is not a LoRAStrategy whose `method` is its declaration")
    return cls


def create_strategy(
    config: ExperimentConfig,
    initial_adapter: InitialAdapter,
    module_shapes: dict[str, tuple[int, int]],
) -> LoRAStrategy:
    """Instantiate the configured strategy."""
    return strategy_class(config.strategy.name)(config, initial_adapter, module_shapes)
