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

Same partitions: a job's seed overrides ``train.seed`` (LoRA init, batch order, client
sampling) only; ``data.seed`` stays the config's, so every strategy and every seed trains on
identical client partitions, validation / test splits and global test set. Strategy options in
the base config's ``[strategy]`` section are kept for a strategy only when its options model
declares them; per-strategy options go into a job's ``overrides``.
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

if TYPE_CHECKING:
    from fedlora.config import ExperimentConfig

logger = logging.getLogger("fedlora")

Engine = Literal["ray", "inprocess"]
ENGINES: tuple[str, ...] = ("ray", "inprocess")
SEED_DIR_PREFIX = "seed"


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


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def run_row(results: dict[str, Any]) -> dict[str, float]:
    """The summary columns of one results.json (NaN where a value is absent)."""
    final = results.get("final") or {}
    rounds = results.get("rounds") or []
    count = max(len(rounds), 1)
    row = {key: _number(final.get(key)) for key in COLUMN_KEYS}
    row["bytes_up_per_round"] = sum(int(r.get("bytes_up") or 0) for r in rounds) / count
    row["bytes_down_per_round"] = sum(int(r.get("bytes_down") or 0) for r in rounds) / count
    row["bytes_total"] = float(sum(int(r.get("bytes_up") or 0) + int(r.get("bytes_down") or 0) for r in rounds))
    row["wire_bytes_total"] = float(sum(int(r.get("wire_bytes_up") or 0) + int(r.get("wire_bytes_down") or 0)
                                        for r in rounds))
    row["client_train_seconds"] = sum(_number(r.get("client_train_seconds")) for r in rounds) if rounds else math.nan
    row["aggregation_seconds"] = sum(_number(r.get("aggregation_seconds")) for r in rounds) if rounds else math.nan
    row["wall_seconds"] = _number(results.get("wall_seconds"))
    return row


# --------------------------------------------------------------------------- table
class ComparisonTable:
    """Mean +- std over seeds per label (pandas); also holds every run's row (``runs``).

    ``rows``: one dict per label with ``strategy``, ``seeds`` (count) and ``<column>_mean`` /
    ``<column>_std`` for every column of :data:`COLUMNS` (sample std; 0 for a single seed).
    Displays itself in notebooks (HTML / markdown) with the legend saying which average is which.
    """

    def __init__(self, runs: list[dict[str, Any]], out_dir: str | Path | None = None, scale: str = "") -> None:
        import pandas as pd

        self.runs = runs  # strategy, seed, path, + COLUMN_KEYS
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.scale = scale  # one line describing the experiment scale (clients, rounds, model...)
        frame = pd.DataFrame(runs, columns=["strategy", *COLUMN_KEYS]).astype({k: float for k in COLUMN_KEYS})
        grouped = frame.groupby("strategy", sort=False)[list(COLUMN_KEYS)]
        mean, std, count = grouped.mean(), grouped.std(ddof=1), grouped.count()
        std = std.mask(std.isna() & (count == 1), 0.0)  # one seed: no spread
        summary = pd.concat([mean.add_suffix("_mean"), std.add_suffix("_std")], axis=1)
        summary.insert(0, "seeds", frame.groupby("strategy", sort=False).size())
        ordered = ["seeds", *(f"{k}_{s}" for k in COLUMN_KEYS for s in ("mean", "std"))]
        self.frame = summary[ordered].reset_index()
        self.rows: list[dict[str, Any]] = self.frame.to_dict("records")

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
        lines = [("Values are mean ± std over seeds (sample std; seeds change train.seed only, the partitions "
                  "are identical).")]
        lines += [f"{c.header}: {c.meaning}." for c in COLUMNS]
        return lines

    def to_markdown(self) -> str:
        out = [f"Scale: {self.scale}", ""] if self.scale else []
        out.append(self.display().to_markdown(index=False, tablefmt="pipe", disable_numparse=True))
        out += ["", *(f"- {line}" for line in self.legend())]
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
        return f"{scale}{self.display().to_html(index=False)}<ul>{legend}</ul>"

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


# --------------------------------------------------------------------------- reading results
def result_dirs(out_dir: str | Path) -> list[Path]:
    """Every ``OUT/<label>/seed<k>`` folder holding a results.json, in label then seed order."""
    found = [p.parent for p in Path(out_dir).glob(f"*/{SEED_DIR_PREFIX}*/results.json")]

    def seed_of(path: Path) -> int:
        suffix = path.name[len(SEED_DIR_PREFIX):]
        return int(suffix) if suffix.lstrip("-").isdigit() else 0

    return sorted(found, key=lambda p: (p.parent.name, seed_of(p)))


def load_runs(out_dir: str | Path, labels: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Label -> the results dicts of its finished seeds (``labels`` picks and orders them).

    A run still in progress (or interrupted) has a results.json with fewer rounds than its config
    asks for; it is left out, so a summary never mixes partial and final numbers.
    """
    from fedlora.results import load_results

    runs: dict[str, list[dict[str, Any]]] = {}
    for folder in result_dirs(out_dir):
        results = load_results(folder)
        planned = ((results.get("config") or {}).get("train") or {}).get("rounds")
        done = [r.get("round") for r in results.get("rounds") or []]
        if planned is not None and done != list(range(1, planned + 1)):
            logger.info("compare: %s has %d of %d rounds, not summarised", folder, len(done), planned)
            continue
        results["_seed_dir"] = folder.name
        runs.setdefault(folder.parent.name, []).append(results)
    if labels is not None:
        runs = {label: runs[label] for label in labels if label in runs}
    return runs


def scale_line(results: dict[str, Any]) -> str:
    """The experiment's scale, from a resolved config (so a README table can say it)."""
    cfg = results.get("config") or {}
    model, data, train = cfg.get("model", {}), cfg.get("data", {}), cfg.get("train", {})
    return (
        f"model {model.get('path')}, data {data.get('source')}/{data.get('task')} "
        f"(max_examples {data.get('max_examples')}, {data.get('partition')} alpha {data.get('dirichlet_alpha')}, "
        f"data.seed {data.get('seed')}), {data.get('num_clients')} clients, {train.get('rounds')} rounds, "
        f"{train.get('local_epochs')} local epoch(s) capped at {train.get('max_steps')} steps, batch "
        f"{train.get('batch_size')}, max_length {train.get('max_length')}, lr {train.get('lr')}"
    )


def summarize(out_dir: str | Path, labels: Sequence[str] | None = None, write: bool = True) -> ComparisonTable:
    """Summarise every ``OUT/<label>/seed<k>/results.json`` into a :class:`ComparisonTable`.

    ``labels`` picks and orders the rows (default: every label found, alphabetically); with
    ``write`` the table is saved as ``OUT/summary.csv`` and ``OUT/summary.md``.
    """
    runs = load_runs(out_dir, labels)
    rows = []
    for label, results_list in runs.items():
        for results in results_list:
            seed = (results.get("config") or {}).get("train", {}).get("seed", 0)
            rows.append({"strategy": label, "seed": seed, "path": results["_seed_dir"], **run_row(results)})
    first = next(iter(runs.values()), [{}])[0]
    table = ComparisonTable(rows, out_dir, scale=scale_line(first) if first else "")
    if write:
        table.write(out_dir)
    return table


# --------------------------------------------------------------------------- running
def check_output_folder(out: Path) -> None:
    from fedlora.app.runner import check_output_folder as check

    check(out)


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
    raw = apply_overrides(raw, [*job.overrides, f"train.seed={job.seed}"])
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
    rounds = [r.get("round") for r in results.get("rounds") or []]
    return rounds == list(range(1, config.train.rounds + 1))


def run_one(config: ExperimentConfig, run_dir: Path, engine: Engine, verbose: bool = False) -> None:
    """Run one experiment into ``run_dir`` on the chosen engine."""
    if engine == "ray":
        from fedlora.app.runner import run

        run(config, out_dir=run_dir, verbose=verbose)
        return
    from fedlora.app.quiet import LOG_FILE, run_log
    from fedlora.app.runner import RunError, check_inputs, protocol_errors, run_folder, run_inprocess

    check_inputs(config)
    with run_folder(run_dir), run_log(run_dir / LOG_FILE):
        try:
            writer = run_inprocess(config, run_dir)
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
) -> list[Path]:
    """Run every job into ``OUT/<label>/seed<k>/`` (complete runs are skipped); returns the folders.

    Every job's config is built and validated before the first run starts, so a bad strategy
    name or override fails at once. ``workers > 1`` runs that many jobs at a time, each in its own
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
    base = resolve_base(config, overrides)
    out = Path(out_dir)
    planned = [(job, job.run_dir(out)) for job in jobs]
    configs = [job_config(base, job, run_dir) for job, run_dir in planned]
    todo = []
    for index, ((job, run_dir), cfg) in enumerate(zip(planned, configs, strict=True), start=1):
        if is_complete(run_dir, cfg):
            logger.info("compare: [%d/%d] %s seed %d: complete, skipped", index, len(planned), job.name, job.seed)
        else:
            todo.append((index, job, run_dir, cfg))
    from fedlora.app.quiet import output

    with output(verbose):
        if workers == 1:
            for index, job, run_dir, cfg in todo:
                logger.info("compare: [%d/%d] %s seed %d -> %s (%s)", index, len(planned), job.name, job.seed, run_dir,
                            engine)
                started = time.perf_counter()
                run_one(cfg, run_dir, engine, verbose)
                logger.info("compare: %s seed %d done in %.1fs", job.name, job.seed, time.perf_counter() - started)
        else:
            _run_parallel(todo, len(planned), workers)
    return [run_dir for _, run_dir in planned]


def _run_parallel(todo: list[tuple[int, Job, Path, ExperimentConfig]], total: int, workers: int) -> None:
    """``todo`` on a pool of ``workers`` fresh processes (spawned: no inherited torch or Ray state)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from fedlora.app.runner import RunError

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {}
        for index, job, run_dir, cfg in todo:
            logger.info("compare: [%d/%d] %s seed %d -> %s (worker)", index, total, job.name, job.seed, run_dir)
            futures[pool.submit(_worker_run, cfg.to_json(), str(run_dir))] = job
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


def _worker_run(config_json: str, run_dir: str) -> float:
    """One job in a worker process: the in-process engine, its log in ``run_dir/run.log``."""
    from fedlora.app import progress
    from fedlora.app.quiet import output
    from fedlora.config import config_from_json

    progress.LIVE = False  # workers share the terminal: plain lines, into run.log (run_one writes it)
    started = time.perf_counter()
    with output(console=False):  # a worker runs several jobs: each log only in its own run.log
        run_one(config_from_json(config_json), Path(run_dir), "inprocess")
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
    strategy_overrides: dict[str, Sequence[str]] | None = None,
) -> ComparisonTable:
    """Run every strategy x seed on the same partitions, then summarise and plot.

    Parameters
    ----------
    config : ExperimentConfig, TOML path or dict
        The base experiment; ``overrides`` (``section.key=value``) apply to every run.
    strategies : sequence of str
        Registered strategy names; a run folder is ``OUT/<strategy>/seed<k>/``.
    seeds : sequence of int, default (0,)
        Values of ``train.seed``; ``data.seed`` stays the config's, so partitions are identical.
    out_dir : path, optional
        Comparison folder (default ``<output.dir>/compare``); gets ``summary.csv``,
        ``summary.md`` and the PNG plots.
    engine : {"ray", "inprocess"}, default "ray"
        ``ray``: Flower's simulation engine (:func:`fedlora.app.runner.run`); ``inprocess``: the same
        ServerApp / ClientApp code without Ray (:func:`fedlora.app.runner.run_inprocess`).
    workers : int, default 1
        Runs at a time, each in its own process (in-process engine only; they share a GPU).
    strategy_overrides : dict, optional
        Strategy name -> overrides for that strategy's runs only (e.g. its own options:
        ``{"fedtreelora": ["strategy.warmup_rounds=1"]}``), applied after ``overrides``.

    Runs whose results.json already holds every round of the same config are not run again.
    """
    from fedlora.config import ConfigError

    check_engine(engine)
    if not strategies:
        raise ConfigError("compare needs at least one strategy, e.g. --strategies fedit,flexlora")
    base = resolve_base(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(base)
    check_output_folder(out)
    own = strategy_overrides or {}
    jobs = [Job(strategy, int(seed), tuple(own.get(strategy, ()))) for strategy in strategies for seed in seeds]
    run_jobs(base, jobs, out, engine=engine, verbose=verbose, workers=workers)
    table = summarize(out, labels=list(dict.fromkeys(strategies)))
    if base.output.tensorboard:
        from fedlora.app.tracking import write_mean_curves

        write_mean_curves(out / "tensorboard", load_runs(out, table.strategies))
    if plots:
        from fedlora.app.plotting import plot_comparison

        plot_comparison(out, load_runs(out, table.strategies), base.data)
    return table
