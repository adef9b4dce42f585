"""Method homes by name: the one place that maps ``strategy.name`` to a method's declaration.

A method is declared once, by a ``METHOD = Method(...)`` that names its options, capabilities,
strategy and trainer (:class:`fedlora.methods.base.Method`). The built-in methods are the modules
of this package; a method of your own is a module anywhere on the path, announced by an entry
point in the group ``fedlora.methods`` (``toy = "my_package.toy:METHOD"`` under
``[project.entry-points."fedlora.methods"]`` of its pyproject), with nothing of fedlora's to edit
(docs/design.md, "Adding a method").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError, did_you_mean, shown
from fedlora.methods.base import Method, MethodOptions, NoOptions, OptionsT, load_reference

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "Capabilities",
    "Method",
    "MethodOptions",
    "NoOptions",
    "OptionsT",
    "aliases",
    "canonical_name",
    "catalogue",
    "check_own",
    "forget",
    "load_reference",
    "method",
    "method_names",
    "options_of",
    "read_options",
]

ENTRY_POINT_GROUP = "fedlora.methods"  # entry points naming a ``Method`` declared outside fedlora


def _declarations() -> list[tuple[str, Any]]:
    """(where, what) for every declaration: the built-in homes, then the entry points."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base", "docs"):
            found.append((f"{__name__}.{info.name}", getattr(importlib.import_module(f"{__name__}.{info.name}"), "METHOD", None)))
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.append((f"entry point {entry.name} = {entry.value}", entry.load()))
    return found


@cache
def _discover() -> dict[str, Method[Any]]:
    found: dict[str, Method[Any]] = {}
    for where, declared in _declarations():
        if declared is None and where.startswith(__name__):
            continue  # a helper module of the package
        if not isinstance(declared, Method):
            raise TypeError(f"{where}: not a fedlora.methods.Method")
        if declared.name in found:
            raise RuntimeError(f"method name '{declared.name}' declared twice ({where})")
        found[declared.name] = declared
    return found


def forget() -> None:
    """Discover the methods again on the next lookup (after installing a method's package)."""
    _discover.cache_clear()
    aliases.cache_clear()


def method_names() -> list[str]:
    return sorted(_discover())


@cache
def aliases() -> dict[str, str]:
    """Alias -> the name of the method declaring it (``fedavg`` -> ``fedit``)."""
    found: dict[str, str] = {}
    for name, declared in _discover().items():
        for alias in declared.aliases:
            if alias in _discover() or alias in found:
                raise RuntimeError(f"method alias '{alias}' of '{name}' is already a method name or alias")
            found[alias] = name
    return found


def canonical_name(name: str) -> str:
    """``name``, or the method an alias names (``fedavg`` -> ``fedit``)."""
    return aliases().get(name, name)


def method(name: str) -> Method[Any]:
    """The method declared under ``name`` or an alias of it (ConfigError listing the known names otherwise)."""
    known = _discover()
    name = canonical_name(name)
    if name not in known:
        choices = method_names() + sorted(aliases())
        named = [*method_names(), *(f"{alias} (= {of})" for alias, of in sorted(aliases().items()))]
        raise ConfigError(f"unknown strategy {shown(name)}{did_you_mean(name[:100], choices)}; "
                          f"known: {', '.join(named)}")
    return known[name]


def options_of(experiment: ExperimentConfig) -> Any:
    """The options of the experiment's method, looked up by name (so their type is known at run
    time only; a strategy gets them typed from its own ``Method[OptionsT]``)."""
    return method(experiment.strategy.name).parse(experiment)


def read_options(config: ExperimentConfig) -> tuple[Method[Any], MethodOptions]:
    """The method ``[strategy]`` names and its options, checked against its options model, with the
    defaults filled into ``config.strategy`` (an alias is replaced by its method's name)."""
    declared = method(config.strategy.name)
    config.strategy.name = declared.name  # an alias names its method (fedavg: fedit)
    try:
        options = declared.parse(config)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            known = did_you_mean(key, list(declared.options.model_fields), "strategy.")
            raise ConfigError(f"unknown option 'strategy.{key}' for strategy '{declared.name}'{known}") from None
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"invalid option 'strategy.{key}' for '{declared.name}': {message}, got {first.get('input')!r}") from None
    for key, value in options.model_dump().items():
        setattr(config.strategy, key, value)
    return declared, options


def check_own(config: ExperimentConfig, declared: Method[Any], options: MethodOptions, given: set[str]) -> None:
    """The method's own cross-section rules (``Method.check``), its error naming the strategy and
    the defaults that took part (``given``: the options the config set itself)."""
    if declared.check is None:
        return
    try:
        declared.check(config, options)
    except ConfigError as error:
        raise ConfigError(_naming_the_strategy(str(error), declared.name, given, options)) from None


def catalogue() -> dict[str, Capabilities]:
    """Every known method's capabilities, by name."""
    return {name: declared.capabilities for name, declared in _discover().items()}


def _naming_the_strategy(message: str, name: str, given: set[str], options: MethodOptions) -> str:
    """A method's own check failed: say which strategy, and which of its defaults took part (an
    option the user did not set, named in the message, e.g. fedtreelora's warm-up of 3 rounds
    against a 2-round run)."""
    defaults = [f"strategy.{key} = {value!r}" for key, value in options.model_dump().items()
                if key not in given and f"strategy.{key}" in message]
    default_note = f" ({', '.join(defaults)}: {name}'s default)" if defaults else ""
    return f"strategy '{name}': {message}{default_note}"
