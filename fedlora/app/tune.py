"""Equal tuning budget: the same grid for every strategy, each picks its best setting on validation.

    fedlora tune configs/smoke.toml --strategies fedit,flexlora --grid train.lr=1e-4,3e-4,1e-3

Every strategy runs every grid point (cartesian product of the ``--grid`` keys) for every seed,
through the comparison harness (:func:`fedlora.app.compare.run_jobs`). A setting's score is its
best *validation* accuracy over the rounds (each client's validation split, example-weighted),
averaged over seeds: the test splits are never used to choose. The chosen setting per strategy
and the whole grid go to ``OUT/tuning.json``; the table of the chosen runs (test scores, costs) to
``OUT/summary.md`` / ``summary.csv``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlora.app.compare import ComparisonTable, Job, load_runs, run_jobs, summarize


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["train.lr=1e-4,3e-4", "model.lora_rank=4,8"]`` -> {key: [values]} (TOML literals)."""
    from fedlora.config import ConfigError

    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or "." not in key or not values:
            raise ConfigError(f"--grid expects section.key=v1,v2,..., got {spec!r}")
        grid[key.strip()] = [_literal(v) for v in values.split(",") if v.strip()]
        if not grid[key.strip()]:
            raise ConfigError(f"--grid {key.strip()} has no values, got {spec!r}; give e.g. --grid {key.strip()}=1e-4,1e-3")
    if not grid:
        raise ConfigError("tune needs at least one --grid key, e.g. --grid train.lr=1e-4,1e-3")
    return grid


def _literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def grid_points(grid: dict[str, list[Any]]) -> list[tuple[str, ...]]:
    """Every combination as a tuple of ``key=value`` overrides."""
    keys = list(grid)
    return [tuple(f"{k}={_toml(v)}" for k, v in zip(keys, values)) for values in itertools.product(*grid.values())]


def _toml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def point_label(strategy: str, point: tuple[str, ...]) -> str:
    return f"{strategy}[{','.join(point)}]"


def validation_score(results: dict[str, Any]) -> float:
    """Best validation accuracy over the rounds (NaN when no round was validated)."""
    scores = [r["validation_accuracy"] for r in results["rounds"] if r.get("validation_accuracy") is not None]
    return max(scores) if scores else math.nan


def choose(runs: dict[str, list[dict[str, Any]]], labels: Sequence[str]) -> tuple[str, dict[str, float]]:
    """The label with the best mean validation score among ``labels``, and every label's score."""
    scores = {}
    for label in labels:
        values = [validation_score(r) for r in runs.get(label, [])]
        finite = [v for v in values if not math.isnan(v)]
        scores[label] = statistics.fmean(finite) if finite else -math.inf
    return max(labels, key=lambda label: scores[label]), scores


def tune(
    config: Any,
    strategies: Sequence[str],
    grid: dict[str, list[Any]],
    seeds: Sequence[int] = (0,),
    out_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    engine: str = "ray",
    resume: bool = False,
    overwrite: bool = False,
) -> ComparisonTable:
    """Run the same grid for every strategy; summarise each strategy's validation-chosen setting.

    ``out_dir`` (default ``<output.dir>/tune``) must be new or empty unless ``resume`` (continue the
    tuning there: finished runs are kept, interrupted ones resumed) or ``overwrite`` (move the
    earlier tuning aside, ``OUT.old-<time>``; nothing is deleted)."""
    from fedlora.app.compare import claim_output, default_out_dir, resolve_base

    base = resolve_base(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(base).with_name("tune")
    folder = claim_output(out, "tuning", resume, overwrite)
    points = grid_points(grid)
    jobs = [
        Job(strategy, int(seed), overrides=point, label=point_label(strategy, point))
        for strategy in strategies for point in points for seed in seeds
    ]
    run_jobs(base, jobs, out, engine=engine, folder=folder)  # type: ignore[arg-type]
    runs = load_runs(out)
    record: dict[str, Any] = {"grid": grid, "seeds": list(seeds), "selection": "best validation accuracy, mean over seeds", "strategies": {}}
    chosen = []
    for strategy in strategies:
        label, scores = choose(runs, [point_label(strategy, p) for p in points])
        chosen.append(label)
        record["strategies"][strategy] = {"chosen": label, "validation_scores": scores}
    table = summarize(out, labels=chosen)
    (out / "tuning.json").write_text(json.dumps(record, indent=2))
    with (out / "summary.md").open("a") as summary:
        summary.write("\n\nSettings chosen on validation (mean over seeds of the best validation accuracy):\n\n")
        for strategy, info in record["strategies"].items():
            summary.write(f"- `{strategy}`: `{info['chosen']}` (grid: {', '.join(f'{k}={v}' for k, v in grid.items())})\n")
    return table
