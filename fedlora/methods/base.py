"""What every method home declares: its options model, its capabilities, its config checks.

A method home (``fedlora/methods/<name>.py``) is the one place a method's defaults live. It holds
the method's :class:`MethodOptions` subclass (every ``[strategy]`` key with its default, allowed
values and help text), the wire keys its strategy and trainer exchange, and its pure math (numpy
functions over per-module factors). Its Flower strategy (``strategies/<name>.py``, the server
protocol) and its client trainer (``clients/trainers/<name>.py``, the client step) import them;
neither restates a default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


class MethodOptions(BaseModel):
    """Options of a method (``[strategy]`` keys next to ``name``); unknown keys are errors, and a
    numeric option refuses text and booleans (:func:`fedlora.schema.numbers_only`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        from fedlora.schema import numbers_only

        return numbers_only(cls, info.field_name, value)


OptionsT = TypeVar("OptionsT", bound=MethodOptions)


Reference = str | type[Any]
"""A method's part: the class itself, or ``"package.module:Class"``, imported when first needed (a
built-in method's home names its strategy and trainer so: the core imports nothing above it)."""


@dataclass(frozen=True)
class Method(Generic[OptionsT]):
    """A method's one declaration: its name, options, capabilities, Flower strategy and client
    trainer, paired by this one call (as peft's ``register_peft_method`` pairs a config class and a
    model class). The parts do not point back: a strategy class finds its declaration by lookup
    (:func:`fedlora.methods.declaring`), so the declaration is the only link.

    A built-in method's home ends with ``METHOD = Method(...)``; a method of your own is announced by
    an entry point or :func:`fedlora.methods.register` (docs/development.md, "Adding a method").
    Generic over its options model: ``Method(options=FedHeraOptions, ...)`` is a
    ``Method[FedHeraOptions]``, so :meth:`parse` and ``check`` see the method's own options type (a
    strategy declared ``LoRAStrategy[FedHeraOptions]`` gets ``self.options: FedHeraOptions``).
    ``check(experiment, options)`` raises :class:`fedlora.errors.ConfigError` for experiments the
    method cannot run (cross-section rules its options model cannot see on its own).
    """

    name: str
    options: type[OptionsT]
    capabilities: Capabilities
    # its Flower strategy: a LoRAStrategy subclass (the server protocol)
    strategy: Reference
    # its client trainer: a LocalTrainer subclass (the client step); the default trains A and B
    trainer: Reference = "fedlora.clients.trainers.base:LocalTrainer"
    check: Callable[[ExperimentConfig, OptionsT], None] | None = None
    # Other names ``strategy.name`` may give for this method (e.g. FedIT's common name, ``fedavg``): a config
    # naming one is read as naming the method (``strategy.name`` becomes ``name``; the run is the method's)
    aliases: tuple[str, ...] = ()

    def parse(self, experiment: ExperimentConfig) -> OptionsT:
        """This method's typed options from ``experiment.strategy`` (defaults filled in)."""
        return self.options(**experiment.strategy.options())

    def strategy_class(self) -> Any:
        """The strategy class (imported on first use when named by reference)."""
        return resolve(self.strategy)

    def trainer_class(self) -> Any:
        """The client trainer class (imported on first use when named by reference)."""
        return resolve(self.trainer)

    def names_strategy(self, cls: type[Any]) -> bool:
        """Whether ``cls`` is this method's strategy class (compared by reference, importing nothing)."""
        return self.strategy is cls or self.strategy == f"{cls.__module__}:{cls.__qualname__}"


class NoOptions(MethodOptions):
    """A method without options of its own."""


def require_kaiming_init(experiment: ExperimentConfig, why: str) -> None:
    """ConfigError unless ``model.init`` is 'kaiming': for a method that draws its rank-nested A
    itself (:func:`fedlora.lora.nested_A`: kaiming-uniform, B = 0); ``why`` begins the line."""
    if experiment.model.init != "kaiming":
        raise ConfigError(
            f"{why} (kaiming-uniform, B = 0); model.init must be 'kaiming', got {experiment.model.init!r}"
        )


def resolve(part: Reference) -> Any:
    """A method's part: the class it is, or the one its ``"module:Class"`` reference names."""
    return load_reference(part) if isinstance(part, str) else part


def load_reference(reference: str) -> Any:
    """The object a ``"package.module:Name"`` reference names (a Method's strategy or trainer)."""
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ValueError(f"not a 'module:Name' reference: {reference!r}")
    return getattr(importlib.import_module(module), name)
