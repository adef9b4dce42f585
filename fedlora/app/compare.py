"""Strategy comparison: run strategies x seeds on the same partitions and summarise them.

    table = fedlora.compare("configs/smoke.toml", ["fedit", "flexlora"], seeds=(0, 1),
                            engine="inprocess")
    table            # a notebook renders the mean +- std table with its legend

Two reusable halves (``fedlora tune`` and the reference runs build on them):

- :func:`run_jobs` runs a list of :class:`Job` (strategy, seed, overrides, label), each into
  ``OUT/<label>/seed<k>/``, skipping jobs whose ``results.json`` is already complete;
- :func:`summarize` reads every ``OUT/*/seed*/results.json`` and returns a
  :class:`ComparisonTable` (mean +- std over seeds per label), written as ``summary.csv`` /
  ``summary.md`` by :meth:`ComparisonTable.write`.

Same partitions by default: a job's seed overrides ``train.seed`` (LoRA init, batch order, client
sampling) only; ``data.seed`` stays the config's, so every strategy and every seed trains on
identical client partitions, validation / test splits and global test set. With
``fresh_partitions`` (``--fresh-partitions``) every seed is also a fresh partition:
``data.seed = <config's data.seed> + seed``, so the seeds measure the spread over partitions too;
every label of one seed still shares that seed's partition, so differences stay paired. Strategy
options in the base config's ``[strategy]`` section are kept for a strategy only when its options
model declares them; per-strategy options go into a job's ``overrides``.

Paired statistics (``paired=BASELINE``, ``--paired BASELINE``): every other label minus the
baseline, matched by seed, with a bootstrap interval, a paired t-test and Holm's correction
(:mod:`fedlora.app.paired`), written to ``paired.csv`` and appended to ``summary.md``; in Python
``table.paired("fedit")``. Numeric entries of a round's ``extra`` (the methods' mechanisms) get
their final values as ``extra.<key>`` columns in ``summary.csv``.
"""

from __future__ import annotations

import html
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fedlora.app.paired import PAIRED_METRICS, RESAMPLES, Pair, PairedTable, PairingError, paired_comparisons
from fedlora.app.runs import (  # noqa: F401 - re-exported: the reading half of the comparison API
    EXTRA_PREFIX,
    SEED_DIR_PREFIX,
    final_extra,
    load_runs,
    number,
    numeric_extra,
    result_dirs,
    train_seed,
)

if TYPE_CHECKING:
    from fedlora.app.folders import Claim
    from fedlora.config import ExperimentConfig

logger = logging.getLogger("fedlora")

Engine = Literal["ray", "inprocess"]
ENGINES: tuple[str, ...] = ("ray", "inprocess")


@dataclass(frozen=True)
class Job:
    """One run of a comparison: ``strategy`` with ``train.seed = seed`` and extra overrides.

    ``label`` names the run's folder and table row (default: the strategy name); give two jobs
    of one strategy different labels to compare settings (e.g. a tuning grid).
    """

    strategy: str
    seed: int = 0
    overrides: tuple[str, ...] = ()
    label: str = ""
    fresh_partition: bool = False  # data.seed = the config's data.seed + seed (else the config's)

    @property
    def name(self) -> str:
        return self.label or self.strategy

    def run_dir(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / self.name / f"{SEED_DIR_PREFIX}{self.seed}"


# --------------------------------------------------------------------------- columns
@dataclass(frozen=True)
class Column:
    """A summary column: where its value comes from in results.json, and what it means."""

    key: str  # column name in summary.csv
    header: str  # short header in summary.md
    meaning: str  # the legend line (every table says which average is which)
    scale: float = 1.0  # display scale (bytes -> MB)
    digits: int = 4


COLUMNS: tuple[Column, ...] = (
    Column("global_accuracy", "global acc", "final round: the strategy's global model on the held-out global test set "
           "(methods without a global model: example-weighted mean of the client models on it)"),
    Column("personalized_accuracy", "pers. acc (weighted)", "final round: each client's own model on its local test "
           "split, mean weighted by the clients' test examples"),
    Column("personalized_accuracy_unweighted", "pers. acc (unweighted)", "final round: same, plain mean over clients"),
    Column("received_accuracy", "received acc", "final round: each sampled client's model as received (the "
           "download before local training; FedHera's official metric) on its local test split, example-weighted"),
    Column("personalized_accuracy_worst", "pers. worst", "final round: lowest client's personalised accuracy"),
    Column("personalized_accuracy_p10", "pers. p10", "final round: 10th percentile of the clients' personalised accuracy"),
    Column("best_round", "best round (val)", "round with the highest validation accuracy (client validation splits; "
           "the test sets are never used for selection)", digits=1),
    Column("best_global_accuracy", "global acc @best", "global accuracy at the best-on-validation round"),
    Column("best_personalized_accuracy", "pers. acc (weighted) @best", "weighted personalised accuracy at the "
           "best-on-validation round"),
    Column("bytes_up_per_round", "MB up/round", "training uploads per round, all clients (exact array bytes)",
           scale=1e-6, digits=3),
    Column("bytes_down_per_round", "MB down/round", "training downloads per round, all clients", scale=1e-6, digits=3),
    Column("bytes_total", "MB total", "uploads + downloads over all rounds (array bytes)", scale=1e-6, digits=3),
    Column("wire_bytes_total", "wire MB total", "every training message and reply as Flower serialises it "
           "(config, metadata and rejected uploads included), all rounds", scale=1e-6, digits=3),
    Column("client_train_seconds", "client train s", "local training seconds summed over clients and rounds "
           "(CPU or GPU wall time of the clients' training loops)", digits=2),
    Column("aggregation_seconds", "server agg s", "server aggregation seconds summed over rounds", digits=3),
    Column("wall_seconds", "wall s", "wall time of the whole run (engine start excluded)", digits=1),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
# The terminal's table (ComparisonTable.to_text): these columns, in this order of priority, as many
# as fit the width; the files (summary.md / .csv) keep every column.
TERMINAL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("global_accuracy", "global"),
    ("personalized_accuracy", "pers. (weighted)"),
    ("received_accuracy", "received"),
    ("bytes_total", "MB total"),
    ("wall_seconds", "wall s"),
    ("personalized_accuracy_unweighted", "pers. (unweighted)"),
)


def run_row(results: dict[str, Any]) -> dict[str, float]:
    """The summary columns of one results.json (NaN where a value is absent), and the final value
    of every numeric ``extra`` key as ``extra.<key>``."""
    final = results.get("final") or {}
    rounds = results.get("rounds") or []
    count = max(len(rounds), 1)
    row = {key: number(final.get(key)) for key in COLUMN_KEYS}
    row["bytes_up_per_round"] = sum(int(r.get("bytes_up") or 0) for r in rounds) / count
    row["bytes_down_per_round"] = sum(int(r.get("bytes_down") or 0) for r in rounds) / count
    row["bytes_total"] = float(sum(int(r.get("bytes_up") or 0) + int(r.get("bytes_down") or 0) for r in rounds))
    row["wire_bytes_total"] = float(sum(int(r.get("wire_bytes_up") or 0) + int(r.get("wire_bytes_down") or 0)
                                        for r in rounds))
    row["client_train_seconds"] = sum(number(r.get("client_train_seconds")) for r in rounds) if rounds else math.nan
    row["aggregation_seconds"] = sum(number(r.get("aggregation_seconds")) for r in rounds) if rounds else math.nan
    row["wall_seconds"] = number(results.get("wall_seconds"))
    row.update(final_extra(rounds))
    return row


# --------------------------------------------------------------------------- table
class ComparisonTable:
    """Mean +- std over seeds per label (pandas); also holds every run's row (``runs``).

    ``rows``: one dict per label with ``strategy``, ``seeds`` (count) and ``<column>_mean`` /
    ``<column>_std`` for every column of :data:`COLUMNS` and every numeric ``extra.<key>`` any run
    recorded (sample std; 0 for a single seed). Displays itself in notebooks (HTML / markdown) with
    the legend saying which average is which; :meth:`paired` gives the paired statistics.
    """

    def __init__(self, runs: list[dict[str, Any]], out_dir: str | Path | None = None, scale: str = "") -> None:
        import pandas as pd

        self.runs = runs  # strategy, seed, data_seed, path, + COLUMN_KEYS + extra.<key>
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.scale = scale  # one line describing the experiment scale (clients, rounds, model...)
        self.extra_keys = sorted({key for run in runs for key in run if key.startswith(EXTRA_PREFIX)})
        keys = [*COLUMN_KEYS, *self.extra_keys]
        frame = pd.DataFrame(runs, columns=["strategy", *keys]).astype({k: float for k in keys})
        grouped = frame.groupby("strategy", sort=False)[keys]
        mean, std, count = grouped.mean(), grouped.std(ddof=1), grouped.count()
        std = std.mask(std.isna() & (count == 1), 0.0)  # one seed: no spread
        summary = pd.concat([mean.add_suffix("_mean"), std.add_suffix("_std")], axis=1)
        summary.insert(0, "seeds", frame.groupby("strategy", sort=False).size())
        ordered = ["seeds", *(f"{k}_{s}" for k in keys for s in ("mean", "std"))]
        self.frame = summary[ordered].reset_index()
        self.rows: list[dict[str, Any]] = self.frame.to_dict("records")
        data_seeds: dict[str, set[Any]] = {}
        for run in runs:
            data_seeds.setdefault(run["strategy"], set()).add(run.get("data_seed"))
        self.fresh_partitions = any(len(seeds) > 1 for seeds in data_seeds.values())
        self.paired_table: PairedTable | None = None  # set by compare(paired=...)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, label: str) -> dict[str, Any]:
        for row in self.rows:
            if row["strategy"] == label:
                return row
        raise KeyError(label)

    @property
    def strategies(self) -> list[str]:
        return [row["strategy"] for row in self.rows]

    def paired(
        self,
        baseline: str,
        primary: str | None = None,
        primary_metric: str = "personalized_accuracy",
        metrics: Sequence[str] = PAIRED_METRICS,
        resamples: int = RESAMPLES,
    ) -> PairedTable:
        """Every other label minus ``baseline``, runs matched by seed (:mod:`fedlora.app.paired`).

        ``primary``: the label of the declared primary comparison (``primary`` - ``baseline`` on
        ``primary_metric``), reported uncorrected and left out of the Holm family. Raises
        :class:`~fedlora.app.paired.PairingError` (a ConfigError) for an unknown baseline or
        primary, or when a label's seeds are not the baseline's.
        """
        if baseline not in self.strategies:
            raise PairingError(f"--paired: baseline {baseline!r} is not among the compared labels "
                               f"({', '.join(self.strategies)})")
        if primary is not None and (primary not in self.strategies or primary == baseline):
            raise PairingError(f"--primary: {primary!r} must be one of the other compared labels "
                               f"({', '.join(s for s in self.strategies if s != baseline)})")
        pairs = [Pair(label, baseline) for label in self.strategies if label != baseline]
        return paired_comparisons(self.runs, pairs, (primary, baseline) if primary else None, primary_metric,
                                  metrics, resamples)

    # ------------------------------------------------------------------ rendering
    @staticmethod
    def _cell(row: dict[str, Any], column: Column) -> str:
        mean, std = row[f"{column.key}_mean"], row[f"{column.key}_std"]
        if not math.isfinite(mean):
            return "n/a"
        text = f"{mean * column.scale:.{column.digits}f}"
        if row["seeds"] > 1 and math.isfinite(std):
            text += f" ± {std * column.scale:.{column.digits}f}"
        return text

    def display(self):  # -> pandas.DataFrame
        """The table as shown: one string cell per column, headers as in the legend."""
        import pandas as pd

        return pd.DataFrame(
            [[row["strategy"], str(row["seeds"]), *(self._cell(row, c) for c in COLUMNS)] for row in self.rows],
            columns=["strategy", "seeds", *(c.header for c in COLUMNS)],
        )

    def legend(self) -> list[str]:
        seeds = ("seeds change train.seed and data.seed: a fresh partition per seed, shared by every label of "
                 "that seed" if self.fresh_partitions else "seeds change train.seed only, the partitions are identical")
        lines = [f"Values are mean ± std over seeds (sample std; {seeds})."]
        lines += [f"{c.header}: {c.meaning}." for c in COLUMNS]
        return lines

    def mechanisms(self):  # -> pandas.DataFrame
        """Final value of every numeric ``extra`` key (rows) per label (columns), mean over seeds;
        empty cells: the label does not record the key."""
        import pandas as pd

        cells = []
        for key in self.extra_keys:
            row = [key.removeprefix(EXTRA_PREFIX)]
            for label_row in self.rows:
                value = label_row[f"{key}_mean"]
                row.append(f"{value:.4g}" if math.isfinite(value) else "")
            cells.append(row)
        return pd.DataFrame(cells, columns=["extra key (final round)", *self.strategies])

    def to_markdown(self) -> str:
        out = [f"Scale: {self.scale}", ""] if self.scale else []
        out.append(self.display().to_markdown(index=False, tablefmt="pipe", disable_numparse=True))
        out += ["", *(f"- {line}" for line in self.legend())]
        if self.extra_keys:
            out += ["", ("Mechanisms: the last recorded value of each numeric `extra` entry of the rounds, mean over "
                         "seeds (`extra.<key>_mean` / `_std` in summary.csv):"), "",
                    self.mechanisms().to_markdown(index=False, tablefmt="pipe", disable_numparse=True)]
        return "\n".join(out) + "\n"

    def to_text(self, width: int = 100) -> str:
        """The table for a terminal of ``width`` columns: the :data:`TERMINAL_COLUMNS` that fit,
        their legend and the scale wrapped to ``width`` (``to_markdown`` and the files are wide)."""
        import textwrap

        by_key = {c.key: c for c in COLUMNS}
        seeds = sorted({int(row["seeds"]) for row in self.rows})
        shown = list(TERMINAL_COLUMNS)
        while True:
            frame = [[row["strategy"], *(self._cell(row, by_key[key]) for key, _ in shown)] for row in self.rows]
            table = _pipe_table(["strategy", *(header for _, header in shown)], frame)
            if len(shown) == 1 or max(len(line) for line in table.splitlines()) <= width:
                break
            shown.pop()
        average = "mean ± std over" if seeds[-1:] != [1] else "one run per strategy,"
        notes = [f"{average} {'/'.join(map(str, seeds))} seed(s); the partitions are identical."]
        notes += [f"{header}: {by_key[key].meaning}." for key, header in shown]
        wrap = textwrap.TextWrapper(width=width, subsequent_indent="  ")
        lines = wrap.wrap(f"Scale: {self.scale}") if self.scale else []
        lines += [table, *(line for note in notes for line in wrap.wrap(f"- {note}"))]
        return "\n".join(lines) + "\n"

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def _repr_html_(self) -> str:
        scale = f"<p>Scale: {html.escape(self.scale)}</p>" if self.scale else ""
        legend = "".join(f"<li>{html.escape(line)}</li>" for line in self.legend())
        mechanisms = self.mechanisms().to_html(index=False) if self.extra_keys else ""
        return f"{scale}{self.display().to_html(index=False)}<ul>{legend}</ul>{mechanisms}"

    def __repr__(self) -> str:
        return self.to_markdown()

    def to_csv(self, path: str | Path | None = None) -> str:
        """Mean / std columns per label as CSV (returned, and written to ``path`` if given)."""
        text = self.frame.to_csv(index=False, lineterminator="\n", na_rep="")
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_pandas(self):  # -> pandas.DataFrame
        """The summary rows as a pandas DataFrame."""
        return self.frame.copy()

    def write(self, out_dir: str | Path | None = None) -> tuple[Path, Path]:
        """Write ``summary.csv`` and ``summary.md`` into ``out_dir`` (default: where it was read)."""
        folder = Path(out_dir or self.out_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        self.to_csv(folder / "summary.csv")
        (folder / "summary.md").write_text(self.to_markdown())
        return folder / "summary.csv", folder / "summary.md"


def _pipe_table(headers: list[str], rows: list[list[str]]) -> str:
    import tabulate

    return str(tabulate.tabulate(rows, headers=headers, tablefmt="pipe", disable_numparse=True))


def scale_line(results: dict[str, Any], fresh_partitions: bool = False) -> str:
    """The experiment's scale, from a resolved config (so a README table can say it)."""
    cfg = results.get("config") or {}
    model, data, train = cfg.get("model", {}), cfg.get("data", {}), cfg.get("train", {})
    data_seed = "a fresh data.seed per seed" if fresh_partitions else f"data.seed {data.get('seed')}"
    return (
        f"model {model.get('path')}, data {data.get('source')}/{data.get('task')} "
        f"(max_examples {data.get('max_examples')}, {data.get('partition')} alpha {data.get('dirichlet_alpha')}, "
        f"{data_seed}), {data.get('num_clients')} clients, {train.get('rounds')} rounds, "
        f"{train.get('local_epochs')} local epoch(s) capped at {train.get('max_steps')} steps, batch "
        f"{train.get('batch_size')}, max_length {train.get('max_length')}, lr {train.get('lr')}"
    )


def summarize(
    out_dir: str | Path,
    labels: Sequence[str] | None = None,
    write: bool = True,
    seeds: Iterable[int] | None = None,
    rename: dict[str, str] | None = None,
) -> ComparisonTable:
    """Summarise every ``OUT/<label>/seed<k>/results.json`` into a :class:`ComparisonTable`.

    ``labels`` picks and orders the rows (default: every label found, alphabetically), ``seeds``
    keeps those ``train.seed`` values only, ``rename`` shows a folder under another row name (e.g.
    a tuned point's folder ``fedit[train.lr=6e-3]`` as ``fedit``); with ``write`` the table is
    saved as ``OUT/summary.csv`` and ``OUT/summary.md``.
    """
    runs = load_runs(out_dir, labels, seeds)
    rename = rename or {}
    rows = []
    for label, results_list in runs.items():
        for results in results_list:
            data_seed = ((results.get("config") or {}).get("data") or {}).get("seed")
            rows.append({"strategy": rename.get(label, label), "seed": train_seed(results),
                         "data_seed": data_seed, "path": results["_seed_dir"], **run_row(results)})
    first = next(iter(runs.values()), [{}])[0]
    fresh = len({row["data_seed"] for row in rows}) > 1
    table = ComparisonTable(rows, out_dir, scale=scale_line(first, fresh) if first else "")
    if write:
        table.write(out_dir)
    return table


# --------------------------------------------------------------------------- running
def check_output_folder(out: Path) -> None:
    from fedlora.app.runner import check_output_folder as check

    check(out)


def claim_output(out: Path, what: str, resume: bool, overwrite: bool) -> Claim:
    """The comparison (or tuning) folder ``out``, checked (fedlora.app.folders): an earlier one is
    refused unless ``resume`` (continue it) or ``overwrite`` (moved aside when the runs start)."""
    from fedlora.app.folders import claim

    return claim(out, what=what, resume=resume, overwrite=overwrite)


def resolve_base(config: ExperimentConfig | str | Path | dict, overrides: Sequence[str] = ()) -> ExperimentConfig:
    from fedlora.app.runner import resolve

    return resolve(config, list(overrides))


def job_config(base: ExperimentConfig, job: Job, run_dir: Path) -> ExperimentConfig:
    """The resolved config of one job (raises ConfigError for a bad strategy or override)."""
    from fedlora.config import apply_overrides, build_config
    from fedlora.methods import method

    declared = set(method(job.strategy).options.model_fields)  # ConfigError listing the known names
    raw = base.model_dump(mode="json")
    raw["strategy"] = {k: v for k, v in raw["strategy"].items() if k in declared} | {"name": job.strategy}
    seeds = [f"train.seed={job.seed}"]
    if job.fresh_partition:  # a fresh partition per seed, the same for every label of that seed
        seeds.append(f"data.seed={base.data.seed + job.seed}")
    raw = apply_overrides(raw, [*job.overrides, *seeds])
    raw["output"]["dir"] = str(run_dir)
    # TensorBoard: OUT/tensorboard/<label>/seed<k>, so `tensorboard --logdir OUT/tensorboard`
    # overlays the strategies in each chart (tracking.write_mean_curves adds <label>/mean)
    raw["output"]["tensorboard_dir"] = str(run_dir.parent.parent / "tensorboard" / job.name / run_dir.name)
    raw["output"]["mlflow_run_name"] = raw["output"].get("mlflow_run_name") or f"{job.name} seed{job.seed}"
    return build_config(raw)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "output"}


def is_complete(run_dir: Path, config: ExperimentConfig) -> bool:
    """True when ``run_dir/results.json`` holds every round of this exact config."""
    path = run_dir / "results.json"
    if not path.is_file():
        return False
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if _comparable(results.get("config") or {}) != _comparable(config.model_dump(mode="json")):
        logger.warning("compare: %s was produced by a different config; running it again", run_dir)
        return False
    rounds = [r.get("round") for r in results.get("rounds") or [] if r.get("round") != 0]  # 0: causal LM zero-shot
    return rounds == list(range(1, config.train.rounds + 1))


def run_one(config: ExperimentConfig, run_dir: Path, engine: Engine, verbose: bool = False,
            resume: bool = False) -> None:
    """Run one experiment into ``run_dir`` on the chosen engine (``resume``: continue its checkpoint)."""
    if engine == "ray":
        from fedlora.app.runner import run

        run(config, out_dir=None if resume else run_dir, verbose=verbose, resume=run_dir if resume else None)
        return
    from fedlora.app.quiet import LOG_FILE, run_log
    from fedlora.app.runner import RunError, check_inputs, protocol_errors, run_folder, run_inprocess

    check_inputs(config)
    with run_folder(run_dir, fresh=not resume), run_log(run_dir / LOG_FILE):
        try:
            writer = run_inprocess(config, run_dir, resume=resume)
        except protocol_errors() as error:
            raise RunError(f"{run_dir}: {error}") from None
    if not any(r.clients for r in writer.rounds):
        raise RunError(f"{run_dir}: every client update failed in every round")


def check_engine(engine: str) -> None:
    from fedlora.config import ConfigError

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def run_jobs(
    config: ExperimentConfig | str | Path | dict,
    jobs: Iterable[Job],
    out_dir: str | Path,
    engine: Engine = "ray",
    overrides: Sequence[str] = (),
    verbose: bool = False,
    workers: int = 1,
    folder: Claim | None = None,
) -> list[Path]:
    """Run every job into ``OUT/<label>/seed<k>/``; returns the folders. What is there is never lost
    (this is what ``--resume`` does): a complete run (results.json with every round of this exact
    config) is skipped, an interrupted one resumes from its checkpoint, and a run folder that cannot
    be resumed (no usable checkpoint, another config) is moved aside (``seed<k>.old-<time>``, with
    its TensorBoard folder) and run again.

    Every job's config is built and validated, and its inputs checked (model, data, limits),
    before the first run starts (and before ``folder``, the claimed output folder, moves an
    earlier comparison aside), so a bad strategy name, override or data file fails at once. ``workers > 1`` runs that many jobs at a time, each in its own
    process (in-process engine only: each Ray run starts its own cluster); on a CUDA machine the
    workers share the GPU. A worker's log goes to ``<run dir>/run.log``.
    """
    check_engine(engine)
    if workers < 1:
        from fedlora.config import ConfigError

        raise ConfigError(f"workers must be >= 1, got {workers}")
    if workers > 1 and engine != "inprocess":
        from fedlora.config import ConfigError

        raise ConfigError("parallel workers need the in-process engine (--engine inprocess); Ray already "
                          "runs the clients of one experiment in parallel")
    from fedlora.app.quiet import output
    from fedlora.app.runner import check_inputs

    with output(verbose):  # the checks build models too: their load reports stay in the logs
        base = resolve_base(config, overrides)
        out = Path(out_dir)
        planned = [(job, job.run_dir(out)) for job in jobs]
        configs = [job_config(base, job, run_dir) for job, run_dir in planned]
        for cfg in configs:
            check_inputs(cfg)
        if folder is not None:
            folder.take()
        todo = []
        for index, ((job, run_dir), cfg) in enumerate(zip(planned, configs, strict=True), start=1):
            if is_complete(run_dir, cfg):
                logger.info("compare: [%d/%d] %s seed %d: complete, skipped", index, len(planned), job.name, job.seed)
            else:
                todo.append((index, job, run_dir, cfg, resumable(run_dir, cfg)))
        if workers == 1:
            for index, job, run_dir, cfg, resume in todo:
                logger.info("compare: [%d/%d] %s seed %d -> %s (%s%s)", index, len(planned), job.name, job.seed,
                            run_dir, engine, ", resumed" if resume else "")
                started = time.perf_counter()
                run_one(cfg, run_dir, engine, verbose, resume)
                logger.info("compare: %s seed %d done in %.1fs", job.name, job.seed, time.perf_counter() - started)
        else:
            _run_parallel(todo, len(planned), workers)
    return [run_dir for _, run_dir in planned]


def resumable(run_dir: Path, config: ExperimentConfig) -> bool:
    """Whether the incomplete run in ``run_dir`` continues from its checkpoint (True) or starts
    afresh (False); a folder holding anything that cannot be resumed is moved aside first."""
    from fedlora.app.folders import holds_something, move_aside
    from fedlora.checkpoint import load_server
    from fedlora.config import ConfigError
    from strategies.registry import strategy_class

    if not holds_something(run_dir):
        return False
    try:
        strategy_class(config.strategy.name)  # its state types decode
        load_server(run_dir, config)
        return True
    except ConfigError as error:
        logger.warning("compare: %s cannot be resumed (%s)", run_dir, error)
    move_aside(run_dir, "run", "compare")
    tensorboard = Path(config.output.tensorboard_dir)
    if config.output.tensorboard_dir and holds_something(tensorboard):
        move_aside(tensorboard, "run's TensorBoard events", "compare")
    return False


def _run_parallel(todo: list[tuple[int, Job, Path, ExperimentConfig, bool]], total: int, workers: int) -> None:
    """``todo`` on a pool of ``workers`` fresh processes (spawned: no inherited torch or Ray state)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from fedlora.app.runner import RunError

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {}
        for index, job, run_dir, cfg, resume in todo:
            logger.info("compare: [%d/%d] %s seed %d -> %s (worker%s)", index, total, job.name, job.seed, run_dir,
                        ", resumed" if resume else "")
            futures[pool.submit(_worker_run, cfg.to_json(), str(run_dir), resume)] = job
        failed = []
        for future in as_completed(futures):
            job = futures[future]
            error = future.exception()
            if error is not None:
                failed.append(f"{job.name} seed {job.seed}: {error}")
                logger.warning("compare: %s seed %d failed: %s", job.name, job.seed, error)
            else:
                logger.info("compare: %s seed %d done in %.1fs", job.name, job.seed, future.result())
    if failed:
        raise RunError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")


def _worker_run(config_json: str, run_dir: str, resume: bool = False) -> float:
    """One job in a worker process: the in-process engine, its log in ``run_dir/run.log``
    (appended to when the job resumes)."""
    from fedlora.app import progress
    from fedlora.app.quiet import output
    from fedlora.config import config_from_json

    progress.LIVE = False  # workers share the terminal: plain lines, into run.log (run_one writes it)
    started = time.perf_counter()
    with output(console=False):  # a worker runs several jobs: each log only in its own run.log
        run_one(config_from_json(config_json), Path(run_dir), "inprocess", resume=resume)
    return time.perf_counter() - started


def default_out_dir(base: ExperimentConfig) -> Path:
    return Path(base.output.dir) / "compare"


def compare(
    config: ExperimentConfig | str | Path | dict,
    strategies: Sequence[str],
    seeds: Sequence[int] = (0,),
    out_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    engine: Engine = "ray",
    plots: bool = True,
    verbose: bool = False,
    workers: int = 1,
    fresh_partitions: bool = False,
    paired: str | None = None,
    primary: str | None = None,
    primary_metric: str = "personalized_accuracy",
    resume: bool = False,
    overwrite: bool = False,
    strategy_overrides: dict[str, Sequence[str]] | None = None,
) -> ComparisonTable:
    """Run every strategy x seed, then summarise and plot.

    Parameters
    ----------
    config : ExperimentConfig, TOML path or dict
        The base experiment; ``overrides`` (``section.key=value``) apply to every run.
    strategies : sequence of str
        Registered strategy names; a run folder is ``OUT/<strategy>/seed<k>/``.
    seeds : sequence of int, default (0,)
        Values of ``train.seed``; ``data.seed`` stays the config's (identical partitions) unless
        ``fresh_partitions``.
    out_dir : path, optional
        Comparison folder (default ``<output.dir>/compare``); gets ``summary.csv``,
        ``summary.md`` and the PNG plots.
    engine : {"ray", "inprocess"}, default "ray"
        ``ray``: Flower's simulation engine (:func:`fedlora.app.runner.run`); ``inprocess``: the same
        ServerApp / ClientApp code without Ray (:func:`fedlora.app.runner.run_inprocess`).
    workers : int, default 1
        Runs at a time, each in its own process (in-process engine only; they share a GPU).
    fresh_partitions : bool, default False
        Every seed a fresh partition: ``data.seed = <config's data.seed> + seed`` (all strategies
        of one seed share it, so the paired differences stay paired).
    paired : str, optional
        Baseline of the paired statistics (:meth:`ComparisonTable.paired`): ``paired.csv`` and a
        section of ``summary.md``. Must be one of ``strategies``.
    primary, primary_metric : str, optional
        The declared primary comparison (``primary`` - ``paired`` on ``primary_metric``): reported
        uncorrected, outside the Holm family.
    strategy_overrides : dict, optional
        Strategy name -> overrides for that strategy's runs only (e.g. its own options:
        ``{"fedtreelora": ["strategy.warmup_rounds=1"]}``), applied after ``overrides``.

    resume : bool, default False
        Continue the comparison in ``out_dir`` (:func:`run_jobs`): runs whose results.json holds
        every round of the same config are not run again, interrupted ones resume from their
        checkpoint. Without it, an ``out_dir`` that holds an earlier comparison is refused.
    overwrite : bool, default False
        Move an earlier comparison in ``out_dir`` aside (``OUT.old-<time>``; nothing is deleted)
        and start afresh.
    """
    from fedlora.config import ConfigError

    check_engine(engine)
    if not strategies:
        raise ConfigError("compare needs at least one strategy, e.g. --strategies fedit,flexlora")
    check_paired(strategies, paired, primary, primary_metric)
    base = resolve_base(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(base)
    folder = claim_output(out, "comparison", resume, overwrite)
    own = strategy_overrides or {}
    jobs = [Job(strategy, int(seed), tuple(own.get(strategy, ())), fresh_partition=fresh_partitions)
            for strategy in strategies for seed in seeds]
    run_jobs(base, jobs, out, engine=engine, verbose=verbose, workers=workers, folder=folder)
    labels = list(dict.fromkeys(strategies))
    table = summarize(out, labels=labels, seeds=[int(s) for s in seeds])
    if paired is not None:
        comparison = table.paired(paired, primary=primary, primary_metric=primary_metric)
        comparison.write(out)
        with (out / "summary.md").open("a") as summary:
            summary.write("\n" + comparison.to_markdown())
        table.paired_table = comparison
    if base.output.tensorboard:
        from fedlora.app.tracking import write_mean_curves

        write_mean_curves(out / "tensorboard", load_runs(out, table.strategies, seeds))
    if plots:
        from fedlora.app.plotting import plot_comparison, plot_mechanisms

        runs = load_runs(out, table.strategies, seeds)
        plot_comparison(out, runs, base.data)
        plot_mechanisms(out, runs)
    return table


def check_paired(strategies: Sequence[str], paired: str | None, primary: str | None, primary_metric: str) -> None:
    """Refuse, before anything runs, a paired baseline or primary that is not among the labels."""
    from fedlora.app.paired import METRIC_NAMES

    if paired is None:
        if primary is not None:
            raise PairingError("--primary needs --paired BASELINE (the primary comparison is PRIMARY - BASELINE)")
        return
    if paired not in strategies:
        raise PairingError(f"--paired: baseline {paired!r} is not among the strategies ({', '.join(strategies)})")
    if primary is not None and (primary not in strategies or primary == paired):
        raise PairingError(f"--primary: {primary!r} must be one of the other strategies "
                           f"({', '.join(s for s in strategies if s != paired)})")
    if primary_metric not in METRIC_NAMES:
        raise PairingError(f"--primary-metric: unknown metric {primary_metric!r}; known: {', '.join(METRIC_NAMES)}")
