"""The run config of ``flwr run`` and deployments: how the ServerApp finds its experiment.

``flwr run`` passes the config as the run-config entry ``experiment`` (JSON: what ``fedlora
deploy`` sends) or ``config`` (a TOML path readable on the server), with overrides: ``set`` items
and Flower-style dotted keys such as ``train.rounds=5`` (pyproject's ``[tool.flwr.app.config]``
declares them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.serverapp import Grid

from fedlora.config import ExperimentConfig, apply_overrides, build_config, config_from_json, load_config

RUN_CONFIG_ENTRIES = ("config", "experiment", "resume", "set", "nodes")
"""fedlora's own run-config entries (pyproject ``[tool.flwr.app.config]``); every other entry there is
a dotted config key (``train.rounds``), declared with the value "" (= the config's own value)."""


def flat_overrides(run_config: Mapping[str, Any]) -> list[str]:
    """Flower's habit, ``flwr run . --run-config "train.rounds=5 strategy.name='fedhera'"``: every
    dotted run-config key with a value other than "" as a ``section.key=value`` override (the value
    as a TOML literal, so that it keeps the type Flower parsed: 5, 'fedhera', true, 1e-3)."""
    return [f"{key}={_toml_literal(value)}" for key, value in run_config.items()
            if key not in RUN_CONFIG_ENTRIES and "." in key and value != ""]


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else str(value)  # inf, -inf, nan: TOML's spelling
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def node_binding(run_config: Mapping[str, Any]) -> tuple[dict[int, int], dict[int, str]]:
    """The run-config entry ``nodes`` (JSON ``{"<node id>": {"partition": k, "silo": "name"}}``, what
    ``fedlora deploy run`` sends from the operator's registrations): node id -> partition, node id ->
    silo name; both empty without it. A value that is not such a mapping is a ConfigError."""
    from fedlora.config import ConfigError

    text = str(run_config.get("nodes", "") or "")
    if not text:
        return {}, {}
    try:
        entries = json.loads(text)
        partitions = {int(node): int(entry["partition"]) for node, entry in entries.items()}
        names = {int(node): str(entry.get("silo", "")) for node, entry in entries.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ConfigError('run config "nodes" must be JSON {"<node id>": {"partition": k, "silo": "name"}}') from None
    return partitions, names


def run_app_dir(grid: Grid) -> Path | None:
    """The folder where Flower installed this run's app (its FAB: pyproject.toml and configs/);
    None without a FAB (fedlora's in-process engine)."""
    from flwr.common.config import get_project_dir

    run = grid.run
    return get_project_dir(run.fab_id, run.fab_version, run.fab_hash) if run.fab_hash else None


def config_from_run_config(run_config: dict[str, Any], app_dir: Path | None = None) -> ExperimentConfig:
    """Deployment and ``flwr run .``: the config arrives as JSON (``experiment``, what ``fedlora
    deploy`` sends) or as a TOML path (``config``), with overrides: the dotted keys
    (:func:`flat_overrides`), then ``set`` (``section.key=value`` items separated by ``;``; the
    later wins). A relative ``config`` path is looked up in the working directory, then in the
    run's app folder ``app_dir`` (the installed FAB, which carries configs/), so ``flwr run .
    --run-config 'config="configs/smoke.toml"'`` works from anywhere."""
    overrides = [*flat_overrides(run_config),
                 *(item.strip() for item in str(run_config.get("set", "")).split(";") if item.strip())]
    if run_config.get("experiment"):
        text = str(run_config["experiment"])
        return build_config(apply_overrides(json.loads(text), overrides)) if overrides else config_from_json(text)
    path = Path(str(run_config.get("config") or "configs/quickstart.toml"))
    if app_dir is not None and not path.is_absolute() and not path.is_file() and (app_dir / path).is_file():
        path = app_dir / path
    return load_config(path, overrides)
