"""Equal tuning budget: the same grid for every strategy, each picks its best setting on validation.

    fedlora tune configs/smoke.toml --strategies fedit,flexlora --grid train.lr=1e-4,3e-4,1e-3

Two protocols live here. ``fedlora tune`` (:func:`tune`): one grid, the same for every strategy.
The fidelity benchmark's (:func:`plan`, :class:`Budget`, :class:`Knob`): every label gets the same
number of configurations, a method's own knob counted inside it, and a learning-rate grid that is
widened where the choice sits at its edge (see :func:`plan`).

Every strategy runs every grid point (cartesian product of the ``--grid`` keys) for every seed,
through the comparison harness (:func:`fedlora.app.jobs.run_jobs`). A setting's score is its
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlora import protocol
from fedlora.app.jobs import Job, run_jobs
from fedlora.app.runs import load_runs
from fedlora.app.summary import ComparisonTable, summarize


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


# A causal LM's validation losses closer than this (nats per response token) are a tie: float noise,
# not a difference the protocol should act on (one token of a 1,000-token split moves the mean by
# about 1e-3). Ties go to the earlier configuration (:func:`plan`, :func:`choose`).
LOSS_TIE_TOLERANCE = 1e-6


def validated_fraction(row: dict[str, Any]) -> float | None:
    """One round's validation accuracy from exact counts: the clients' correct validation examples
    (``val-accuracy`` x ``val-examples``, each rounded to the whole example it counts) over their
    validation examples. Two configurations with as many correct examples score exactly the same
    float, so the documented tie rule is what runs (the example-weighted mean of float32 client
    accuracies differs between them in the 8th digit). None: the round has no per-client counts."""
    counts = [(float(c[protocol.VAL_ACCURACY]), float(c[protocol.VAL_EXAMPLES]))
              for c in (row.get("per_client") or {}).values()
              if isinstance(c, dict) and protocol.VAL_ACCURACY in c and float(c.get(protocol.VAL_EXAMPLES, 0)) > 0]
    if not counts:
        return None
    correct = sum(round(accuracy * examples) for accuracy, examples in counts)
    return correct / sum(round(examples) for _, examples in counts)


def validation_score(results: dict[str, Any]) -> float:
    """Best validation accuracy over the rounds, from exact counts (:func:`validated_fraction`;
    the recorded float where a round has no per-client counts); a causal LM, which has no accuracy,
    scores minus its lowest validation loss per response token, rounded to
    :data:`LOSS_TIE_TOLERANCE` (higher is better either way). NaN when no round was validated."""
    rows = [r for r in results["rounds"] if r.get("validation_accuracy") is not None]
    if rows:
        exact = [validated_fraction(r) for r in rows]
        return max(e if e is not None else float(r["validation_accuracy"]) for e, r in zip(exact, rows))
    losses = [r["validation_loss"] for r in results["rounds"] if r.get("validation_loss") is not None]
    return -round(min(losses) / LOSS_TIE_TOLERANCE) * LOSS_TIE_TOLERANCE if losses else math.nan


def choose(runs: dict[str, list[dict[str, Any]]], labels: Sequence[str]) -> tuple[str, dict[str, float]]:
    """The label with the best mean validation score among ``labels`` (the first of equal scores),
    and every label's score."""
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
    from fedlora.app.jobs import claim_output, default_out_dir, resolve_base

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


# --------------------------------------------------------------------------- equal budget with a knob
Point = tuple[str, ...]  # the overrides of one configuration, e.g. ("train.lr=0.003", "strategy.beta=1.0")


@dataclass(frozen=True)
class Knob:
    """A method's own option tuned inside its budget: ``key`` and its values (TOML literals); the
    learning-rate sweep runs at the first value, the others are tried at the chosen learning rate."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Budget:
    """The equal tuning budget of one scenario.

    Every label gets ``size`` configurations on the first seed. Without a knob: ``size`` learning
    rates, ``lr_grid``. With a knob of k values: the first ``size - (k - 1)`` learning rates of
    ``lr_grid`` at the knob's first value, then the other k - 1 values at the chosen learning rate
    (coordinate search; k - 1 + the learning rates = ``size``). Then the edge rule: while the chosen
    configuration's learning rate is the lowest or the highest the label tried, one more learning
    rate beyond it (``lr_grid``'s ratio) is tried at the chosen knob value and the choice is made
    again, at most ``max_widen`` times. Widening is the same rule for every label, so labels differ
    in count only where their optimum lies outside the common grid; the count is reported.
    """

    size: int = 4
    lr_grid: tuple[float, ...] = (1.5e-3, 3e-3, 6e-3, 1.2e-2)  # ascending, a constant ratio
    max_widen: int = 2
    lr_key: str = "train.lr"

    @property
    def ratio(self) -> float:
        return self.lr_grid[1] / self.lr_grid[0] if len(self.lr_grid) > 1 else 2.0

    def learning_rates(self, knob: Knob | None) -> tuple[float, ...]:
        """The learning rates of the first sweep: ``size`` minus the knob's other values."""
        count = self.size - (len(knob.values) - 1 if knob else 0)
        if count < 1 or count > len(self.lr_grid):
            raise ValueError(f"budget {self.size} leaves {count} learning rates for knob {knob}; the grid has "
                             f"{len(self.lr_grid)}")
        return self.lr_grid[:count]


@dataclass
class TunePlan:
    """Where one label's tuning stands: the configurations in protocol order, the ones still to
    run (``pending``), and once none is pending the ``chosen`` one."""

    points: list[Point] = field(default_factory=list)
    pending: list[Point] = field(default_factory=list)
    chosen: Point | None = None
    widened: int = 0  # learning rates added beyond the first sweep by the edge rule
    at_edge: bool = False  # the choice still sits at the edge after max_widen widenings

    @property
    def budget_points(self) -> list[Point]:
        """The configurations of the equal budget (before any widening)."""
        return self.points[: len(self.points) - self.widened]


def lr_override(key: str, lr: float) -> str:
    return f"{key}={lr:g}"


def point_value(point: Point, key: str) -> str | None:
    for override in point:
        name, _, value = override.partition("=")
        if name == key:
            return value
    return None


def plan(budget: Budget, knob: Knob | None, score: Callable[[Point], float | None]) -> TunePlan:
    """The equal-budget protocol of :class:`Budget` for one label, given the validation ``score``
    of each configuration run so far (None: not run yet; NaN counts as the worst score).

    Deterministic: the same scores give the same plan, so an interrupted tuning stage resumes.
    Ties go to the earlier configuration of the protocol's order.
    """
    def point(lr: float, value: str | None) -> Point:
        return (lr_override(budget.lr_key, lr),) + ((f"{knob.key}={value}",) if knob and value is not None else ())

    def best(points: list[Point]) -> Point:
        def key(p: Point) -> float:
            value = score(p)
            return -math.inf if value is None or math.isnan(value) else value
        return max(points, key=key)  # the first of equal scores

    first = knob.values[0] if knob else None
    result = TunePlan(points=[point(lr, first) for lr in budget.learning_rates(knob)])
    result.pending = [p for p in result.points if score(p) is None]
    if result.pending:
        return result
    if knob and len(knob.values) > 1:
        lr = float(point_value(best(result.points), budget.lr_key) or "nan")
        others = [point(lr, value) for value in knob.values[1:]]
        result.points += others
        result.pending = [p for p in others if score(p) is None]
        if result.pending:
            return result
    while True:
        chosen = best(result.points)
        lr = float(point_value(chosen, budget.lr_key) or "nan")
        tried = [float(point_value(p, budget.lr_key) or "nan") for p in result.points]
        step = 1 if lr >= max(tried) else -1 if lr <= min(tried) else 0
        if step == 0 or result.widened >= budget.max_widen:
            result.chosen, result.at_edge = chosen, step != 0
            return result
        wider = point(lr * budget.ratio**step, point_value(chosen, knob.key) if knob else None)
        result.points.append(wider)
        result.widened += 1
        if score(wider) is None:
            result.pending = [wider]
            return result
