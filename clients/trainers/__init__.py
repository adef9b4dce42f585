"""Client trainers by strategy name (the client half of each strategy).

Every module of this package is scanned for :class:`~fedlora.clients.trainers.base.LocalTrainer`
subclasses; a trainer serves the strategies named in its ``strategy_names``. Adding a method's
client means adding one module, with no list to edit.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedlora.clients.trainers.base import LocalTrainer


@cache
def _discover() -> dict[str, type[LocalTrainer]]:
    from fedlora.clients.trainers.base import LocalTrainer

    found: dict[str, type[LocalTrainer]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, LocalTrainer) and cls.__module__ == module.__name__:
                for name in cls.strategy_names:
                    if name in found and found[name] is not cls:
                        raise RuntimeError(f"two client trainers for strategy '{name}'")
                    found[name] = cls
    return found


def trainer_class(strategy_name: str) -> type[LocalTrainer]:
    """The client trainer of ``strategy_name``."""
    registered = _discover()
    if strategy_name not in registered:
        raise ValueError(f"no client trainer registered for strategy '{strategy_name}'")
    return registered[strategy_name]
