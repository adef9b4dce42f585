"""Reading and validating experiment configs: the schema (:mod:`fedlora.schema`) plus the named
method's options (:mod:`fedlora.methods`), from a TOML file, a dict or ``--set`` overrides.

The schema's names are re-exported here, so ``from fedlora.config import ExperimentConfig`` is
the one import a caller needs.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fedlora import compatibility, methods
from fedlora.errors import ConfigError, did_you_mean, shorten, shown
from fedlora.schema import (
    IGNORED_TABLES,
    BudgetTier,
    ClientsConfig,
    DataConfig,
    ExperimentConfig,
    FaultsConfig,
    FederationConfig,
    ModelConfig,
    OutputConfig,
    PrivacyConfig,
    SecureAggregationConfig,
    StrategyConfig,
    TrainConfig,
    apply_overrides,
    config_from_json,
    parse_override,
)

__all__ = [
    "BudgetTier", "ClientsConfig", "ConfigError", "DataConfig", "ExperimentConfig", "FaultsConfig",
    "FederationConfig", "ModelConfig", "OutputConfig", "PrivacyConfig", "SecureAggregationConfig", "StrategyConfig",
    "TrainConfig",
    "apply_overrides", "build_config", "config_from_json", "load_config", "parse_override",
]


def _format_validation_error(error: ValidationError) -> str:
    first = error.errors(include_input=True)[0]
    location = ".".join(str(part) for part in first["loc"]) or "config"
    location = shorten(location, 100)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section = "".join(f"{part}." for part in first["loc"][:-1])
        known = _known_keys(first["loc"][:-1])
        return f"unknown config key '{location}'{did_you_mean(str(first['loc'][-1])[:100], known, section)}"
    value = first.get("input")
    got = "" if isinstance(value, dict) else f", got {shown(value)}"
    return f"invalid config '{location}': {message}{got}" if "got" not in message else (
        f"invalid config '{location}': {message}"
    )


def _non_finite(value: Any, where: str) -> str | None:
    """The dotted key of the first NaN / inf float in ``value`` (None: every float is finite)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    if isinstance(value, dict):
        items: list[tuple[str, Any]] = [(f"{where}.{key}", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
    else:
        return None
    for key, item in items:
        found = _non_finite(item, key)
        if found is not None:
            return found
    return None
def _known_keys(location: tuple[Any, ...]) -> list[str]:
    """The keys the schema declares at ``location`` (() = the sections; ('data',) = data's keys)."""
    model: Any = ExperimentConfig
    for part in location:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None or not hasattr(field.annotation, "model_fields"):
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def build_config(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate a raw dict (TOML + overrides) into an ExperimentConfig: the schema, the method's
    options (:func:`fedlora.methods.read_options`), what the method can take of the rest of the config
    (:func:`fedlora.compatibility.check`), then the method's own rules.
    Every float must be finite (the schema's sections refuse NaN / inf themselves; the strategy's
    options are checked here, whatever their model declares)."""
    try:
        config = ExperimentConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None
    found = _non_finite(config.strategy.options(), "strategy")
    if found is not None:
        raise ConfigError(f"invalid config '{found}': must be a finite number, got {shown(_lookup(config, found))}")
    given = set(config.strategy.options())  # the options the config sets (the rest are defaults)
    declared, options = methods.read_options(config)
    compatibility.check(config, declared.name, declared.capabilities, methods.catalogue())
    methods.check_own(config, declared, options, given)
    return config


def experiment_from_settings(method: str, settings: Mapping[str, Any], federation: Mapping[str, Any]) -> ExperimentConfig:
    """The experiment of a strategy built from keywords (a Flower user's ServerApp): ``settings``
    holds experiment sections (mappings or section models: ``model``, ``data``, ``train``, ...) and
    the method's options; ``federation`` Flower's sampling keywords (None: not given) for
    ``[federation]``. Checked as a config file is (:func:`build_config`, ConfigError)."""
    sections = [name for name in ExperimentConfig.model_fields if name != "strategy"]
    raw: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in settings.items():
        if key in sections:
            raw[key] = value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else dict(value)
        else:
            options[key] = value
    given = {key: value for key, value in federation.items() if value is not None}
    if given:
        raw["federation"] = {**raw.get("federation", {}), **given}
    raw["strategy"] = {"name": method, **options}
    return build_config(raw)


def _lookup(config: ExperimentConfig, dotted: str) -> Any:
    return config.strategy.options().get(dotted.split(".", 1)[1].split("[", 1)[0])


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML config, apply ``--set`` overrides and validate everything. The file's tables
    named in :data:`fedlora.schema.IGNORED_TABLES` (another tool's) are dropped first."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"cannot parse {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        raw = tomllib.loads(text)
    except (ValueError, RecursionError) as error:  # TOMLDecodeError, or an integer of more than 4300 digits
        raise ConfigError(f"cannot parse {path}: {str(error) or 'nested too deeply'}") from None
    raw = {section: values for section, values in raw.items() if section not in IGNORED_TABLES}
    return build_config(apply_overrides(raw, overrides or []))
