"""The method registry: ``strategy.name`` -> a method's one declaration, and back from its parts.

A method is declared once, by a :class:`~fedlora.methods.base.Method` that names its options,
capabilities, strategy and client trainer; the strategy and the trainer do not point back (a
strategy class finds its declaration with :func:`declaring`). The registry holds three sources,
read once (:func:`forget` reads them again):

- the built-in methods: the modules of this package, each ending with ``METHOD = Method(...)``;
- a method of your own in an installed package, announced by an entry point in the group
  ``fedlora.methods`` (``toy = "my_package.toy:METHOD"`` under ``[project.entry-points."fedlora.methods"]``
  of its pyproject): every process (server, clients, deployments) finds it;
- a method registered in this process with :func:`register` (a notebook, a test, your own
  ServerApp and ClientApp that both call it).

Every other lookup reads this one: ``fedlora.strategies.registry.strategy_class`` and
``fedlora.clients.trainers.trainer_class`` only check the type of the class a declaration names
(docs/development.md, "Adding a method").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import ValidationError

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError, did_you_mean, shown
from fedlora.methods.base import Method, MethodOptions, NoOptions, OptionsT, Reference, load_reference

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "Capabilities",
    "Declaration",
    "FromDeclaration",
    "Method",
    "MethodOptions",
    "NoOptions",
    "OptionsT",
    "Reference",
    "aliases",
    "built_in_names",
    "canonical_name",
    "catalogue",
    "check_own",
    "declaring",
    "forget",
    "load_reference",
    "method",
    "method_names",
    "options_of",
    "read_options",
    "register",
]

T = TypeVar("T")
ENTRY_POINT_GROUP = "fedlora.methods"  # entry points naming a ``Method`` declared outside fedlora


_registered: dict[str, Method[Any]] = {}  # register(): methods declared in this process
_declared_by: dict[type[Any], Method[Any]] = {}  # declaring(): strategy class -> its declaration, as looked up
_built_in: set[str] = set()  # the names declared by the modules of this package (found by _discover)


def _declarations() -> list[tuple[str, Any]]:
    """(where, what) for every declaration: the built-in homes, the entry points, the registered."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base", "docs"):
            found.append((f"{__name__}.{info.name}", getattr(importlib.import_module(f"{__name__}.{info.name}"), "METHOD", None)))
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.append((f"entry point {entry.name} = {entry.value}", entry.load()))
    found += [(f"register({name!r})", declared) for name, declared in _registered.items()]
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
        if where.startswith(f"{__name__}."):
            _built_in.add(declared.name)
    return found


def built_in_names() -> list[str]:
    """The methods fedlora itself declares (the modules of this package), by name."""
    _discover()
    return sorted(_built_in)


def register(declared: Method[Any]) -> Method[Any]:
    """Add a method declared in this process (a notebook, a test, an app of your own) to the
    registry, beside the built-in ones and the entry points; returns it. Only this process knows
    it: a deployment's nodes find a method through an entry point of an installed package."""
    if not isinstance(declared, Method):
        raise TypeError(f"register({declared!r}): not a fedlora.methods.Method")
    if declared.name in _discover() or declared.name in aliases():
        raise RuntimeError(f"method name '{declared.name}' declared twice (register)")
    _registered[declared.name] = declared
    _clear()
    return declared


def forget() -> None:
    """Drop what was found and registered: the next lookup discovers the methods again (after
    installing a method's package; a test that registered a method)."""
    _registered.clear()
    _clear()


def _clear() -> None:
    _discover.cache_clear()
    _built_in.clear()
    aliases.cache_clear()
    _declared_by.clear()


def declaring(cls: type[Any]) -> Method[Any]:
    """The declaration whose strategy is ``cls`` or the nearest of its bases (a subclass of a
    method's strategy runs that method); TypeError when no declaration names any of them."""
    if cls not in _declared_by:
        for klass in cls.__mro__:
            named = [declared for declared in _discover().values() if declared.names_strategy(klass)]
            if len(named) > 1:
                raise TypeError(f"{klass.__qualname__} is the strategy of {len(named)} methods: "
                                f"{', '.join(sorted(d.name for d in named))}")
            if named:
                _declared_by[cls] = named[0]
                break
        else:
            raise TypeError(f"{cls.__qualname__} is the strategy of no declared method (declare it with "
                            "fedlora.methods.Method(..., strategy=...))")
    return _declared_by[cls]


class Declaration:
    """A class attribute, ``method = Declaration()``: the declaration naming the class (:func:`declaring`),
    looked up when first read (a strategy class is defined before the registry can know it)."""

    def __get__(self, instance: object, owner: type[Any]) -> Method[Any]:
        try:
            return declaring(owner)
        except TypeError as error:
            raise AttributeError(str(error)) from None


class FromDeclaration(Generic[T]):
    """A class attribute read from the class's ``method`` (its declaration): ``name =
    FromDeclaration(lambda declared: declared.name)``."""

    def __init__(self, read: Callable[[Method[Any]], T]) -> None:
        self.read = read

    def __get__(self, instance: object, owner: type[Any]) -> T:
        return self.read(owner.method)


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
