"""Client trainers by strategy name (the client half of each strategy)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clients.trainers.base import LocalTrainer

# strategy name -> "module:Class"; strategies whose client is plain FedIT training use the base
TRAINERS: dict[str, str] = {
    "fedit": "clients.trainers.base:LocalTrainer",
}


def trainer_class(strategy_name: str) -> type[LocalTrainer]:
    if strategy_name not in TRAINERS:
        raise ValueError(f"no client trainer registered for strategy '{strategy_name}'")
    module, cls = TRAINERS[strategy_name].split(":")
    return getattr(importlib.import_module(module), cls)
