"""Strategies by name: ``strategy.name`` -> the Flower strategy class its method declares.

A lookup in the method registry (:mod:`fedlora.methods`: built-in homes, entry points and
:func:`fedlora.methods.register`), which holds the declarations; this module only checks that the
class a declaration names is a :class:`~fedlora.strategies.base.LoRAStrategy`. There is no list here
to edit.
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
    cls = declared.strategy_class()
    if not (isinstance(cls, type) and issubclass(cls, LoRAStrategy)):
        raise TypeError(f"method '{declared.name}': its strategy {declared.strategy!r} is not a LoRAStrategy subclass")
    if cls.method is not declared:
        raise TypeError(f"method '{declared.name}': its strategy {cls.__qualname__} runs method '{cls.method.name}'")
    return cls


def create_strategy(
    config: ExperimentConfig,
    initial_adapter: InitialAdapter,
    module_shapes: dict[str, tuple[int, int]],
) -> LoRAStrategy:
    """Instantiate the configured strategy."""
    return strategy_class(config.strategy.name)(config, initial_adapter, module_shapes)
