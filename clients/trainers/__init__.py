"""Client trainers by strategy name (the client half of each method).

A lookup in the method registry (:mod:`fedlora.methods`): a method's declaration names its trainer
(``Method.trainer``; the default, :class:`~fedlora.clients.trainers.base.LocalTrainer`, trains A and B);
this module only checks that it is a ``LocalTrainer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora import methods

if TYPE_CHECKING:
    from fedlora.clients.trainers.base import LocalTrainer


def trainer_class(strategy_name: str) -> type[LocalTrainer]:
    """The client trainer the method ``strategy_name`` declares."""
    from fedlora.clients.trainers.base import LocalTrainer

    declared = methods.method(strategy_name)
    trainer = declared.trainer_class()
    if not (isinstance(trainer, type) and issubclass(trainer, LocalTrainer)):
        raise TypeError(f"method '{declared.name}': its trainer {declared.trainer!r} is not a LocalTrainer subclass")
    return trainer
