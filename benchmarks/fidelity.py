"""Fidelity benchmark: each 2026 method in the scenario it was written for, against its baselines.

    python benchmarks/fidelity.py --scenario fedhera --seeds 0,1,2,3,4 --workers 2
    python benchmarks/fidelity.py --scenario all --workers 8 --set train.device=cuda
    python benchmarks/fidelity.py --scenario fedhera_llm --gpu     # the full LLM version, one GPU

One scenario = one config under ``configs/scenarios/`` (its header says the setting and the cost
cuts) whose ``[fidelity]`` table (read and validated here: :class:`Scenario`, :class:`JobSpec`;
``fedlora run`` ignores the table) declares the jobs: the method, its ablations (the method
without its mechanism), the baselines its paper compares against, and the centralised reference
with the same total optimiser steps; and the seeds, the tuning budget, the primary comparison
and the regime rule. The rules (docs/results/fidelity.md explains them):

- **Fresh partitions.** Seed k sets ``train.seed = k`` and ``data.seed = <config's> + k``: every
  seed is a new partition, shared by every job of that seed, so differences stay paired.
- **Seeds.** The ``core`` jobs (the method, its ablations, the baseline its paper leads with) run
  every seed (``--seeds``, default the scenario's ``seeds.core``); the other rows the first
  ``--other-seeds`` (default ``seeds.other``).
- **Tuned alike.** Every tuned job (the method, the baselines, the reference) gets the same number
  of configurations (``budget``, :class:`fedlora.app.tune.Budget`) on the first seed, chosen on the
  clients' validation splits (never a test split): learning rates, a method's own knob counted
  inside the budget, and a grid widened where the choice sits at its edge. The chosen
  configuration is reused for every seed (its first-seed run is the tuning run itself); a job's
  final runs start as soon as it has chosen, behind the tuning runs still to run, so that no worker
  waits on another job's last tuning run. An
  ablation runs at its method's choice and a bytes-matched row at its base strategy's
  (``JobSpec.tuned_as``): the ablation then differs from the method in its mechanism only.
- **Judged paired.** One declared primary comparison per scenario (the method against the baseline
  its paper leads with, on the paper's metric), reported uncorrected; the method against every
  other job, Holm-corrected; 95 % bootstrap intervals over seeds (:mod:`fedlora.app.paired`).

Complete runs are skipped when rerun (the whole config is compared), so an interrupted benchmark
continues where it stopped, tuning stage included. **Records**: every run is kept as soon as it
finishes under ``docs/results/records/<scenario>/`` (its results.json, at the path it has under
``OUT``; ``--records DIR`` elsewhere, ``--no-records`` not at all), and the records are restored
into ``OUT`` before anything runs, so on a fresh clone the same command continues the protocol
from the committed records: stop it at any moment and only the runs in progress are lost.
``--status`` prints how far each scenario is (runs done / planned) and runs nothing. Runs go through the in-process engine in
``--workers`` processes (on a CUDA machine, ``--set train.device=cuda``: they share the GPU).

**LLM scenarios** (``kind = "causal_lm"``: SmolLM2 instruction tuning) follow the same rules on
the causal-LM metrics: tuning on the clients' validation loss, the paired statistics on the
received next-token accuracy (teacher-forced) and ROUGE-L. Their configs are CPU-sized (one seed
on 2 cores); ``--gpu`` is the full version in one command: the scenario's ``gpu`` overrides (more
clients, rounds and data), ``train.device=cuda``, the scenario's seeds, as many workers as the
scenario has jobs (the final runs are ordered seed by seed, so all runs of a seed share the one
GPU at once) and its own folder (``runs/fidelity/<scenario>-gpu``). The page names the GPU.

Output (``OUT`` = ``--out``, default ``runs/fidelity/<scenario>``): ``fidelity.md`` (the page the
docs cite: regime line, tuning, results with ablation rows, worst client, bytes and times, the
paired comparisons, the mechanisms), ``summary.md`` / ``summary.csv``, ``paired.csv``,
``fidelity.json``, the comparison plots and ``mechanism.png`` (the method's mechanism at work,
:mod:`fedlora.app.mechanisms`). The last line printed is
``scenario=... counts=... fedit=... centralized=... gap_points=... untrained=... learned_points=...``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlora.app import quiet
from fedlora.app.jobs import Job, is_complete, job_config, resolve_base, run_jobs
from fedlora.app.mechanisms import MECHANISM_PLOT, plot_method_mechanism
from fedlora.app.paired import (
    CAUSAL_PAIRED_METRICS,
    METRIC_NAMES,
    PAIRED_METRICS,
    Pair,
    PairedTable,
    paired_comparisons,
)
from fedlora.app.runs import load_runs, number
from fedlora.app.summary import summarize
from fedlora.app.tune import Budget, Knob, Point, TunePlan, plan, point_label, validation_score
from fedlora.errors import ConfigError, shown
from fedlora.results import load_results

logger = logging.getLogger("fedlora")

SCENARIO_CONFIGS = Path("configs/scenarios")  # under ROOT: every <name>.toml there with a [fidelity] table
TABLE = "fidelity"  # the config's table this benchmark reads (fedlora.schema.IGNORED_TABLES: a run skips it)
Role = Literal["method", "ablation", "variant", "bytes-matched", "baseline", "reference"]


# --------------------------------------------------------------------------- the scenarios' data
class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _override(text: str) -> str:
    """A ``section.key=value`` override, as ``--set`` takes it."""
    key, sep, value = text.partition("=")
    if not sep or not value or "." not in key:
        raise ValueError(f"expects section.key=value, got {shown(text)}")
    return text


class JobSpec(_Table):
    """One row of a scenario, ``[fidelity.jobs.<label>]``; the label names the row on the page and
    its run folders (``<label>[<configuration>]/seed<k>``)."""

    strategy: str = Field(description="The strategy the row runs (`strategy.name`).")
    overrides: tuple[str, ...] = Field(
        (), description="`section.key=value` overrides (as `--set` takes them) the row always runs with; keys it "
        "sets itself win over a configuration it reuses (`tuned_as`).")
    role: Role = Field("baseline", description="What the row is: the method, an ablation (the method without one "
                       "mechanism), a variant (the method with one choice its sources leave open made the other way), a "
                       "bytes-matched variant, a baseline of the paper or the centralised reference.")
    core: bool = Field(False, description="Runs every seed; otherwise the first `seeds.other` of them.")
    knob: Knob | None = Field(
        None, description="The method's own option tuned inside the equal budget, `{ key, values }` (values as "
        "TOML literals in strings): the learning-rate sweep runs at the first value, the others are tried at the "
        "chosen learning rate.")
    tuned_as: str | None = Field(
        None, description="Another row whose chosen configuration this row reuses instead of tuning its own: an "
        "ablation runs at its method's choice (a separately tuned ablation would confound the mechanism with the "
        "tuning), a bytes-matched row at its base strategy's.")
    note: str = Field("", description="What the row is, printed beside its label on the page.")

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_override(value) for value in values)


class Seeds(_Table):
    """``[fidelity.seeds]``: the seeds rule (``--seeds`` / ``--other-seeds`` replace it)."""

    core: tuple[int, ...] = Field(min_length=1, description="The seeds of the core jobs, in order; the first is "
                                  "the tuning seed. Seed k runs train.seed = k, data.seed = the config's + k.")
    other: int = Field(ge=2, description="The other jobs run the first `other` seeds of `core` (a paired test "
                       "needs two).")

    @field_validator("core")
    @classmethod
    def _distinct(cls, seeds: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(seeds)) != len(seeds) or min(seeds) < 0:
            raise ValueError(f"expects distinct integers >= 0, got {list(seeds)}")
        return seeds


class Regime(_Table):
    """``[fidelity.regime]``: when the scenario's runs are long enough to compare anything.

    Two conditions, both on ``metric`` and on the seeds the compared rows share: FedIT within
    ``max_gap_points`` of the centralised reference (the federation has nearly caught up), and the
    reference at least ``min_learning_points`` above the untrained model (something was learned at
    all: the gap rule alone passes when neither moves). The floor's default is twice the gap: then a
    FedIT that passes the gap rule has itself learned at least the gap's worth."""

    metric: str = Field(description="The metric of the regime line: FedIT's against the centralised reference's.")
    max_gap_points: float = Field(gt=0, description="The scenario counts when the reference is at most this many "
                                  "points (of 100) above FedIT.")
    min_learning_points: float | None = Field(
        None, gt=0, description="The learning floor: the scenario counts only when the reference is at least this "
        "many points (of 100) above the untrained model (the adapter at initialisation, evaluated by the runs' "
        "own evaluation on the same seeds). Default (None): twice max_gap_points.")

    @property
    def floor_points(self) -> float:
        """The learning floor in points: ``min_learning_points``, by default twice the gap."""
        return self.min_learning_points if self.min_learning_points is not None else 2 * self.max_gap_points


class Scenario(_Table):
    """One method's setting, the ``[fidelity]`` table of ``configs/scenarios/<name>.toml``."""

    config: str = Field(description="The scenario's config, relative to the repository (set from the file's path; "
                        "not written in the table).")
    claim: str = Field(description="The paper's claim the scenario checks (printed on the page).")
    metric: str = Field(description="The metric the paper reports: the primary comparison's.")
    primary: tuple[str, str] = Field(description="The declared primary comparison (method label, baseline label), "
                                     "reported uncorrected.")
    primary_why: str = Field(description="Why that baseline (printed on the page).")
    kind: Literal["classification", "causal_lm"] = Field(
        description="The config's model kind: which paired metrics and page columns (accuracies; or token "
        "accuracy, ROUGE-L and losses).")
    budget: Budget = Field(description="The equal tuning budget of every tuned row, `{ size, lr_grid, max_widen }` "
                           "(fedlora.app.tune.Budget).")
    seeds: Seeds = Field(description="Which seeds the rows run (`{ core, other }`).")
    regime: Regime = Field(description="When the runs are long enough to compare, and learn enough to compare "
                           "(`{ metric, max_gap_points, min_learning_points }`).")
    pairs: tuple[tuple[str, str], ...] = Field((), description="Comparisons (label, baseline) beyond the method "
                                               "against every row; Holm-corrected with them.")
    gpu: tuple[str, ...] = Field((), description="`--gpu`: overrides of the full version (the config is the "
                                 "CPU-sized one).")
    jobs: dict[str, JobSpec] = Field(min_length=1, description="The rows, in the page's order.")

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_override(value) for value in values)

    @model_validator(mode="after")
    def _cross_checks(self) -> Scenario:
        named = [("primary", label) for label in self.primary]
        named += [("pairs", label) for pair in self.pairs for label in pair]
        named += [(f"jobs.{label}.tuned_as", spec.tuned_as) for label, spec in self.jobs.items() if spec.tuned_as]
        for key, label in named:
            if label not in self.jobs:
                raise ValueError(f"{key}: no job {label!r} (jobs: {', '.join(self.jobs)})")
        if self.jobs[self.method].role != "method":
            raise ValueError(f"primary: {self.method!r} must be the row with role = 'method'")
        for label, spec in self.jobs.items():
            if spec.tuned_as is not None and self.jobs[spec.tuned_as].tuned_as is not None:
                raise ValueError(f"jobs.{label}.tuned_as: {spec.tuned_as!r} reuses another row's choice itself")
            if spec.tuned_as is not None and spec.knob is not None:
                raise ValueError(f"jobs.{label}.knob: the row reuses {spec.tuned_as!r}'s choice and tunes nothing")
            try:
                self.budget.learning_rates(spec.knob)
            except ValueError as error:  # the budget leaves no learning rate beside the knob's values
                raise ValueError(f"jobs.{label}.knob: {error}") from None
        if not {"fedit", "centralized"} <= set(self.jobs):
            raise ValueError("jobs must include 'fedit' and 'centralized': the two ends of the regime line")
        for key, value in (("metric", self.metric), ("regime.metric", self.regime.metric)):
            if value not in METRIC_NAMES:
                raise ValueError(f"{key}: unknown metric {value!r}; known: {', '.join(METRIC_NAMES)}")
        if self.metric not in self.paired_metrics:
            raise ValueError(f"metric {self.metric!r} is not a paired metric of kind {self.kind!r}")
        if list(self.budget.lr_grid) != sorted(set(self.budget.lr_grid)):
            raise ValueError(f"budget.lr_grid must be ascending, got {list(self.budget.lr_grid)}")
        return self

    @property
    def causal(self) -> bool:
        """A causal-LM scenario: its metrics are the received token accuracy, ROUGE-L and losses."""
        return self.kind == "causal_lm"

    @property
    def paired_metrics(self) -> tuple[str, ...]:
        return CAUSAL_PAIRED_METRICS if self.causal else PAIRED_METRICS

    @property
    def method(self) -> str:
        return self.primary[0]

    @property
    def regime_metric(self) -> str:
        return self.regime.metric


def _one_line(error: ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    got = "" if isinstance(value, dict) or "got" in message else f", got {shown(value)}"
    return f"{where}: {message}{got}" if where else f"{message}{got}"


def load_scenario(path: Path) -> Scenario | None:
    """The ``[fidelity]`` table of the config at ``path``, validated (None: the file has none).
    Raises ConfigError in one line naming the file and the key."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"cannot read {name}: {error}") from None
    table = raw.get(TABLE)
    if table is None:
        return None
    if not isinstance(table, dict) or "config" in table:
        raise ConfigError(f"{name}: [{TABLE}] must be a table without a 'config' key (the file is the config)")
    try:
        return Scenario.model_validate({**table, "config": str(name)})
    except ValidationError as error:
        raise ConfigError(f"{name}: [{TABLE}] {_one_line(error)}") from None


@functools.cache
def scenarios() -> dict[str, Scenario]:
    """Every scenario, by name (its config's file name): the classifier ones first (the cheaper:
    ``--scenario all`` runs them before the LLM ones), each kind by name."""
    found = {path.stem: scenario for path in sorted((ROOT / SCENARIO_CONFIGS).glob("*.toml"))
             if (scenario := load_scenario(path)) is not None}
    return dict(sorted(found.items(), key=lambda item: (item[1].causal, item[0])))


# Final-round causal-LM metrics read from every run (summary columns hold the classifier's); higher
# is better for the paired ones, lower for the losses.
CAUSAL_METRICS = (*CAUSAL_PAIRED_METRICS, "received_loss", "personalized_loss", "global_loss")


# --------------------------------------------------------------------------- seeds and jobs
def job_seeds(scenario: Scenario, label: str, seeds: list[int], other_seeds: int | None = None) -> list[int]:
    """Every seed for a core job, the first ``other_seeds`` (default the scenario's
    ``seeds.other``) for the others."""
    other = scenario.seeds.other if other_seeds is None else other_seeds
    return list(seeds) if scenario.jobs[label].core else list(seeds[:other])


def tuning_job(scenario: Scenario, label: str, point: Point, seed: int) -> Job:
    """One configuration of ``label``'s tuning, on ``seed`` (the first), in its own folder."""
    spec = scenario.jobs[label]
    return Job(spec.strategy, seed, spec.overrides + point, point_label(label, point), fresh_partition=True)


def final_jobs(scenario: Scenario, seeds: list[int], chosen: dict[str, Point],
               other_seeds: int | None = None, labels: set[str] | None = None) -> list[Job]:
    """Every job (``labels``: only those) at its chosen configuration for its seeds, seed by seed
    (with as many workers as jobs, all runs of a seed run at once); the first seed's run is the
    tuning run (same folder, same config), so it is not run twice."""
    jobs = []
    for label, spec in scenario.jobs.items():
        if labels is not None and label not in labels:
            continue
        point = chosen[label]
        jobs += [Job(spec.strategy, seed, spec.overrides + point, point_label(label, point), fresh_partition=True)
                 for seed in job_seeds(scenario, label, seeds, other_seeds)]
    return sorted(jobs, key=lambda job: seeds.index(job.seed))  # stable: the scenario's order within a seed


def comparisons(scenario: Scenario, seeds: list[int], other_seeds: int | None = None) -> list[Pair]:
    """The method against every other job but the reference, and the scenario's extra pairs, each
    on the seeds both sides ran (all of them when both are core)."""
    wanted = [(scenario.method, label) for label, spec in scenario.jobs.items()
              if label != scenario.method and spec.role != "reference"]
    wanted += [pair for pair in scenario.pairs if pair not in wanted]
    pairs = []
    for label, baseline in wanted:
        both = set(job_seeds(scenario, label, seeds, other_seeds)) & set(job_seeds(scenario, baseline, seeds, other_seeds))
        pairs.append(Pair(label, baseline, tuple(sorted(both))))
    return pairs


# --------------------------------------------------------------------------- tuning stage
def tune_scenario(scenario: Scenario, config: str, seed: int, out: Path, workers: int,
                  overrides: list[str], on_done: Callable[[Job, Path], None] | None = None,
                  finals: Callable[[dict[str, TunePlan]], list[Job]] | None = None) -> dict[str, TunePlan]:
    """Run the equal-budget protocol of every tuned job (``tuned_as`` None) on ``seed`` until each
    has chosen (``on_done``: called with each run as it finishes). ``finals(plans)``: the final runs
    whose configuration is already known (:func:`early_finals`); they are queued behind each round
    of tuning runs, so that a worker is not left idle while the last tuning runs of a round (a
    knob's second value, a widened grid: often a single long run) go on."""
    base = resolve_base(config, overrides)
    while True:
        plans = plans_in(scenario, base, seed, out)
        pending = [tuning_job(scenario, label, point, seed) for label, p in plans.items() for point in p.pending]
        if not pending:
            return plans
        fill = [] if finals is None else finals(plans)
        logger.info("fidelity: tuning, %d configuration(s) to run on seed %d%s", len(pending), seed,
                    f", then up to {len(fill)} final run(s) of the jobs that have chosen" if fill else "")
        run_jobs(base, pending + fill, out, engine="inprocess", workers=workers, on_done=on_done)


def known(scenario: Scenario, plans: dict[str, TunePlan]) -> set[str]:
    """The jobs whose final configuration is known: tuned jobs that have chosen, and the jobs that
    reuse (``tuned_as``) such a choice."""
    chosen = {label for label, p in plans.items() if p.chosen is not None}
    return chosen | {label for label, spec in scenario.jobs.items() if spec.tuned_as in chosen}


def early_finals(scenario: Scenario, plans: dict[str, TunePlan], seeds: list[int],
                 other_seeds: int | None = None) -> list[Job]:
    """The final runs of the jobs whose configuration is :func:`known` while others still tune, the
    first seed's tuning runs left out (they are those jobs' first final runs). They are the runs the
    final stage would start anyway, in the same folders with the same configs: the final stage skips
    them once complete."""
    ready = known(scenario, plans)
    return [job for job in final_jobs(scenario, seeds, choices(scenario, plans), other_seeds, labels=ready)
            if not is_tuning_run(scenario, job, seeds)]


def label_of(job: Job) -> str:
    """The scenario job a run belongs to (its folder name without the configuration)."""
    return job.name.split("[")[0]


def is_tuning_run(scenario: Scenario, job: Job, seeds: list[int]) -> bool:
    """Whether a final run is a tuned job's first-seed run: its tuning run, counted once."""
    return job.seed == seeds[0] and scenario.jobs[label_of(job)].tuned_as is None


def plans_in(scenario: Scenario, base: Any, seed: int, folder: Path) -> dict[str, TunePlan]:
    """Every tuned job's plan (``tuned_as`` None) as the complete runs in ``folder`` on ``seed``
    leave it (runs of another config than ``base``'s count as not run)."""
    runs = load_runs(folder, seeds=[seed]) if folder.is_dir() else {}
    return {label: plan(scenario.budget, spec.knob, _scorer(scenario, label, seed, base, folder, runs))
            for label, spec in scenario.jobs.items() if spec.tuned_as is None}


def tuning_in(scenario: Scenario, config: str, seed: int, records: Path) -> dict[str, TunePlan]:
    """The complete tuning stage of ``scenario`` kept in ``records`` (a records or output folder of
    the scenario run at its own config, without ``--set``), read as :func:`tune_scenario` would have
    left it; runs nothing. Raises ConfigError in one line when a tuned job has not chosen there."""
    base = resolve_base(config, [])
    silent = logging.Filter("nothing")  # a read: no "running it again" for runs of another config there
    logger.addFilter(silent)
    try:
        plans = plans_in(scenario, base, seed, records)
    finally:
        logger.removeFilter(silent)
    pending = sum(len(p.pending) for p in plans.values())
    if pending or any(p.chosen is None for p in plans.values()):
        raise ConfigError(f"--tuning-from {records}: the tuning stage of {scenario.config} on seed {seed} is not "
                          f"complete there ({pending} configuration(s) still to run); run the scenario there first")
    return plans


def choices(scenario: Scenario, plans: dict[str, TunePlan]) -> dict[str, Point]:
    """Every job's configuration: its own tuning's choice, or (``tuned_as``) the choice of the
    label it reuses, without the keys it fixes itself."""
    chosen = {label: p.chosen or () for label, p in plans.items()}
    for label, spec in scenario.jobs.items():
        if spec.tuned_as is not None:
            fixed = {override.partition("=")[0] for override in spec.overrides}
            chosen[label] = tuple(o for o in chosen[spec.tuned_as] if o.partition("=")[0] not in fixed)
    return chosen


def _scorer(scenario: Scenario, label: str, seed: int, base: Any, out: Path, runs: dict[str, list[dict]]):
    """The validation score of a configuration whose run is complete with this exact config."""
    def score(point: Point) -> float | None:
        job = tuning_job(scenario, label, point, seed)
        run_dir = job.run_dir(out)
        if job.name not in runs or not is_complete(run_dir, job_config(base, job, run_dir)):
            return None
        return validation_score(runs[job.name][0])
    return score



# --------------------------------------------------------------------------- records
RECORDS = Path("docs/results/records")  # under ROOT, committed: <scenario>/<job>[<configuration>]/seed<k>/results.json
RESULTS = "results.json"


def complete_by_itself(path: Path) -> bool:
    """Whether the results.json at ``path`` holds every round its own config asked for."""
    return _complete_results(path) is not None


def _complete_results(path: Path) -> dict[str, Any] | None:
    """The results.json at ``path``, parsed, when it holds every round its own config asked for;
    None when it is unreadable or incomplete (one read serves both the check and the use)."""
    try:
        results = json.loads(path.read_text())
        wanted = int(results["config"]["train"]["rounds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rounds = [r.get("round") for r in results.get("rounds") or [] if isinstance(r, dict) and r.get("round") != 0]
    return results if rounds == list(range(1, wanted + 1)) else None


def _copy(source: Path, target: Path) -> None:
    """``source`` to ``target`` atomically (a reader never sees half a file); paths inside the
    repository are written relative to it (a record names no machine's folders)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".json.partial")
    partial.write_text(source.read_text().replace(str(ROOT) + os.sep, ""))
    partial.replace(target)


def _config(path: Path) -> dict[str, Any] | None:
    """The config a results.json ran, as records compare it (no output folder; options added
    later read at the value the record ran with)."""
    try:
        config = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _comparable(config)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config as records compare it (:func:`fedlora.schema.comparable_config`): no output
    folder, options added later at the value the record ran with, inert sections collapsed."""
    from fedlora.schema import comparable_config

    return comparable_config(config)


def _complete_config(path: Path) -> dict[str, Any] | None:
    """The config (as :func:`_config`) of the complete run whose results.json is at ``path``, from
    one read; None when it is unreadable or incomplete."""
    results = _complete_results(path)
    return None if results is None else _comparable(results["config"])


def _shown_path(path: Path) -> str:
    """``path`` as a page or record shows it: relative to the repository when inside it (a record
    names no machine's folders)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def keep_record(records: Path, out: Path, run_dir: Path) -> None:
    """Keep the finished run in ``run_dir`` (under ``out``) as a record: its results.json, at the
    same relative path under ``records``. A record of another config at that path is never
    overwritten (it is someone's CPU-hours): the run is left out, with a warning."""
    source, target = run_dir / RESULTS, records / run_dir.relative_to(out) / RESULTS
    config = _complete_config(source)
    if config is None:
        return
    if target.is_file() and _config(target) != config:
        logger.warning("fidelity: %s holds a record of another config; not overwritten (give --records a folder "
                       "of its own for these runs)", target.parent)
        return
    _copy(source, target)
    logger.info("fidelity: kept %s", target.parent)


def folder_job(scenario: Scenario, run: Path) -> Job | None:
    """The job and seed a run folder ``<label>[<configuration>]/seed<k>`` names, as the scenario
    declares them now; None when the folder names no job of it."""
    label, _, rest = run.parent.name.partition("[")
    spec, seed = scenario.jobs.get(label), run.name.removeprefix("seed")
    if spec is None or not run.name.startswith("seed") or not seed.isdigit():
        return None
    point = tuple(o for o in rest.removesuffix("]").split(",") if o)
    return Job(spec.strategy, int(seed), spec.overrides + point, run.parent.name, fresh_partition=True)


def config_now(scenario: Scenario, base: Any, run: Path) -> dict[str, Any] | None:
    """The config, as records compare it (:func:`_config`), that the job and seed a run folder
    names (:func:`folder_job`) run now (``base``: the scenario's config with the command's ``--set``
    overrides); None when the folder names no job of it."""
    job = folder_job(scenario, run)
    if job is None:
        return None
    return _comparable(job_config(base, job, run).model_dump(mode="json"))


def of_config_now(path: Path, run: Path, now: Callable[[Path], dict[str, Any] | None] | None) -> bool:
    """Whether the results.json at ``path`` is a complete run of the config its folder ``run``
    (relative to its root) names now (``now``: :func:`config_now` bound to a scenario; None: any
    complete run). One read of the file serves both checks."""
    config = _complete_config(path)
    return config is not None and (now is None or config == now(run))


def sync_records(records: Path, out: Path, current: Callable[[Path], dict[str, Any] | None] | None = None,
                 ) -> tuple[int, int]:
    """Restore every record into ``out`` where ``out`` holds no complete run of it (so the run is
    skipped: ``is_complete`` still compares its whole config), and keep every complete run of
    ``out`` that ``records`` lacks. With ``current`` (a run folder relative to ``out``: the config
    its job runs now, :func:`config_now`), only records and runs of that config move: after the
    scenario's setting changed, the earlier setting's runs left in ``out`` (their checkpoints
    continue them) are not kept as records of the new one, where they would block the new runs'
    records (:func:`keep_record` never overwrites another config's). Returns (restored, kept)."""
    restored = kept = 0
    for record in sorted(records.glob(f"*/*/{RESULTS}")) if records.is_dir() else []:
        target = out / record.relative_to(records)
        if not complete_by_itself(target) and of_config_now(record, record.parent.relative_to(records), current):
            _copy(record, target)
            restored += 1
    for run in sorted(out.glob(f"*/*/{RESULTS}")) if out.is_dir() else []:
        if run.parent.parent.name == "tensorboard":
            continue
        target = records / run.relative_to(out)
        if not target.is_file() and of_config_now(run, run.parent.relative_to(out), current):
            _copy(run, target)
            kept += 1
    return restored, kept


def tree_agreement_rows(out: Path) -> list[dict[str, Any]]:
    """Every FedTreeLoRA run under ``out`` with planted task groups: its final tree's cuts and
    each block's adjusted Rand index against the groups (:func:`fedlora.methods.fedtreelora.
    tree_agreement`, computed from the recorded clusters, so records written before the ARI was
    recorded have it too), and in how many of its tree rounds the agreement was the same."""
    from fedlora.data.federated import client_groups
    from fedlora.methods.fedtreelora import tree_agreement
    from fedlora.schema import DataConfig

    rows = []
    for path in sorted(out.glob(f"*/seed*/{RESULTS}")):
        results = json.loads(path.read_text())
        if results.get("strategy") != "fedtreelora":
            continue
        groups = client_groups(DataConfig.model_validate(results["config"]["data"]))
        trees = [r["extra"] for r in results.get("rounds") or [] if (r.get("extra") or {}).get("clusters")]
        if groups is None or not trees:
            continue
        per_round = [[value for _, value in sorted(tree_agreement(
            {int(b): {int(p): c for p, c in m.items()} for b, m in extra["clusters"].items()}, groups).items())]
            for extra in trees]
        rows.append({"run": path.parent.parent.name, "seed": int(results["config"]["train"]["seed"]),
                     "cuts": trees[-1]["cuts"], "ari": per_round[-1],
                     "rounds": f"{sum(1 for ari in per_round if ari == per_round[-1])} of {len(per_round)}"})
    return rows


# --------------------------------------------------------------------------- the scenario
def run_scenario(name: str, seeds: list[int] | None, out: Path, workers: int, overrides: list[str],
                 other_seeds: int | None = None, records: Path | None = None,
                 tuning_from: Path | None = None) -> dict:
    """Run (or finish) one scenario and write its tables; returns the fidelity facts (``seeds`` /
    ``other_seeds`` None: the scenario's). With ``records``, the complete runs kept there are
    restored into ``out`` first (they are skipped) and every run is kept there as soon as it
    finishes (:func:`keep_record`). With ``tuning_from``, every job runs at the configuration the
    complete tuning stage kept there chose (:func:`tuning_in`) and there is no tuning stage: the
    final runs, the first seed's included, are this command's own (a check of one precision or
    device against another at the same configurations)."""
    scenario = scenarios()[name]
    seeds = list(scenario.seeds.core) if seeds is None else seeds
    other_seeds = scenario.seeds.other if other_seeds is None else other_seeds
    config = str(ROOT / scenario.config)
    on_done = None
    if records is not None:
        base = resolve_base(config, overrides)
        restored, kept = sync_records(records, out, lambda run: config_now(scenario, base, run))
        logger.info("fidelity: %s: %d record(s) restored from %s, %d finished run(s) kept there", name, restored,
                    records, kept)
        on_done = lambda job, run_dir: keep_record(records, out, run_dir)
    started = time.perf_counter()
    if tuning_from is None:
        plans = tune_scenario(scenario, config, seeds[0], out, workers, overrides, on_done,
                              finals=lambda plans: early_finals(scenario, plans, seeds, other_seeds))
        tuning_dir = out
    else:
        plans, tuning_dir = tuning_in(scenario, config, seeds[0], tuning_from), tuning_from
    tuned = time.perf_counter()
    chosen = choices(scenario, plans)
    jobs = final_jobs(scenario, seeds, chosen, other_seeds)
    run_jobs(config, jobs, out, engine="inprocess", overrides=overrides, workers=workers, on_done=on_done)
    finished = time.perf_counter()
    folders = {point_label(label, chosen[label]): label for label in scenario.jobs}
    table = summarize(out, labels=list(folders), rename=folders, seeds=seeds)
    runs = {folders[folder]: results for folder, results in load_runs(out, list(folders), seeds).items()}
    if scenario.causal:
        add_final_metrics(table, runs, CAUSAL_METRICS)
    paired = paired_comparisons(table.runs, comparisons(scenario, seeds, other_seeds), primary=scenario.primary,
                                primary_metric=scenario.metric, metrics=scenario.paired_metrics)
    paired.write(out)
    from fedlora.app.plotting import plot_comparison

    data = resolve_base(config, overrides).data
    plot_comparison(out, runs, data.model_copy(update={"seed": data.seed + seeds[0]}))  # the first seed's partition
    own = {label: results for label, results in runs.items() if scenario.jobs[label].strategy == scenario.method}
    plot_method_mechanism(scenario.method, own, out / MECHANISM_PLOT)  # the method and its ablations
    reference_seeds = sorted(per_seed(table, "centralized", scenario.regime_metric))
    untrained = measure_untrained(scenario, resolve_base(config, overrides),
                                  [folder for folder in (records, out) if folder is not None], reference_seeds)
    facts = regime(table, scenario, untrained)
    facts |= {
        "scenario": name, "seeds": seeds, "other_seeds": seeds[:other_seeds], "workers": workers,
        "tuning_from": None if tuning_from is None else _shown_path(tuning_from),
        "tuning": {label: tuning_facts(plans[label], tuning_dir, label, seeds[0]) if label in plans
                   else {"chosen": ",".join(chosen[label]), "reuses": scenario.jobs[label].tuned_as}
                   for label in scenario.jobs},
        "stage_seconds": {"tuning": tuned - started, "final": finished - tuned},
        "times": times(table, workers),
        "machines": machines(out),
        "primary": {"label": scenario.primary[0], "baseline": scenario.primary[1], "metric": scenario.metric},
        "device": device_name(resolve_base(config, overrides).train.device),
        "tree_agreement": tree_agreement_rows(out) if scenario.method == "fedtreelora" else [],
        "against": None if tuning_from is None else against(tuning_from, folders, scenario, table, paired, seeds,
                                                            other_seeds),
    }
    (out / "fidelity.json").write_text(json.dumps(facts, indent=2))
    (out / "fidelity.md").write_text(report(name, scenario, table, paired, facts, overrides))
    return facts


def against(reference: Path, folders: dict[str, str], scenario: Scenario, table, paired: PairedTable,
            seeds: list[int], other_seeds: int) -> dict[str, Any]:
    """This command's runs against the same jobs at the same configurations in ``reference`` (the
    ``--tuning-from`` folder, e.g. fp32 against this bf16): each comparison's paired difference on
    the scenario's metric here and there (on the same seeds, and on every seed kept there), whether
    this mean lies inside that interval and the conclusions agree (both intervals exclude 0 on the
    same side, or both include it); and each job's mean run-to-run difference on the same seeds."""
    everything = summarize(reference, labels=list(folders), rename=folders, write=False).runs
    theirs = [r for r in everything if int(r["seed"]) in seeds]
    wanted = comparisons(scenario, seeds, other_seeds)
    kwargs = {"primary": scenario.primary, "primary_metric": scenario.metric, "metrics": (scenario.metric,)}
    ran = {(r["strategy"], int(r["seed"])) for r in everything}
    both = [Pair(p.label, p.baseline, tuple(sorted(s for (label, s) in ran if label == p.label
                                                    and (p.baseline, s) in ran))) for p in wanted]
    same, every = paired_comparisons(theirs, wanted, **kwargs), paired_comparisons(everything, both, **kwargs)

    def side(row: dict[str, Any]) -> str:
        return "inside" if row["ci_low"] <= 0 <= row["ci_high"] else ("above" if row["ci_low"] > 0 else "below")

    rows = []
    for pair in wanted:
        try:
            mine, there, all_there = (t.row(pair.label, scenario.metric, pair.baseline) for t in (paired, same, every))
        except KeyError:
            continue
        rows.append({"label": pair.label, "baseline": pair.baseline, "n": int(mine["n"]),
                     "this": [mine["mean_difference"], mine["ci_low"], mine["ci_high"]],
                     "there": [there["mean_difference"], there["ci_low"], there["ci_high"]],
                     "there_all": [all_there["mean_difference"], all_there["ci_low"], all_there["ci_high"],
                                   int(all_there["n"])],
                     "within": bool(all_there["ci_low"] <= mine["mean_difference"] <= all_there["ci_high"]),
                     "agree": side(mine) == side(there)})
    key = scenario.metric
    by_run = {(r["strategy"], int(r["seed"])): r[key] for r in theirs}
    jobs = []
    for label in folders.values():
        differences = [r[key] - by_run[(label, int(r["seed"]))] for r in table.runs
                       if r["strategy"] == label and (label, int(r["seed"])) in by_run]
        if differences:
            jobs.append({"job": label, "n": len(differences), "mean": sum(differences) / len(differences),
                         "max_abs": max(abs(d) for d in differences)})
    return {"reference": _shown_path(reference), "metric": key, "comparisons": rows, "jobs": jobs}


def against_markdown(facts: dict[str, Any]) -> list[str]:
    """The page's section of :func:`against`, in points."""
    def ci(values: list[float]) -> str:
        return f"{100 * values[0]:+.2f} [{100 * values[1]:+.2f}, {100 * values[2]:+.2f}]"

    lines = [f"## Against `{facts['reference']}` (same jobs, configurations and seeds)", "",
             (f"Paired differences on `{facts['metric']}` in points, mean [95 % bootstrap interval]: this command's "
              "runs, the reference's runs on the same seeds, and the reference's on every seed it kept. "
              "Inside: this mean lies inside the reference's interval on every seed. Same conclusion: both "
              "intervals on the same seeds exclude 0 on the same side, or both include it."), "",
             "| comparison | seeds | this | reference, same seeds | reference, every seed (n) | inside | same conclusion |",
             "|---|---|---|---|---|---|---|"]
    for row in facts["comparisons"]:
        lines.append(f"| {row['label']} − {row['baseline']} | {row['n']} | {ci(row['this'])} | {ci(row['there'])} | "
                     f"{ci(row['there_all'][:3])} ({row['there_all'][3]}) | {'yes' if row['within'] else 'no'} | "
                     f"{'yes' if row['agree'] else 'no'} |")
    lines += ["", "Each job, run against run on the same seed (this − reference, points):", "",
              "| job | seeds | mean | largest absolute |", "|---|---|---|---|"]
    lines += [f"| {j['job']} | {j['n']} | {100 * j['mean']:+.2f} | {100 * j['max_abs']:.2f} |" for j in facts["jobs"]]
    return [*lines, ""]


def add_final_metrics(table, runs: dict[str, list[dict]], keys: tuple[str, ...]) -> None:
    """Each run's final value of ``keys`` (results.json ``final``; the summary's columns are the
    classifier's) into its row of ``table.runs``, and their mean / std over seeds into ``table.rows``."""
    import statistics

    final = {(label, int(r["config"]["train"]["seed"])): r.get("final") or {} for label, rs in runs.items() for r in rs}
    for row in table.runs:
        values = final.get((row["strategy"], int(row["seed"])), {})
        row.update({key: float(values[key]) if isinstance(values.get(key), (int, float)) else math.nan for key in keys})
    for summary in table.rows:
        for key in keys:
            values = [run[key] for run in table.runs if run["strategy"] == summary["strategy"] and math.isfinite(run[key])]
            summary[f"{key}_mean"] = statistics.fmean(values) if values else math.nan
            summary[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0


def device_name(device: str) -> str:
    """The accelerator the runs used, named (the page says which GPU produced its figures)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores)"


def tuning_facts(p: TunePlan, out: Path, label: str, seed: int) -> dict:
    """The configurations one job tried, their validation scores, the choice and the widening."""
    scores, minutes, cpu = {}, 0.0, []
    for point in p.points:
        runs = load_runs(out, [point_label(label, point)], [seed]).get(point_label(label, point))
        scores[",".join(point)] = validation_score(runs[0]) if runs else math.nan
        minutes += float(runs[0].get("wall_seconds") or 0.0) / 60 if runs else 0.0
        if runs and runs[0].get("cpu_seconds") is not None:
            cpu.append(float(runs[0]["cpu_seconds"]) / 60)
    return {"chosen": ",".join(p.chosen or ()), "configurations": len(p.points),
            "budget": len(p.budget_points), "widened": p.widened, "at_edge": p.at_edge, "validation_scores": scores,
            "worker_minutes": minutes, "cpu_minutes": sum(cpu), "cpu_runs": len(cpu)}


def times(table, workers: int) -> dict:
    """Minutes per run (mean wall time per job) and per seed (the seed's runs, summed and divided
    among the workers), from the runs' own wall times; and the CPU minutes of the runs that recorded
    them (``cpu_seconds``: the run's cost whatever else the machine ran; older records lack it)."""
    per_seed: dict[int, float] = {}
    for run in table.runs:
        if math.isfinite(run["wall_seconds"]):
            per_seed[int(run["seed"])] = per_seed.get(int(run["seed"]), 0.0) + run["wall_seconds"] / 60
    cpu = [run["cpu_seconds"] / 60 for run in table.runs if math.isfinite(run["cpu_seconds"])]
    return {
        "minutes_per_run": {row["strategy"]: row["wall_seconds_mean"] / 60 for row in table.rows},
        "worker_minutes_per_seed": per_seed,
        "minutes_per_seed": {seed: minutes / workers for seed, minutes in per_seed.items()},
        "cpu_minutes": sum(cpu), "cpu_runs": len(cpu), "runs": len(table.runs),
    }


def machines(out: Path) -> dict[str, int]:
    """How many of the complete runs under ``out`` (tuning and final) each machine finished, by the
    CPU their ``results.json`` names (``machine``, :func:`fedlora.results.machine`; with the GPU when
    one trained); records written before the field (added 2026-12-06) do not say ("not recorded")."""
    counts: Counter[str] = Counter()
    for path in sorted(out.glob(f"*/seed*/{RESULTS}")):
        if (results := _complete_results(path)) is not None:
            machine = results.get("machine") or {}
            name = machine.get("cpu") or "not recorded"
            counts[f"{name} + {machine['gpu']}" if machine.get("gpu") else name] += 1
    return dict(counts.most_common())


def per_seed(table, label: str, key: str) -> dict[int, float]:
    """Each seed's final ``key`` of the row ``label`` (finite values only)."""
    return {int(r["seed"]): float(r[key]) for r in table.runs
            if r["strategy"] == label and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}


def regime_facts(scenario: Scenario, fedit: dict[int, float], reference: dict[int, float],
                 untrained: dict[int, float]) -> dict:
    """The regime rule on per-seed values: FedIT against the reference on the seeds both ran (the
    5-point gap), the reference against the untrained model on the seeds both have (the learning
    floor), and whether the scenario counts; ``why`` says what fails (or what is not known yet)."""
    import statistics

    rule = scenario.regime
    shared = sorted(set(fedit) & set(reference))
    floor_seeds = sorted(set(reference) & set(untrained))
    mean = lambda values: statistics.fmean(values) if values else math.nan
    fedit_mean, reference_mean = mean([fedit[s] for s in shared]), mean([reference[s] for s in shared])
    gap = reference_mean - fedit_mean
    learned = mean([reference[s] - untrained[s] for s in floor_seeds])
    why = []
    if not shared:
        why.append("FedIT and the reference share no finished seed yet")
    elif gap > rule.max_gap_points / 100:
        why.append(f"the reference is {100 * gap:.1f} points above FedIT (at most {rule.max_gap_points:g}: too short "
                   "for the federation to catch up)")
    if not floor_seeds:
        why.append("the untrained model is not measured on the reference's seeds yet")
    elif learned < rule.floor_points / 100:
        why.append(f"the reference learned {100 * learned:+.1f} points over the untrained model (at least "
                   f"{rule.floor_points:g}: too little is learned to compare)")
    return {"regime_metric": rule.metric, "regime_seeds": shared, "fedit": fedit_mean, "centralized": reference_mean,
            "gap_points": 100 * gap, "floor_seeds": floor_seeds,
            "untrained": mean([untrained[s] for s in floor_seeds]),
            "reference_on_floor_seeds": mean([reference[s] for s in floor_seeds]),
            "learned_points": 100 * learned, "floor_points": rule.floor_points, "max_gap_points": rule.max_gap_points,
            "counts": not why, "why": "; ".join(why)}


def regime(table, scenario: Scenario, untrained: dict[int, float]) -> dict:
    """FedIT's regime metric next to the centralised reference's and the untrained model's, per seed
    (:func:`regime_facts`), and whether the scenario counts."""
    key = scenario.regime_metric
    return regime_facts(scenario, per_seed(table, "fedit", key), per_seed(table, "centralized", key), untrained)


# --------------------------------------------------------------------------- the untrained model
UNTRAINED = "untrained"  # <records>/untrained/seed<k>/untrained.json: the floor's untrained model per seed
UNTRAINED_METRICS = ("global_accuracy", "global_rouge_l", "personalized_accuracy", "personalized_rouge_l")


def untrained_config(scenario: Scenario, base: Any, seed: int) -> Any:
    """The config whose initial adapter is the untrained model of ``seed``: the reference's job on that
    seed (its partition, ``train.seed``, evaluation sizes); its learning rate plays no part."""
    job = Job("centralized", seed, scenario.jobs["centralized"].overrides, "untrained", fresh_partition=True)
    return job_config(base, job, Path("untrained") / f"seed{seed}")


def untrained_score(config: Any, metric: str) -> float:
    """``metric`` of the adapter at initialisation (B = 0, the head as seeded: the model before any
    round), computed by the runs' own evaluation code: the global test as the server scores it, or
    every client's local test example-weighted as the clients' evaluation is aggregated (a causal LM:
    weighted by the instructions each client scored)."""
    import tempfile

    from fedlora.backbones import load_tokenizer
    from fedlora.causal_lm import INSTRUCTIONS, evaluate_generation
    from fedlora.data import build_federated_data
    from fedlora.evaluation import GlobalEvaluator
    from fedlora.results import RoundRecord
    from fedlora.training import evaluate, make_loader

    if metric not in UNTRAINED_METRICS:
        raise ConfigError(f"[fidelity.regime] metric = {metric!r}: the learning floor can measure the untrained "
                          f"model on {', '.join(UNTRAINED_METRICS)} only")
    federated = build_federated_data(config.data)
    evaluator = GlobalEvaluator(config.model, config.train, federated, config.output.sample_generations)
    payload = evaluator.initial_adapter(config.model.lora_rank)
    if metric.startswith("global_"):
        record = RoundRecord(round=0)
        with tempfile.TemporaryDirectory() as scratch:
            evaluator.evaluate_into(payload, record, Path(scratch))
        return float(getattr(record, metric))
    cfg, model = config.train, evaluator.model_for(payload)
    tokenizer = load_tokenizer(config.model.path)
    scores, weights = [], []
    for client in federated.clients:
        if config.model.kind == "causal_lm":
            loader = make_loader(client.test, tokenizer, cfg.eval_batch_size, cfg.max_length, shuffle=False,
                                 rows=INSTRUCTIONS)
            result = evaluate_generation(model, client.test, loader, tokenizer, evaluator.torch_device,
                                         cfg.max_new_tokens, cfg.rouge_examples, cfg.eval_batch_size,
                                         precision=evaluator.precision)
            scores.append(result.rouge_l)
            weights.append(result.rouge_examples)
        else:
            loader = make_loader(client.test, tokenizer, cfg.eval_batch_size, cfg.max_length, shuffle=False)
            stats = evaluate(model, loader, evaluator.torch_device, evaluator.precision)
            scores.append(stats.accuracy)
            weights.append(stats.examples)
    kept = [(s, w) for s, w in zip(scores, weights) if w > 0 and math.isfinite(s)]
    return sum(s * w for s, w in kept) / sum(w for _, w in kept) if kept else math.nan


def untrained_record(folder: Path, seed: int) -> Path:
    return folder / UNTRAINED / f"seed{seed}" / "untrained.json"


def recorded_untrained(scenario: Scenario, base: Any, folder: Path, seeds: list[int]) -> dict[int, float]:
    """The untrained model's regime metric per seed as kept in ``folder`` (records or output), for the
    seeds whose record was measured at the config those seeds run now; runs nothing."""
    found = {}
    for seed in seeds:
        path = untrained_record(folder, seed)
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        wanted = _comparable(untrained_config(scenario, base, seed).model_dump(mode="json"))
        if kept.get("metric") == scenario.regime_metric and _comparable(kept.get("config") or {}) == wanted:
            found[seed] = float(kept["value"])
    return found


def measure_untrained(scenario: Scenario, base: Any, folders: list[Path], seeds: list[int]) -> dict[int, float]:
    """The untrained model's regime metric on ``seeds``: read from the first of ``folders`` that
    holds it at the current config, else measured (seconds for a classifier; a causal LM generates)
    and written into every folder (a record like the runs': nothing computed is thrown away)."""
    found: dict[int, float] = {}
    for folder in folders:
        found |= {s: v for s, v in recorded_untrained(scenario, base, folder, seeds).items() if s not in found}
    for seed in [s for s in seeds if s not in found]:
        config = untrained_config(scenario, base, seed)
        started = time.perf_counter()
        with quiet.output():  # fedlora's lines only, as in a run (no library load reports)
            found[seed] = untrained_score(config, scenario.regime_metric)
        kept = {"metric": scenario.regime_metric, "value": found[seed], "seed": seed,
                "seconds": time.perf_counter() - started,
                "config": _comparable(config.model_dump(mode="json"))}
        for folder in folders:
            path = untrained_record(folder, seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(kept, indent=2))
        logger.info("fidelity: the untrained model on seed %d: %s %.4f (%.0f s)", seed, scenario.regime_metric,
                    found[seed], kept["seconds"])
    return found


# --------------------------------------------------------------------------- the page
CLASSIFIER_COLUMNS = (("personalized_accuracy", "personalised acc."), ("personalized_accuracy_worst", "worst client"),
                      ("received_accuracy", "received acc."), ("global_accuracy", "global acc."))
CAUSAL_COLUMNS = (("received_token_accuracy", "received token acc."), ("received_loss", "received loss"),
                  ("personalized_rouge_l", "personalised ROUGE-L"), ("personalized_rouge_l_worst", "worst client"),
                  ("global_rouge_l", "global ROUGE-L"), ("personalized_loss", "personalised loss"))
def _cell(row: dict, key: str, digits: int = 3) -> str:
    mean, std = row[f"{key}_mean"], row[f"{key}_std"]
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if row["seeds"] > 1 else f"{mean:.{digits}f}"


def _minutes(seconds: float | None) -> str:
    """Seconds as minutes with one decimal, '-' where not recorded."""
    return f"{seconds / 60:.1f}" if seconds is not None and math.isfinite(seconds) else "-"


def regime_line(facts: dict, verdict: str) -> str:
    """The page's regime line: the gap rule and the learning floor, each on the seeds it compares."""
    def seeds(values: list[int]) -> str:
        return f"seed{'s' if len(values) != 1 else ''} {','.join(str(s) for s in values)}"

    return (f"Regime: FedIT {facts['regime_metric']} {facts['fedit']:.4f} vs centralised reference "
            f"{facts['centralized']:.4f} ({seeds(facts['regime_seeds'])}; same data, same total optimiser steps): gap "
            f"{facts['gap_points']:.1f} points (at most {facts['max_gap_points']:g}); the reference "
            f"{facts['reference_on_floor_seeds']:.4f} vs the untrained model {facts['untrained']:.4f} "
            f"({seeds(facts['floor_seeds'])}): learned {facts['learned_points']:+.1f} points (at least "
            f"{facts['floor_points']:g}); the scenario {verdict}.")


def report(name: str, scenario: Scenario, table, paired: PairedTable, facts: dict, overrides: list[str]) -> str:
    """The markdown the docs cite: command, regime, tuning, results, paired comparisons, mechanisms."""
    seeds_text = ",".join(str(s) for s in facts["seeds"])
    command = f"python benchmarks/fidelity.py --scenario {name} --seeds {seeds_text} --workers {facts['workers']}"
    command += "".join(f" --set {o}" for o in overrides)
    if facts.get("tuning_from"):
        command += f" --tuning-from {facts['tuning_from']}"
    selection = "validation loss per response token; score = minus the loss" if scenario.causal else "validation accuracy"
    verdict = "counts" if facts["counts"] else f"does NOT count: {facts['why']}"
    method, lead = scenario.primary
    lines = [
        f"# Fidelity: {name}", "", f"    {command}", "", f"Device: {facts['device']}.", "",
        (f"Config: `{scenario.config}`. Paper's claim checked: {scenario.claim}. Metric the paper reports: "
         f"`{scenario.metric}`."), "",
        (f"Seeds: {seeds_text} for the core jobs (the method, its ablations, the lead baseline), "
         f"{','.join(str(s) for s in facts['other_seeds'])} for the others; seed k is `train.seed = k` and "
         f"`data.seed = config + k` (a fresh partition, shared by every job of that seed)."), "",
        regime_line(facts, verdict), "",
        (f"Primary comparison (declared before the runs): {method} − {lead} on {METRIC_NAMES[scenario.metric]}: "
         f"{scenario.primary_why}."), "",
        f"## Tuning (first seed, chosen on {selection})", "",
        *([(f"Not run by this command: every job runs at the configuration the complete tuning stage in "
            f"`{facts['tuning_from']}` chose (its runs, scores and minutes below), the first seed included."), ""]
          if facts.get("tuning_from") else []),
        (f"Budget: {scenario.budget.size} configurations per job; learning rates "
         f"{', '.join(f'{lr:g}' for lr in scenario.budget.lr_grid)} (a job with a knob of k values: the first "
         f"{scenario.budget.size} - (k - 1) of them, then the knob's other values at the chosen rate); a choice at "
         f"the edge of the rates tried adds the next rate beyond it (x{scenario.budget.ratio:g}), at most "
         f"{scenario.budget.max_widen} times."), "",
        "| job | role | configurations (budget + widened) | chosen | validation scores |",
        "|---|---|---|---|---|",
    ]
    for label, info in facts["tuning"].items():
        spec = scenario.jobs[label]
        if "reuses" in info:
            lines.append(f"| {label} | {spec.role} | none: reuses {info['reuses']}'s choice | `{info['chosen']}` | - |")
            continue
        scores = "; ".join(f"{k}: {v:.4f}" for k, v in info["validation_scores"].items())
        edge = " (still at the edge)" if info["at_edge"] else ""
        lines.append(f"| {label} | {spec.role} | {info['budget']} + {info['widened']}{edge} | `{info['chosen']}` | "
                     f"{scores} |")
    columns = (CAUSAL_COLUMNS if scenario.causal else CLASSIFIER_COLUMNS)
    lines += ["", "## Results (final round, mean ± std over seeds)", "",
              (f"| job | role | seeds | {' | '.join(header for _, header in columns)} | MB total | min / run | "
               "CPU min / run |"),
              "|---|---|---|" + "---|" * (len(columns) + 3)]
    for row in table.rows:
        spec = scenario.jobs[row["strategy"]]
        note = f" ({spec.note})" if spec.note else ""
        cells = " | ".join(_cell(row, key) for key, _ in columns)
        lines.append(f"| {row['strategy']}{note} | {spec.role} | {row['seeds']} | {cells} | "
                     f"{row['bytes_total_mean'] / 1e6:.1f} | {row['wall_seconds_mean'] / 60:.1f} | "
                     f"{_minutes(row.get('cpu_seconds_mean'))} |")
    if scenario.causal:
        lines += ["", ("Received: each sampled client's model as received, before it trains, on its local test "
                       "split, teacher-forced (next-token accuracy and loss per response token, token-weighted; the "
                       "official code's metric). ROUGE-L: greedy generations, F1 (personalised: each client's own "
                       "model on its local test, example-weighted; global: the global model on the global test set). "
                       "Losses: per response token.")]
    t = facts["times"]
    per_seed = ", ".join(f"seed {s}: {m:.0f}" for s, m in sorted(t["minutes_per_seed"].items()))
    tuning_runs = sum(info.get("configurations", 0) for info in facts["tuning"].values())
    tuning_minutes = sum(info.get("worker_minutes", 0.0) for info in facts["tuning"].values())
    first = "" if facts.get("tuning_from") else "; the first seed's runs are tuning runs"
    lines += ["", (f"Times, from the runs' own wall times: minutes per seed with {facts['workers']} worker(s) "
                   f"({per_seed}{first}); the tuning stage, {tuning_runs} runs on the "
                   f"first seed, {tuning_minutes:.0f} worker-minutes ({tuning_minutes / facts['workers']:.0f} minutes "
                   f"with {facts['workers']} workers). This command's own stages: tuning "
                   f"{facts['stage_seconds']['tuning'] / 60:.0f} minutes (with the final runs of the jobs that had "
                   f"chosen), final runs "
                   f"{facts['stage_seconds']['final'] / 60:.0f} (complete runs are skipped, so a resumed command "
                   f"counts only what it ran).")]
    tuning_cpu_runs = sum(info.get("cpu_runs", 0) for info in facts["tuning"].values())
    if t["cpu_runs"] or tuning_cpu_runs:
        tuning_cpu = sum(info.get("cpu_minutes", 0.0) for info in facts["tuning"].values())
        lines.append(f"CPU time, the cost whatever else the machine ran (recorded by {t['cpu_runs']} of the "
                     f"{t['runs']} final runs and {tuning_cpu_runs} of the {tuning_runs} tuning runs; older records "
                     f"lack it): final runs {t['cpu_minutes']:.0f} CPU-minutes, tuning runs {tuning_cpu:.0f}.")
    if facts.get("machines"):
        lines.append("Machines (the CPU each record names, the last to work on the run; older records do not say): "
                     + ", ".join(f"{name} {count}" for name, count in facts["machines"].items()) + " runs.")
    lines += ["", paired.to_markdown(heading="##")]
    if facts.get("against"):
        lines += against_markdown(facts["against"])
    lines += ["## Mechanisms", "",
              (f"Whether {scenario.method}'s mechanism acted, for the method and its ablations "
               "(fedlora.app.mechanisms; mean over seeds):"), "",
              f"![mechanism]({MECHANISM_PLOT})", "",
              "Each numeric entry of the rounds' `extra` (final round, mean ± std over seeds):", ""]
    if table.extra_keys:
        lines += [table.mechanisms().to_markdown(index=False, tablefmt="pipe", disable_numparse=True), ""]
    if facts.get("tree_agreement"):
        lines += ["### The tree against the task groups", "",
                  ("Adjusted Rand index of each block's clusters (shallow to deep) against the scenario's task "
                   "groups, for every FedTreeLoRA run kept (the tuning configurations on the first seed and "
                   "every seed of the chosen one): 1 = the groups exactly, 0 = one cluster or chance. Rounds: "
                   "the rounds with a tree and how many of them had this agreement (the tree is built once)."), "",
                  "| run | seed | cuts per block | ARI per block | rounds |", "|---|---|---|---|---|"]
        for row in facts["tree_agreement"]:
            lines.append(f"| `{row['run']}` | {row['seed']} | {row['cuts']} | "
                         f"{', '.join(f'{a:.2f}' for a in row['ari'])} | {row['rounds']} |")
        lines.append("")
    lines += ["## Full summary", "", table.to_markdown()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- progress
def progress(name: str, seeds: list[int] | None, records: Path, overrides: list[str],
             other_seeds: int | None = None, tuning_from: Path | None = None) -> dict[str, int]:
    """How far scenario ``name`` is in ``records``: tuning runs done and still pending (as far as
    the plan is known: a widening adds runs only once the grid's runs are in), and the final runs
    (every job at its choice on every seed, the first seed's tuning runs not counted twice) done
    and planned (``seeds`` / ``other_seeds`` None: the scenario's; ``tuning_from``: the choices of
    the tuning kept there, :func:`tuning_in`, and every seed's runs are final runs). Reads the
    records only; runs nothing."""
    scenario = scenarios()[name]
    seeds = list(scenario.seeds.core) if seeds is None else seeds
    config = str(ROOT / scenario.config)
    base = resolve_base(config, overrides)
    if tuning_from is not None:
        plans = tuning_in(scenario, config, seeds[0], tuning_from)
        tuning_done = pending = 0
    else:
        plans = plans_in(scenario, base, seeds[0], records)
        pending = sum(len(p.pending) for p in plans.values())
        tuning_done = sum(len(p.points) for p in plans.values()) - pending
    tuned = all(p.chosen is not None for p in plans.values())
    ready = known(scenario, plans)  # the final runs of a job that has chosen may run before the others choose
    final = [job for job in final_jobs(scenario, seeds, choices(scenario, plans), other_seeds)
             if tuning_from is not None
             or not is_tuning_run(scenario, job, seeds)]
    finished = [run_dir for job in final if label_of(job) in ready
                and is_complete(run_dir := job.run_dir(records), job_config(base, job, run_dir))]
    if tuning_from is None:
        finished += [tuning_job(scenario, label, point, seeds[0]).run_dir(records)
                     for label, p in plans.items() for point in p.points if point not in p.pending]
    cpu = [seconds for folder in finished if math.isfinite(seconds := number(load_results(folder).get("cpu_seconds")))]
    waiting = [] if tuning_from is not None else waiting_runs(scenario, base, records, set(finished), ready, seeds,
                                                              other_seeds)
    regime_now = status_regime(scenario, base, records, plans, seeds, other_seeds) if tuned else None
    outside = [] if tuning_from is not None else outside_plan(scenario, base, records, {*finished, *waiting})
    return {"tuning_done": tuning_done, "tuning_pending": pending,
            "tuning_complete": int(tuned), "final_done": len(finished) - tuning_done, "final_planned": len(final),
            "waiting": len(waiting), "outside": len(outside), "cpu_seconds": sum(cpu), "cpu_runs": len(cpu),
            "runs": len(finished), "regime": regime_now}


def outside_plan(scenario: Scenario, base: Any, records: Path, counted: set[Path]) -> list[Path]:
    """Complete records at the config their folder names today (:func:`config_now`) that the plan
    counts nowhere (not in ``counted``): runs of a configuration the tuning no longer chooses, e.g.
    after the tie rule was corrected (2026-12-07). They stay committed (nothing computed is thrown
    away) and are reported; a record whose config no longer matches its folder is not among them."""
    return [run for path in (sorted(records.glob(f"*/seed*/{RESULTS}")) if records.is_dir() else [])
            if (run := path.parent) not in counted and path.parent.parent.name.partition("[")[0] in scenario.jobs
            and of_config_now(path, run.relative_to(records), functools.partial(config_now, scenario, base))]


def status_regime(scenario: Scenario, base: Any, records: Path, plans: dict[str, TunePlan], seeds: list[int],
                  other_seeds: int | None) -> dict:
    """The regime rule (:func:`regime_facts`) on the complete runs of FedIT and the reference kept in
    ``records`` at their chosen configurations and on the untrained model's records; ``complete``:
    whether every planned seed of both is in. Reads the records only."""
    key, values = scenario.regime_metric, {"fedit": {}, "centralized": {}}
    planned = 0
    for job in final_jobs(scenario, seeds, choices(scenario, plans), other_seeds):
        label = label_of(job)
        if label not in values:
            continue
        planned += 1
        run_dir = job.run_dir(records)
        if is_complete(run_dir, job_config(base, job, run_dir)):
            value = number((load_results(run_dir).get("final") or {}).get(key))
            if math.isfinite(value):
                values[label][job.seed] = value
    untrained = recorded_untrained(scenario, base, records, sorted(values["centralized"]))
    facts = regime_facts(scenario, values["fedit"], values["centralized"], untrained)
    return facts | {"complete": sum(len(v) for v in values.values()) == planned}


def regime_cell(facts: dict | None) -> str:
    """The status table's regime cell: counts or not and why, from what is in so far."""
    if facts is None:
        return "not known yet (tuning)"
    known = facts["regime_seeds"] and facts["floor_seeds"]
    sofar = "" if facts["complete"] else "so far: "
    if facts["counts"]:
        return (f"{sofar}counts (gap {facts['gap_points']:.1f} points, learned {facts['learned_points']:+.1f} over the "
                "untrained model)")
    return f"{sofar}{'does not count' if known else 'not known yet'}: {facts['why']}"


def waiting_runs(scenario: Scenario, base: Any, records: Path, counted: set[Path], ready: set[str],
                 seeds: list[int], other_seeds: int | None = None) -> list[Path]:
    """Complete runs in ``records`` of jobs whose tuning has not chosen yet (not in ``ready``), on
    their planned seeds and at the config their folder names today (:func:`config_now`), that the
    plan does not count yet (``counted``): a widened grid's point before the grid is in, or a final
    run at a configuration run ahead of the choice (a regime probe continued into the scenario's
    folder). They count once the tuning chooses their configuration; at another choice they count
    nowhere."""
    waiting = []
    for path in sorted(records.glob(f"*/seed*/{RESULTS}")) if records.is_dir() else []:
        run, label = path.parent, path.parent.parent.name.partition("[")[0]
        if run in counted or label not in scenario.jobs or label in ready:
            continue
        seed = run.name.removeprefix("seed")
        if not seed.isdigit() or int(seed) not in job_seeds(scenario, label, seeds, other_seeds):
            continue
        if of_config_now(path, run.relative_to(records), functools.partial(config_now, scenario, base)):
            waiting.append(run)
    return waiting


def progress_table(records: dict[str, Path], seeds: list[int] | None, overrides: list[str],
                   other_seeds: int | None = None, tuning_from: Path | None = None) -> str:
    """The protocol's progress, one row per scenario (``records``: scenario -> its records folder),
    as a Markdown table (the page copies it)."""
    header = ("| scenario | tuning runs done | tuning runs still to run (known now) | final runs done / planned "
              "| CPU hours of the runs done | regime (the gap rule and the learning floor) |")
    lines = [header, "|---|---|---|---|---|---|"]
    rows = {name: progress(name, seeds, folder, overrides, other_seeds, tuning_from) for name, folder in records.items()}
    for name, p in rows.items():
        pending = f"{p['tuning_pending']}" + ("" if p["tuning_complete"] else " (more if a grid widens)")
        complete = p["tuning_complete"] and p["final_done"] == p["final_planned"]
        waiting = f" (+{p['waiting']} waiting for their job's tuning)" if p["waiting"] else ""
        waiting += f" (+{p['outside']} outside the plan: configurations it no longer chooses)" if p["outside"] else ""
        lines.append(f"| {name} | {p['tuning_done']} | {pending} | {p['final_done']} / {p['final_planned']}"
                     f"{' (complete)' if complete else ''}{waiting} | "
                     f"{_cpu_hours(p['cpu_seconds'], p['cpu_runs'], p['runs'])} | {regime_cell(p['regime'])} |")
    if len(rows) > 1:
        total = (sum(p[key] for p in rows.values()) for key in ("cpu_seconds", "cpu_runs", "runs"))
        lines.append(f"| all | | | | {_cpu_hours(*total)} | |")
    return "\n".join(lines)


def _cpu_hours(seconds: float, recorded: int, runs: int) -> str:
    """CPU hours of ``runs`` runs, of which ``recorded`` kept their CPU time (older records lack it)."""
    if runs == 0:
        return "-"
    if recorded == 0:
        return f"not recorded ({runs} older runs)"
    return f"{seconds / 3600:.1f}" + ("" if recorded == runs else f" ({recorded} of {runs} runs recorded it)")


# --------------------------------------------------------------------------- command line
def tagged(folder: str, overrides: list[str] | None = None) -> str:
    """``folder``, or with ``--set`` overrides ``<folder>+<overrides>`` (sorted, each made safe for
    a path; a list's brackets and commas are kept, as in a job's ``<label>[<configuration>]``):
    runs of another device, precision or length never share a path with the scenario's own."""
    tag = "_".join(re.sub(r"[^A-Za-z0-9._=,\[\]-]", "-", override) for override in sorted(overrides or ()))
    return f"{folder}+{tag}" if tag else folder


def records_dir(records: str | None, folder: str, several: bool, overrides: list[str] | None = None) -> Path:
    """``--records`` for one scenario's ``folder``: a subfolder of it when several scenarios run.
    By default ``docs/results/records/<folder>``, with ``--set`` overrides a folder of their own
    (:func:`tagged`)."""
    if records is None:
        return ROOT / RECORDS / tagged(folder, overrides)
    return Path(records) / folder if several else Path(records)


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds``: distinct comma-separated integers >= 0 (None: each scenario's own)."""
    if text is None:
        return None
    seeds = [int(s) for s in text.split(",") if s.strip()]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(text)
    return seeds


def console_handler(stream: Any = None) -> logging.Handler:
    """The benchmark's console (stderr): timestamped, and quiet as fedlora's own (its lines and
    everyone's warnings, without the libraries' known noise such as a classifier's head reported
    MISSING at every model load); each run's run.log keeps every record."""
    from fedlora.app.quiet import QuietFilter

    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler.addFilter(QuietFilter())
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scenario", required=True,
                        help=f"the name of a config under {SCENARIO_CONFIGS}/ with a [{TABLE}] table, or 'all' (every "
                        "one, the LLM scenarios included)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds of the core jobs (default: the "
                        "scenario's seeds.core); seed k: train.seed = k, data.seed = config + k")
    parser.add_argument("--other-seeds", type=int, default=None,
                        help="the non-core jobs run the first N seeds (default: the scenario's seeds.other)")
    parser.add_argument("--workers", type=int, default=None, help="runs at a time (processes; they share a GPU); "
                        "default 2, with --gpu the scenario's number of jobs (all runs of a seed at once)")
    parser.add_argument("--out", default=None, help="output folder (default runs/fidelity/<scenario>, with --gpu "
                        "runs/fidelity/<scenario>-gpu; with --set, +<overrides> added, as the records' folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run, e.g. train.device=cuda")
    parser.add_argument("--records", default=None, metavar="DIR",
                        help="where complete runs are kept as records, one results.json each, as soon as they finish, "
                        "and restored from before running (default docs/results/records/<scenario>, with --gpu "
                        "<scenario>-gpu): the protocol continues from the committed records")
    parser.add_argument("--no-records", action="store_true", help="keep no records (runs stay under --out only)")
    parser.add_argument("--tuning-from", default=None, metavar="DIR",
                        help="run every job at the configuration the complete tuning stage kept in DIR chose (a "
                        "records folder of the scenario run without --set) and tune nothing, the first seed's runs "
                        "included: one precision or device checked against another at the same configurations, "
                        "e.g. --set train.precision=bf16 --tuning-from docs/results/records/fedtreelora")
    parser.add_argument("--status", action="store_true",
                        help="print how far each scenario's protocol is in the records (runs done / known to be "
                        "planned) and exit; runs nothing")
    parser.add_argument("--gpu", action="store_true",
                        help="the full version on one CUDA GPU: the scenario's full-size overrides (LLM scenarios), "
                        "train.device=cuda, all runs of a seed in parallel")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, handlers=[console_handler()])
    try:
        known = scenarios()
    except ConfigError as error:
        print(f"fidelity: error: {error}", file=sys.stderr)
        return 2
    names = list(known) if args.scenario == "all" else [args.scenario]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"fidelity: error: unknown scenario {unknown[0]!r}; known: {', '.join(known)}, all", file=sys.stderr)
        return 2
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError:
        print(f"fidelity: error: --seeds expects distinct comma-separated integers >= 0, got {args.seeds!r}",
              file=sys.stderr)
        return 2
    if (args.other_seeds is not None and args.other_seeds < 2) or (args.workers is not None and args.workers < 1):
        print("fidelity: error: --other-seeds must be >= 2 (a paired test needs 2 seeds) and --workers >= 1",
              file=sys.stderr)
        return 2
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("fidelity: error: --gpu needs a CUDA device and torch sees none; run without --gpu (CPU-sized) "
                  "or on a GPU machine", file=sys.stderr)
            return 2
    tuning_from = None if args.tuning_from is None else Path(args.tuning_from)
    if tuning_from is not None and (len(names) > 1 or not tuning_from.is_dir()):
        print(f"fidelity: error: --tuning-from needs one --scenario and an existing folder, got {args.tuning_from!r}",
              file=sys.stderr)
        return 2
    if args.status:
        folders = {name: records_dir(args.records, name, len(names) > 1, list(args.set)) for name in names}
        try:
            print(progress_table(folders, seeds, list(args.set), args.other_seeds, tuning_from))
        except ConfigError as error:
            print(f"fidelity: error: {error}", file=sys.stderr)
            return 2
        return 0
    for name in names:
        folder = f"{name}-gpu" if args.gpu else name
        own = tagged(folder, list(args.set))  # runs of other overrides never land in the scenario's own folder
        out = Path(args.out) / own if args.out and len(names) > 1 else Path(args.out or ROOT / "runs/fidelity" / own)
        overrides, workers = list(args.set), args.workers or 2
        if args.gpu:
            overrides = [*known[name].gpu, "train.device=cuda", *args.set]  # the user's --set wins
            workers = args.workers or len(known[name].jobs)
        records = None if args.no_records else records_dir(args.records, folder, len(names) > 1, list(args.set))
        try:
            own_seeds = list(known[name].seeds.core) if seeds is None else seeds
            facts = run_scenario(name, own_seeds, out, workers, overrides, args.other_seeds, records, tuning_from)
        except ConfigError as error:
            print(f"fidelity: error: {error}", file=sys.stderr)
            return 2
        print((out / "fidelity.md").read_text())
        print(f"results: {out}/fidelity.md (tables), {out}/summary.csv, {out}/paired.csv, {out}/{MECHANISM_PLOT}, "
              f"{out}/fidelity.json")
        print(f"scenario={name} counts={facts['counts']} fedit={facts['fedit']:.4f} "
              f"centralized={facts['centralized']:.4f} gap_points={facts['gap_points']:.1f} "
              f"untrained={facts.get('untrained', math.nan):.4f} "
              f"learned_points={facts.get('learned_points', math.nan):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
