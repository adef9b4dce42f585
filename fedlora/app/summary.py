"""The reading half of a comparison: results dicts in, tables out (pure; nothing runs here).

:func:`summarize` reads every ``OUT/<label>/seed<k>/results.json`` (:func:`fedlora.app.runs.load_runs`)
and returns a :class:`ComparisonTable`: mean +- std over seeds per label, written as ``summary.csv`` /
``summary.md`` by :meth:`ComparisonTable.write`, shown in notebooks with its legend, and narrowed to a
terminal's width by :meth:`ComparisonTable.to_text`. :func:`run_row` is one run's row: the summary
:data:`COLUMNS` of its results dict and the final value of every numeric ``extra`` entry (the methods'
mechanisms) as ``extra.<key>``. Paired statistics: :meth:`ComparisonTable.paired`
(:mod:`fedlora.app.paired`). The running half is :mod:`fedlora.app.jobs`; ``fedlora compare`` joins
them (:mod:`fedlora.app.compare`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlora.app.paired import PAIRED_METRICS, RESAMPLES, Pair, PairedTable, PairingError, paired_comparisons
from fedlora.app.runs import EXTRA_PREFIX, final_extra, load_runs, number, train_seed

if TYPE_CHECKING:
    from fedlora.results import RunResults


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
           "(methods without a global model, results.json strategy_info.global_accuracy_from = 'clients': the "
           "clients' own report of their models on it, example-weighted; the server cannot check it)"),
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
    Column("cpu_seconds", "CPU s", "CPU time of the server's process over the whole run, every thread (with the "
           "in-process engine the clients' training and evaluation too: the run's cost however loaded the machine "
           "was; absent from records written before it was measured)", digits=1),
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
    row["cpu_seconds"] = number(results.get("cpu_seconds"))
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
        seeds = frame.groupby("strategy", sort=False).size().rename("seeds")
        # one concat (an insert into a frame of a hundred columns fragments it: pandas warns)
        summary = pd.concat([seeds, mean.add_suffix("_mean"), std.add_suffix("_std")], axis=1)
        ordered = ["seeds", *(f"{k}_{s}" for k in keys for s in ("mean", "std"))]
        self.frame = summary[ordered].copy().reset_index()  # copy: one block again before reset_index inserts
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
        partitions = "a fresh partition per seed" if self.fresh_partitions else "the partitions are identical"
        notes = [f"{average} {'/'.join(map(str, seeds))} seed(s); {partitions}."]
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

    def run_results(self) -> list[tuple[str, int, RunResults]]:
        """(strategy, seed, its :class:`~fedlora.results.RunResults`) of every run summarised, read
        from the comparison folder."""
        from fedlora.results import RunResults

        if self.out_dir is None:
            raise ValueError("this table was not read from a comparison folder: no runs to open")
        return [(run["strategy"], int(run["seed"]),
                 RunResults.load(self.out_dir / str(run.get("folder", run["strategy"])) / str(run["path"])))
                for run in self.runs]

    @property
    def per_round(self):  # -> pandas.DataFrame
        """Every run's rounds as one pandas DataFrame: ``strategy``, ``seed``, ``round`` and the
        columns of :attr:`fedlora.results.RunResults.per_round`."""
        return self._stacked("per_round")

    @property
    def per_client(self):  # -> pandas.DataFrame
        """Every run's per-client rows as one pandas DataFrame: ``strategy``, ``seed`` and the
        columns of :attr:`fedlora.results.RunResults.per_client`."""
        return self._stacked("per_client")

    def _stacked(self, table: str):  # -> pandas.DataFrame
        import pandas as pd

        frames = []
        for strategy, seed, results in self.run_results():
            frame = getattr(results, table)
            frame = frame.reset_index() if table == "per_round" else frame
            frames.append(frame.assign(strategy=strategy, seed=seed))
        if not frames:
            return pd.DataFrame()
        stacked = pd.concat(frames, ignore_index=True)
        return stacked[["strategy", "seed", *(c for c in stacked.columns if c not in ("strategy", "seed"))]]

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
            rows.append({"strategy": rename.get(label, label), "seed": train_seed(results), "data_seed": data_seed,
                         "folder": label, "path": results["_seed_dir"], **run_row(results)})
    first = next(iter(runs.values()), [{}])[0]
    fresh = len({row["data_seed"] for row in rows}) > 1
    table = ComparisonTable(rows, out_dir, scale=scale_line(first, fresh) if first else "")
    if write:
        table.write(out_dir)
    return table
