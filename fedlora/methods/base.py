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


@dataclass(frozen=True)
class Capabilities:
    """What a method declares about itself (rendered into the README's capability matrix)."""

    personalized: bool
    uploads: str
    downloads: str
    mixed_ranks: bool = False  # clients may declare different ranks (False: one rank, clients.mixed_rank_policy)
    partial_participation: bool = True
    dp_compatible: bool = True  # its client step runs under Opacus DP-SGD
    paper: str = ""
    causal_lm: str = ""  # why the method refuses model.kind = 'causal_lm' ('' = it runs on causal LMs)
    # faults.aggregation = median / trimmed_mean / bulyan replaces the method's weighted means of uploaded
    # arrays coordinate by coordinate, krum / multikrum / bulyan select whole uploads first
    # (strategies/robust.py; a linear method only); False: the method refuses them, saying why
    robust_aggregation: bool = False
    not_robust: str = ""  # why a method refuses faults.aggregation other than 'mean' (robust_aggregation False)
    # Flower's DifferentialPrivacyClientSideFixedClipping can wrap the strategy (with fixedclipping_mod on
    # the clients): its aggregate is a fixed-weight mean of the uploads, each upload is the download
    # plus the client's update, and it continues from the noised arrays it is given (docs/flower.md)
    flower_dp: bool = False
    not_flower_dp: str = ""  # why the wrapper cannot wrap the method (flower_dp False)
    # secure_aggregation.enabled (SecAgg+, docs/secure-aggregation.md): the method's aggregate is the weighted
    # mean of the uploads, A rows and B columns zero-padded to the round's largest rank, and each upload has the
    # keys and shapes of its download (a client masks upload - download; the server sees only the mean)
    secure_aggregation: bool = False
    not_secure: str = ""  # why the method refuses secure aggregation (secure_aggregation False)
    secure_one_rank: str = ""  # why it refuses secure aggregation with mixed ranks ('' = mixed ranks are fine)
    # [server_optimizer] (FedAvgM, FedAdam, FedYogi: strategies/server_optimizer.py) steps on the method's mean: its
    # aggregate is a mean of the uploads, its global arrays are what every client downloads alike (cut to its rank),
    # and ``load_arrays`` continues from other arrays of their keys and shapes
    server_optimizer: bool = False
    not_server_optimizer: str = ""  # why the method refuses a server optimiser (server_optimizer False)
    # train.proximal_mu (FedProx's client term): the client starts its local training from what it downloaded and
    # trains through fedlora.training.train / optimise with the trainer's step_options()
    proximal: bool = False
    not_proximal: str = ""  # why the method refuses FedProx's term (proximal False)


OptionsT = TypeVar("OptionsT", bound=MethodOptions)


@dataclass(frozen=True)
class Method(Generic[OptionsT]):
    """A method home's declaration: ``METHOD = Method(...)`` at the bottom of its module, the one
    place a method is declared: its name, options, capabilities, strategy and trainer.

    Generic over its options model: ``Method(options=FedHeraOptions, ...)`` is a
    ``Method[FedHeraOptions]``, so :meth:`parse` and ``check`` see the method's own options type
    (a strategy declared ``LoRAStrategy[FedHeraOptions]`` with ``method = fedhera.METHOD`` gets
    ``self.options: FedHeraOptions``, checked by mypy). ``check(experiment, options)`` raises
    :class:`fedlora.errors.ConfigError` for experiments the method cannot run (cross-section
    rules its options model cannot see on its own).
    """

    name: str
    options: type[OptionsT]
    capabilities: Capabilities
    # "module:Class" of the Flower strategy (the server protocol, a LoRAStrategy subclass whose
    # ``method`` is this declaration); imported when a run first needs it, so the core imports
    # nothing above it
    strategy: str
    # "module:Class" of the client trainer (a LocalTrainer subclass); the default trains A and B
    trainer: str = "fedlora.clients.trainers.base:LocalTrainer"
    check: Callable[[ExperimentConfig, OptionsT], None] | None = None
    # Other names ``strategy.name`` may give for this method (e.g. FedIT's common name, ``fedavg``): a config
    # naming one is read as naming the method (``strategy.name`` becomes ``name``; the run is the method's)
    aliases: tuple[str, ...] = ()

    def parse(self, experiment: ExperimentConfig) -> OptionsT:
        """This method's typed options from ``experiment.strategy`` (defaults filled in)."""
        return self.options(**experiment.strategy.options())


class NoOptions(MethodOptions):
    """A method without options of its own."""


def require_kaiming_init(experiment: ExperimentConfig, why: str) -> None:
    """ConfigError unless ``model.init`` is 'kaiming': for a method that draws its rank-nested A
    itself (:func:`fedlora.lora.nested_A`: kaiming-uniform, B = 0); ``why`` begins the line."""
    if experiment.model.init != "kaiming":
        raise ConfigError(
            f"{why} (kaiming-uniform, B = 0); model.init must be 'kaiming', got {experiment.model.init!r}"
        )


def load_reference(reference: str) -> Any:
    """The object a ``"package.module:Name"`` reference names (a Method's strategy or trainer)."""
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ValueError(f"not a 'module:Name' reference: {reference!r}")
    return getattr(importlib.import_module(module), name)
