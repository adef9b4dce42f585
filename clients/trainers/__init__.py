"""Client trainers by strategy name (the client half of each method).

A method's declaration names its trainer (``Method.trainer``, ``"module:Class"``;
:mod:`fedlora.methods`); the default trains A and B (:class:`~fedlora.clients.trainers.base.LocalTrainer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora import methods

if TYPE_CHECKING:
    from fedlora.clients.trainers.base import LocalTrainer


def trainer_class(strategy_name: str) -> type[LocalTrainer]:
    """The client trainer the method ``strategy_name`` declares."""
    from fedlora.clients.trainers.base import LocalTrainer

    trainer = methods.load_reference(methods.method(strategy_name).trainer)
    if not (isinstance(trainer, type) and issubclass(trainer, LocalTrainer)):
        raise TypeError(f"method '{strategy_name}': its trainer is not a LocalTrainer subclass")
    return trainer
