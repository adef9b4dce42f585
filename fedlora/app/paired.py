"""Paired statistics over seeds: label minus baseline, runs matched by seed.

    table = fedlora.compare(config, ["fedit", "flexlora", "fedhera"], seeds=range(5), paired="fedit")
    table.paired("fedit", primary="fedhera", primary_metric="received_accuracy")

Every comparison is ``label - baseline`` on one metric, over the seeds both ran: run ``k`` of the
label is paired with run ``k`` of the baseline (the same ``train.seed``, and the same ``data.seed``:
the same partition), never by position. Per comparison and metric:

- the per-seed differences and their mean;
- a 95 % **percentile bootstrap** confidence interval of the mean difference: the seeds are
  resampled with replacement ``resamples`` times (default 10,000, numpy ``default_rng(0)``, so the
  interval is reproducible), the interval is the 2.5th and 97.5th percentiles of the resampled
  means (numpy's linear interpolation). With 3 to 5 seeds it is a description of the seeds'
  spread, narrower than a t interval; it never reaches beyond the smallest / largest difference.
  One seed has no spread to resample: no interval (NaN, "n/a"), as for the t-test;
- a two-sided **paired t-test** p-value (``scipy.stats.ttest_1samp`` of the differences against 0,
  which is ``scipy.stats.ttest_rel``); n - 1 degrees of freedom. A difference of at most
  :data:`ROUNDING` (1e-6, float rounding of equal runs) counts as 0 in the tests. Where the
  differences have no spread (identical, or equal up to float rounding: sample standard deviation
  at most :data:`NO_SPREAD` times their mean's magnitude, or at most :data:`ROUNDING`) the t
  statistic is infinite or set by rounding
  (p = 0, or p = 1e-32 from 1e-17 of noise), so the p-value is the exact two-sided **sign test**
  instead (``scipy.stats.binomtest`` of the positive differences among the non-zero ones; p = 1
  when all are 0): 5 seeds all of one sign give 0.0625, never 0. The ``test`` column says which;
- the **Holm** (step-down Bonferroni) adjusted p-value over the comparisons of that metric. The one
  declared **primary** comparison (a label and a metric, chosen before the runs) is left out of its
  metric's family and reported uncorrected; every other comparison is in its metric's family.

Each metric is its own family (the comparisons differ by label, not by metric): a reader who wants
one family over metrics and comparisons multiplies further. Differences are in points (accuracy
or ROUGE-L, x 100) in the markdown and in fractions in the CSV.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError

#: Metrics of every paired table (absent ones, e.g. received accuracy of the centralised
#: reference, are left out of that comparison); worst-client accuracy is always one of them.
PAIRED_METRICS: tuple[str, ...] = (
    "personalized_accuracy",
    "personalized_accuracy_worst",
    "global_accuracy",
    "received_accuracy",
)
METRIC_NAMES: dict[str, str] = {
    "personalized_accuracy": "personalised accuracy (example-weighted)",
    "personalized_accuracy_worst": "worst-client personalised accuracy",
    "global_accuracy": "global accuracy",
    "received_accuracy": "received accuracy",
    # causal LMs (model.kind = 'causal_lm'), higher is better as for the accuracies
    "received_token_accuracy": "received next-token accuracy (teacher-forced)",
    "personalized_rouge_l": "personalised ROUGE-L (example-weighted)",
    "personalized_rouge_l_worst": "worst-client personalised ROUGE-L",
    "global_rouge_l": "global ROUGE-L",
}
#: The paired metrics of a causal-LM comparison (the fidelity benchmark's LLM scenarios).
CAUSAL_PAIRED_METRICS: tuple[str, ...] = (
    "received_token_accuracy",
    "personalized_rouge_l",
    "personalized_rouge_l_worst",
    "global_rouge_l",
)
RESAMPLES = 10_000
#: Relative spread under which the differences count as identical (std <= NO_SPREAD * |mean|):
#: accuracies are fractions of at most millions of examples, so a real spread is far above 1e-9
#: of the mean, and float rounding of equal differences (about 1e-16) far below it.
NO_SPREAD = 1e-9
#: A difference at most this large (in fractions: 1e-4 points) is float rounding, not a difference:
#: the paired metrics are fractions of at most about 1e5 examples (the smallest real difference is
#: 1e-5), kept through float32 (rounding about 6e-8); the tests read it as 0, and a spread of
#: the differences this small as none.
ROUNDING = 1e-6
LEVEL = 0.95
BOOTSTRAP_SEED = 0
PAIRED_CSV = "paired.csv"


class PairingError(ConfigError):
    """Runs that cannot be paired: an unknown baseline or label, or seeds that do not match."""


# --------------------------------------------------------------------------- the statistics
def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order; NaN stays NaN and is not counted.

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)).
    """
    finite = sorted((p, i) for i, p in enumerate(pvalues) if math.isfinite(p))
    m = len(finite)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for rank, (p, index) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[index] = running
    return adjusted


def bootstrap_ci(
    differences: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``differences`` (seeds resampled with replacement);
    NaN for fewer than 2 seeds (every resample of one difference is that difference: a zero-width
    interval that would read as certainty)."""
    import numpy as np

    values = np.asarray(differences, dtype=float)  # (n,)
    if values.size < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)  # (resamples,)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired_test(differences: Sequence[float]) -> tuple[float, str]:
    """(two-sided p, test): the paired t-test of the differences against 0 (``"t"``), or where they
    have no spread (:data:`NO_SPREAD`, :data:`ROUNDING`) the exact sign test (``"sign"``); (NaN, "") for fewer than 2 seeds."""
    import numpy as np
    from scipy import stats

    values = np.asarray(differences, dtype=float)
    if values.size < 2:
        return math.nan, ""
    values = np.where(np.abs(values) <= ROUNDING, 0.0, values)  # float rounding is no difference
    if float(values.std(ddof=1)) <= max(NO_SPREAD * abs(float(values.mean())), ROUNDING):  # t: 0 / 0, +-inf, rounding
        nonzero = values[values != 0.0]
        if not nonzero.size:
            return 1.0, "sign"
        return float(stats.binomtest(int((nonzero > 0).sum()), int(nonzero.size), 0.5).pvalue), "sign"
    return float(stats.ttest_1samp(values, 0.0).pvalue), "t"


def paired_t_pvalue(differences: Sequence[float]) -> float:
    """The p-value of :func:`paired_test`."""
    return paired_test(differences)[0]


# --------------------------------------------------------------------------- pairing
@dataclass(frozen=True)
class Pair:
    """``label - baseline`` on ``seeds`` (empty: the seeds both ran, which must be the same set)."""

    label: str
    baseline: str
    seeds: tuple[int, ...] = ()


def _by_seed(runs: Sequence[Mapping[str, Any]], label: str) -> dict[int, Mapping[str, Any]]:
    rows: dict[int, Mapping[str, Any]] = {}
    for row in runs:
        if row["strategy"] != label:
            continue
        seed = int(row["seed"])
        if seed in rows:
            raise PairingError(f"{label} has two runs with seed {seed}: runs are paired by seed, one run per seed")
        rows[seed] = row
    return rows


def _seeds_text(seeds: Sequence[int]) -> str:
    return ",".join(str(s) for s in sorted(seeds)) or "none"


def pair_seeds(runs: Sequence[Mapping[str, Any]], pair: Pair) -> tuple[list[int], dict[int, Mapping[str, Any]],
                                                                         dict[int, Mapping[str, Any]]]:
    """The seeds of ``pair`` and both sides' rows by seed; PairingError when they do not match."""
    labels = {row["strategy"] for row in runs}
    for name, role in ((pair.baseline, "baseline"), (pair.label, "label")):
        if name not in labels:
            raise PairingError(f"paired: {role} {name!r} is not among the compared labels ({', '.join(sorted(labels))})")
    mine, theirs = _by_seed(runs, pair.label), _by_seed(runs, pair.baseline)
    if pair.seeds:
        missing = sorted({s for s in pair.seeds if s not in mine} | {s for s in pair.seeds if s not in theirs})
        if missing:
            raise PairingError(f"paired: {pair.label} vs {pair.baseline} needs seeds {_seeds_text(pair.seeds)}; "
                               f"{pair.label} ran {_seeds_text(list(mine))}, {pair.baseline} ran {_seeds_text(list(theirs))}")
        seeds = sorted(pair.seeds)
    else:
        if set(mine) != set(theirs):
            raise PairingError(f"paired: seeds do not match: {pair.label} ran {_seeds_text(list(mine))}, the baseline "
                               f"{pair.baseline} ran {_seeds_text(list(theirs))} (runs are paired by seed)")
        seeds = sorted(mine)
    for seed in seeds:
        a, b = mine[seed].get("data_seed"), theirs[seed].get("data_seed")
        if a is not None and b is not None and not (math.isnan(a) or math.isnan(b)) and a != b:
            raise PairingError(f"paired: seed {seed}: {pair.label} ran on data.seed {a:g}, {pair.baseline} on "
                               f"data.seed {b:g}: not the same partition, so not paired")
    return seeds, mine, theirs


# --------------------------------------------------------------------------- the table
COLUMNS = ("label", "baseline", "metric", "primary", "n", "seeds", "differences", "mean_difference",
           "ci_low", "ci_high", "p_value", "p_holm", "test")


def paired_comparisons(
    runs: Sequence[Mapping[str, Any]],
    pairs: Sequence[Pair],
    primary: tuple[str, str] | None = None,
    primary_metric: str = "personalized_accuracy",
    metrics: Sequence[str] = PAIRED_METRICS,
    resamples: int = RESAMPLES,
) -> PairedTable:
    """The paired table of ``pairs`` over the run rows ``runs`` (``strategy``, ``seed``,
    ``data_seed`` and the metric columns, as :func:`fedlora.app.summary.run_row` gives them).

    ``primary`` = (label, baseline) of the declared primary comparison, on ``primary_metric``:
    uncorrected, out of the Holm family of that metric. A metric a side lacks on any of the paired
    seeds (NaN) is left out of that comparison.
    """
    import numpy as np
    import pandas as pd

    if resamples < 1:
        raise PairingError(f"paired: resamples must be >= 1, got {resamples}")
    unknown = [m for m in [*metrics, primary_metric] if m not in METRIC_NAMES]
    if unknown:
        raise PairingError(f"paired: unknown metric {unknown[0]!r}; known: {', '.join(METRIC_NAMES)}")
    if primary is not None and all((p.label, p.baseline) != primary for p in pairs):
        raise PairingError(f"paired: the primary comparison {primary[0]} vs {primary[1]} is not among the comparisons")
    records: list[dict[str, Any]] = []
    for pair in pairs:
        seeds, mine, theirs = pair_seeds(runs, pair)
        for metric in metrics:
            a = np.array([float(mine[s].get(metric, math.nan)) for s in seeds])
            b = np.array([float(theirs[s].get(metric, math.nan)) for s in seeds])
            if not seeds or not (np.isfinite(a).all() and np.isfinite(b).all()):
                continue
            differences = a - b  # (n,) paired by seed
            low, high = bootstrap_ci(differences, resamples=resamples)
            p_value, test = paired_test(differences)
            records.append({
                "label": pair.label, "baseline": pair.baseline, "metric": metric,
                "primary": primary == (pair.label, pair.baseline) and metric == primary_metric,
                "n": len(seeds), "seeds": _seeds_text(seeds),
                "differences": " ".join(f"{s}:{d:+.6f}" for s, d in zip(seeds, differences, strict=True)),
                "mean_difference": float(differences.mean()), "ci_low": low, "ci_high": high,
                "p_value": p_value, "test": test,
            })
    frame = pd.DataFrame(records, columns=[c for c in COLUMNS if c != "p_holm"])
    frame["p_holm"] = math.nan
    for metric in metrics:
        family = (frame["metric"] == metric) & ~frame["primary"].astype(bool)
        frame.loc[family, "p_holm"] = holm(frame.loc[family, "p_value"].tolist())
    frame.loc[frame["primary"].astype(bool), "p_holm"] = frame.loc[frame["primary"].astype(bool), "p_value"]
    return PairedTable(frame[list(COLUMNS)], primary, primary_metric, resamples)


class PairedTable:
    """The paired comparisons (``frame``: one row per comparison and metric, columns :data:`COLUMNS`).

    Renders itself in notebooks (HTML / markdown), as markdown (:meth:`to_markdown`, differences in
    points) and CSV (:meth:`to_csv`, fractions); ``write(folder)`` writes ``paired.csv``.
    """

    def __init__(self, frame: Any, primary: tuple[str, str] | None, primary_metric: str, resamples: int) -> None:
        self.frame = frame
        self.primary = primary
        self.primary_metric = primary_metric
        self.resamples = resamples

    def __len__(self) -> int:
        return len(self.frame)

    def row(self, label: str, metric: str, baseline: str | None = None) -> dict[str, Any]:
        """The comparison of ``label`` (against ``baseline``, default: its only one) on ``metric``."""
        rows = self.frame[(self.frame["label"] == label) & (self.frame["metric"] == metric)]
        if baseline is not None:
            rows = rows[rows["baseline"] == baseline]
        if len(rows) != 1:
            raise KeyError(f"{label} on {metric}: {len(rows)} comparisons")
        record: dict[str, Any] = rows.iloc[0].to_dict()
        return record

    def to_pandas(self) -> Any:
        return self.frame.copy()

    def to_csv(self, path: str | Path | None = None) -> str:
        text: str = self.frame.to_csv(index=False, lineterminator="\n", na_rep="")
        if path is not None:
            Path(path).write_text(text)
        return text

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / PAIRED_CSV
        self.to_csv(path)
        return path

    # ------------------------------------------------------------------ rendering
    @staticmethod
    def _p(value: float) -> str:
        return "n/a" if not math.isfinite(value) else ("< 0.001" if value < 0.001 else f"{value:.3f}")

    @staticmethod
    def _ci(low: float, high: float) -> str:
        return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"[{low * 100:+.2f}, {high * 100:+.2f}]"

    def display(self, metric: str) -> Any:
        """One metric's comparisons as shown (points, CI, p, Holm p)."""
        import pandas as pd

        rows = []
        for _, r in self.frame[self.frame["metric"] == metric].iterrows():
            per_seed = ", ".join(f"{float(d) * 100:+.1f}" for d in (x.split(":")[1] for x in r["differences"].split()))
            name = f"{r['label']} − {r['baseline']}"
            rows.append([
                f"**{name}** (primary)" if r["primary"] else name,
                f"{r['n']} ({r['seeds']})", per_seed, f"{r['mean_difference'] * 100:+.2f}",
                self._ci(r["ci_low"], r["ci_high"]),
                self._p(r["p_value"]) + (" (sign test)" if r["test"] == "sign" else ""),
                "uncorrected (primary)" if r["primary"] else self._p(r["p_holm"]),
            ])
        return pd.DataFrame(rows, columns=["comparison", "n (seeds)", "per seed (points)", "mean (points)",
                                           "95 % CI (points)", "p (paired t)", "p (Holm)"])

    def metrics(self) -> list[str]:
        return list(dict.fromkeys(self.frame["metric"]))

    def legend(self) -> list[str]:
        lines = [
            ("Each row is label minus baseline, the runs matched by seed (same train.seed and data.seed); "
             "differences in points (x 100: accuracy or ROUGE-L points)."),
            (f"95 % CI: percentile bootstrap of the mean difference, the seeds resampled with replacement "
             f"{self.resamples} times (seeded): the range of mean differences the seeds support, not a test; "
             "n/a with one seed."),
            ("p (paired t): two-sided paired t-test of the differences (n - 1 degrees of freedom); where the "
             "differences have no spread (identical up to rounding) the exact two-sided sign test instead, "
             "marked (sign test): with n seeds of one sign it is 2 / 2^n, never 0."),
            ("p (Holm): Holm's step-down correction over that metric's comparisons, the primary one excluded; "
             "read a difference as significant at 0.05 only when its Holm p is under 0.05."),
        ]
        if self.primary is not None:
            lines.append(f"Primary comparison (declared before the runs): {self.primary[0]} − {self.primary[1]} on "
                         f"{METRIC_NAMES[self.primary_metric]}: reported uncorrected, outside the Holm family.")
        return lines

    def to_markdown(self, heading: str = "##") -> str:
        out = [f"{heading} Paired differences (matched by seed)", ""]
        for metric in self.metrics():
            out += [f"{heading}# {METRIC_NAMES[metric]}", "",
                    self.display(metric).to_markdown(index=False, tablefmt="pipe", disable_numparse=True), ""]
        if not len(self.frame):
            out += ["No comparison has a metric on every paired seed.", ""]
        out += [f"- {line}" for line in self.legend()]
        return "\n".join(out) + "\n"

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def _repr_html_(self) -> str:
        parts = [f"<h4>{html.escape(METRIC_NAMES[m])}</h4>{self.display(m).to_html(index=False)}" for m in self.metrics()]
        legend = "".join(f"<li>{html.escape(line)}</li>" for line in self.legend())
        return "".join(parts) + f"<ul>{legend}</ul>"

    def __repr__(self) -> str:
        return self.to_markdown()
