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

from fedlora.errors import ConfigError, did_you_mean, shown
from fedlora.methods.base import Capabilities, Method, MethodOptions, NoOptions, OptionsT, load_reference

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
    "forget",
    "load_reference",
    "method",
    "method_names",
    "options_of",
    "validate",
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


def validate(config: ExperimentConfig) -> None:
    """Check ``[strategy]`` against its method's options model, fill in the defaults, and apply
    the method's and the platform's cross-section rules (ranks, privacy)."""
    declared = method(config.strategy.name)
    config.strategy.name = declared.name  # an alias names its method (fedavg: fedit)
    given = set(config.strategy.options())  # the options the config sets (the rest are defaults)
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
    _check_rank_policy(declared, config)
    _check_privacy(declared, config)
    _check_causal_lm(declared, config)
    _check_robust_aggregation(declared, config)
    _check_secure_aggregation(declared, config)
    _check_fl_optimisers(declared, config)
    if declared.check is not None:
        try:
            declared.check(config, options)
        except ConfigError as error:
            raise ConfigError(_naming_the_strategy(str(error), declared.name, given, options)) from None


def _naming_the_strategy(message: str, name: str, given: set[str], options: MethodOptions) -> str:
    """A method's own check failed: say which strategy, and which of its defaults took part (an
    option the user did not set, named in the message, e.g. fedtreelora's warm-up of 3 rounds
    against a 2-round run)."""
    defaults = [f"strategy.{key} = {value!r}" for key, value in options.model_dump().items()
                if key not in given and f"strategy.{key}" in message]
    default_note = f" ({', '.join(defaults)}: {name}'s default)" if defaults else ""
    return f"strategy '{name}': {message}{default_note}"


def _check_privacy(declared: Method[Any], config: ExperimentConfig) -> None:
    """``privacy.dp`` with a method whose client step Opacus cannot make private."""
    if config.privacy.dp and not declared.capabilities.dp_compatible:
        usable = ", ".join(n for n in method_names() if method(n).capabilities.dp_compatible)
        raise ConfigError(f"privacy.dp = true is not supported by strategy '{declared.name}' (its client step is "
                          f"not DP-SGD compatible); use one of {usable}, or set privacy.dp = false")


def _check_causal_lm(declared: Method[Any], config: ExperimentConfig) -> None:
    """``model.kind = 'causal_lm'`` with a method that has no meaning for generation."""
    if config.model.kind == "causal_lm" and declared.capabilities.causal_lm:
        raise ConfigError(f"strategy '{declared.name}' does not run with model.kind = 'causal_lm': "
                          f"{declared.capabilities.causal_lm}; use another strategy or model.kind = 'classification'")


def _check_robust_aggregation(declared: Method[Any], config: ExperimentConfig) -> None:
    """``faults.aggregation`` other than 'mean' with a method whose aggregate is not a mean of arrays;
    a Byzantine-robust selection whose rounds sample fewer uploads than its guarantee needs."""
    faults = config.faults
    if faults.aggregation == "mean":
        return
    if declared.capabilities.robust_aggregation:
        from fedlora.schema import minimum_uploads, sample_size

        clients = config.data.num_clients
        sampled = sample_size(clients, config.federation.fraction_train, config.federation.min_clients)
        needed = minimum_uploads(faults.aggregation, faults.num_malicious)
        if sampled < needed:
            raise ConfigError(f"faults.aggregation = '{faults.aggregation}' with faults.num_malicious = "
                              f"{faults.num_malicious} needs {needed} uploads a round, but a round samples "
                              f"{sampled} of data.num_clients = {clients}; sample more clients, lower "
                              "faults.num_malicious, or use 'median' / 'trimmed_mean'")
        return
    usable = ", ".join(n for n in method_names() if method(n).capabilities.robust_aggregation)
    raise ConfigError(f"faults.aggregation = '{config.faults.aggregation}' is not supported by strategy "
                      f"'{declared.name}': {declared.capabilities.not_robust}; use one of {usable}, or "
                      "faults.aggregation = 'mean'")


def _check_secure_aggregation(declared: Method[Any], config: ExperimentConfig) -> None:
    """``secure_aggregation.enabled`` with a method or a config SecAgg+ cannot aggregate: a method
    whose aggregate is not a weighted mean of the uploads, a robust ``faults.aggregation`` or the
    anomaly rule's rejection (they need each upload), mixed ranks where the method's mean is not over
    zero-padded uploads, fewer than 2 sampled clients, parameters Flower refuses, a threshold at most
    half of the shares (unless allowed), a sum that could wrap, an error bound above ``max_error``."""
    secure = config.secure_aggregation
    if not secure.enabled:
        return
    from fedlora import secagg
    from fedlora.schema import sample_size

    caps = declared.capabilities
    if not caps.secure_aggregation:
        usable = ", ".join(n for n in method_names() if method(n).capabilities.secure_aggregation)
        raise ConfigError(f"secure_aggregation.enabled = true is not supported by strategy '{declared.name}': "
                          f"{caps.not_secure}; use one of {usable}, or secure_aggregation.enabled = false")
    if config.faults.aggregation != "mean":
        raise ConfigError(f"secure_aggregation.enabled = true needs faults.aggregation = 'mean' (the server sees only "
                          f"the masked sum, not the uploads '{config.faults.aggregation}' combines)")
    if config.faults.anomaly_action == "reject":
        raise ConfigError("secure_aggregation.enabled = true cannot run with faults.anomaly_action = 'reject': the "
                          "anomaly rule needs each update, the server sees only the masked sum (its secure "
                          "counterpart: secure_aggregation.clip_norm bounds every update)")
    ranks = set(config.clients.ranks) or {int(r) for r, share in config.clients.rank_tiers.items() if share > 0}
    if caps.secure_one_rank and len(ranks) > 1 and caps.mixed_ranks:
        raise ConfigError(f"secure_aggregation.enabled = true with strategy '{declared.name}' needs one LoRA rank, "
                          f"but clients declare ranks {sorted(ranks)}: {caps.secure_one_rank}; give every client one rank")
    clients = config.data.num_clients
    sampled = sample_size(clients, config.federation.fraction_train, config.federation.min_clients)
    if sampled < 2:
        raise ConfigError(f"secure_aggregation.enabled = true needs at least 2 clients a round, but a round samples "
                          f"{sampled} of data.num_clients = {clients}")
    quantization = secure.quantization_range or secagg.quantization_range(sampled, secure.modulus_range)
    problem = (secagg.flower_problem(secure.num_shares, secure.reconstruction_threshold, quantization,
                                     secure.modulus_range)
               or secagg.wrap_problem(sampled, quantization, secure.modulus_range))
    if problem:
        raise ConfigError(f"secure_aggregation: {problem}")
    shares = secagg.resolve_shares(secure.num_shares, sampled)
    threshold = secagg.resolve_threshold(secure.reconstruction_threshold, shares)
    if threshold > shares:
        raise ConfigError(f"secure_aggregation.reconstruction_threshold = {threshold} is above the {shares} shares "
                          f"a round of {sampled} clients makes (num_shares = {secure.num_shares!r}): no secret could "
                          "be reconstructed")
    problem = secagg.threshold_problem(threshold, shares, secure.allow_low_threshold)
    if problem:
        raise ConfigError(f"secure_aggregation: {problem} (a round of {sampled} clients, num_shares = "
                          f"{secure.num_shares!r}, reconstruction_threshold = {secure.reconstruction_threshold!r})")
    clip = secagg.clip_bound(secure.clip_norm, config.faults.max_update_norm)  # C: what every client clips to
    if secure.clipping_range and secure.clipping_range < clip:
        raise ConfigError(f"secure_aggregation.clipping_range = {secure.clipping_range:g} is below the clipping norm "
                          f"{clip:g} (clip_norm, else faults.max_update_norm): a clipped update could still hold an "
                          "entry beyond it")
    bound = secagg.error_bound(secagg.clipping_range(clip, secure.clipping_range), sampled, quantization, 1.0)
    if secure.max_error and bound > secure.max_error:
        raise ConfigError(f"secure_aggregation: the worst-case error bound 3 c N / T = {bound:.3g} (c = "
                          f"{secagg.clipping_range(clip, secure.clipping_range):g}, N = {sampled}, T = "
                          f"{secagg.power(quantization)}) is above max_error = {secure.max_error:g}; lower "
                          "clipping_range or raise quantization_range")


def _check_fl_optimisers(declared: Method[Any], config: ExperimentConfig) -> None:
    """``[server_optimizer]`` or ``train.proximal_mu`` with a method that cannot take it (its
    capabilities say why)."""
    caps, name = declared.capabilities, config.server_optimizer.name
    if name != "none" and not caps.server_optimizer:
        usable = ", ".join(n for n in method_names() if method(n).capabilities.server_optimizer)
        raise ConfigError(f"server_optimizer.name = '{name}' is not supported by strategy '{declared.name}': "
                          f"{caps.not_server_optimizer}; use one of {usable}, or server_optimizer.name = 'none'")
    if config.train.proximal_mu and not caps.proximal:
        usable = ", ".join(n for n in method_names() if method(n).capabilities.proximal)
        raise ConfigError(f"train.proximal_mu = {config.train.proximal_mu:g} (FedProx) is not supported by strategy "
                          f"'{declared.name}': {caps.not_proximal}; use one of {usable}, or train.proximal_mu = 0")


def _check_rank_policy(declared: Method[Any], config: ExperimentConfig) -> None:
    """A same-rank method with ``clients.mixed_rank_policy = refuse`` and mixed configured ranks."""
    ranks = set(config.clients.ranks) or {int(r) for r, share in config.clients.rank_tiers.items() if share > 0}
    if declared.capabilities.mixed_ranks or config.clients.mixed_rank_policy != "refuse" or len(ranks) < 2:
        return
    usable = ", ".join(n for n in method_names() if method(n).capabilities.mixed_ranks)
    raise ConfigError(
        f"strategy '{declared.name}' needs one LoRA rank for every client but clients declare ranks "
        f"{sorted(ranks)}; use one of {usable}, or set clients.mixed_rank_policy=smallest"
    )
