"""Plots of results (matplotlib figures, saved as PNG files; the Agg backend, except in a notebook,
whose inline backend is kept).

Every figure is drawn for the width a README shows it at (:data:`README_WIDTH_PX`): at most
:data:`FIGURE_WIDTH` inches wide with text of at least :data:`MIN_FONT_PT` points, so that shrunk to
that width no text is smaller than :data:`MIN_TEXT_PX` pixels (:func:`smallest_text_px`); legends go
under the panels, not over the curves. Saved at :data:`DPI` (sharp on high-density screens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora import protocol

README_WIDTH_PX = 830  # the width a repository page shows a README's images at (its content column)
FIGURE_WIDTH = 8.0  # inches: a figure at most this wide
MIN_FONT_PT = 8.0  # the smallest text in a figure (legends, tick labels)
MIN_TEXT_PX = 11.0  # ... is then at least this many pixels high shown README_WIDTH_PX wide
DPI = 150
FONTS = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
         "legend.fontsize": 9, "figure.titlesize": 11}


def smallest_text_px(fig: Any, width_px: float = README_WIDTH_PX) -> float:
    """The height in pixels of the smallest visible text of ``fig`` when the figure is shown
    ``width_px`` pixels wide (its points scaled by the width it is shrunk or grown to)."""
    sizes = [text.get_fontsize() for text in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
             if text.get_visible() and text.get_text().strip()]
    return min(sizes) * width_px / (fig.get_figwidth() * 72.0) if sizes else math.inf


def _pyplot():
    import matplotlib

    if "inline" not in str(matplotlib.rcParams["backend"]):  # a notebook keeps its inline figures
        matplotlib.use("Agg")  # files only: no window, safe in the ServerApp's thread
    import matplotlib.pyplot as plt

    return plt


def _styled(draw: Callable[..., Any]) -> Callable[..., Any]:
    """Draw (and save) under :data:`FONTS`, leaving the caller's matplotlib settings as they were."""
    import functools

    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _pyplot().rc_context(FONTS):
            return draw(*args, **kwargs)

    return wrapper


def _integer_rounds(ax: Any) -> None:
    """Rounds are whole numbers: tick them so."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


@_styled
def plot_accuracy(results: dict[str, Any], path: str | Path):
    """One run by round, two panels: global, personalised and received accuracy (a causal LM:
    ROUGE-L, round 0 being the zero-shot model; received: teacher-forced token accuracy), and beside
    them the loss (training loss; a causal LM also the global, personalised and received models'
    loss per response token). Rounds not evaluated are skipped. Returns the figure."""
    plt = _pyplot()

    rounds = results["rounds"]
    causal = results.get("config", {}).get("model", {}).get("kind") == "causal_lm"
    metric, prefix = ("ROUGE-L", "rouge_l") if causal else ("accuracy", "accuracy")
    scores = [(f"global_{prefix}", "global (held-out test)"), (f"personalized_{prefix}", "personalised (local tests)"),
              ("received_token_accuracy" if causal else "received_accuracy", "received (before local training)")]
    losses = [("train_loss", "training")]
    if causal:
        losses += [("global_loss", "global (held-out test)"), ("personalized_loss", "personalised (local tests)"),
                   ("received_loss", "received (before local training)")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(FIGURE_WIDTH, 3.6))
    for ax, series in ((left, scores), (right, losses)):
        for key, label in series:
            measured = [(r["round"], r[key]) for r in rounds if r.get(key) is not None]  # skip rounds not evaluated
            if measured:
                ax.plot(*zip(*measured), marker="o", markersize=4, label=label)
        ax.set_xlabel("round")
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1, frameon=False)
    left.set_ylabel(metric)
    left.set_ylim(0, 1)
    left.set_title(metric)
    right.set_ylabel("loss" + (" per response token" if causal else ""))
    right.set_title("loss")
    fig.suptitle(f"{results['strategy']}: by round")
    return _finish(fig, path)


# --------------------------------------------------------------------------- comparisons
# ``runs`` maps a label (strategy) to the results dicts of its seeds (fedlora.app.runs.load_runs).
Runs = dict[str, list[dict[str, Any]]]

ACCURACY_PANELS = (
    ("global_accuracy", "global accuracy\n(held-out global test)"),
    ("personalized_accuracy", "personalised accuracy\n(example-weighted mean of local tests)"),
)
# causal LMs (model.kind = 'causal_lm') have no accuracy: the same plots show ROUGE-L
ROUGE_PANELS = (
    ("global_rouge_l", "global ROUGE-L\n(held-out global test)"),
    ("personalized_rouge_l", "personalised ROUGE-L\n(example-weighted mean of local tests)"),
)


def _causal(runs: Runs) -> bool:
    """Whether the runs are causal-LM runs (their resolved config's model.kind)."""
    first = next((r for results in runs.values() for r in results), {})
    return bool(((first.get("config") or {}).get("model") or {}).get("kind") == "causal_lm")


def _panels(runs: Runs) -> tuple[tuple[str, str], ...]:
    return ROUGE_PANELS if _causal(runs) else ACCURACY_PANELS


def _finish(fig, path: str | Path | None):
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=DPI, bbox_inches="tight")  # tight: the legend under the panels is kept
    _pyplot().close(fig)
    return fig


def _legend_below(fig: Any, ax: Any, count: int) -> None:
    """The figure's one legend (``ax``'s entries) under its panels, in as many columns as fit."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(count, 4), frameon=False)


def _series(results_list: list[dict[str, Any]], key: str) -> tuple[list[int], Any, Any]:
    """Rounds, mean and std over seeds of ``rounds[*][key]`` (NaN where missing)."""
    import numpy as np

    length = min(len(r["rounds"]) for r in results_list)
    rounds = [r["round"] for r in results_list[0]["rounds"][:length]]
    values = np.array(
        [[np.nan if x.get(key) is None else float(x[key]) for x in r["rounds"][:length]] for r in results_list]
    )
    finite = np.isfinite(values)
    count = finite.sum(axis=0)
    total = np.where(finite, values, 0.0).sum(axis=0)
    mean = np.divide(total, count, out=np.full(len(rounds), np.nan), where=count > 0)  # NaN: not evaluated
    spread = np.where(finite, (values - mean) ** 2, 0.0).sum(axis=0)
    std = np.sqrt(np.divide(spread, count, out=np.zeros(len(rounds)), where=count > 0))
    return rounds, mean, std


def _evaluated(x: Any, mean: Any, std: Any) -> tuple[Any, Any, Any]:
    """Keep the evaluated rounds only (``federation.evaluate_every`` > 1 leaves NaN between)."""
    import numpy as np

    x, mean, std = np.asarray(x, dtype=float), np.asarray(mean), np.asarray(std)
    keep = np.isfinite(mean)
    return x[keep], mean[keep], np.nan_to_num(std[keep])


def _colors(labels: list[str]) -> dict[str, Any]:
    cmap = _pyplot().get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def plot_accuracy_vs_round(runs: Runs, path: str | Path | None = None):
    """Global and personalised accuracy (ROUGE-L for a causal LM) per round, mean over seeds with a
    +-1 std band."""
    return _accuracy_panels(runs, path, "round", lambda results_list, key: _evaluated(*_series(results_list, key)),
                            rounds=True)


def plot_accuracy_vs_bytes(runs: Runs, path: str | Path | None = None):
    """Communication efficiency: accuracy against cumulative training bytes (up + down)."""
    import numpy as np

    def curve(results_list: list[dict[str, Any]], key: str) -> tuple[Any, Any, Any]:
        _, up, _ = _series(results_list, "bytes_up")
        _, down, _ = _series(results_list, "bytes_down")
        _, mean, std = _series(results_list, key)
        return _evaluated(np.cumsum(up + down) / 1e6, mean, std)

    return _accuracy_panels(runs, path, "cumulative MB (training uploads + downloads)", curve, rounds=False)


@_styled
def _accuracy_panels(runs: Runs, path: str | Path | None, xlabel: str,
                     curve: Callable[[list[dict[str, Any]], str], tuple[Any, Any, Any]], rounds: bool):
    """The global and personalised panels: per strategy, ``curve(its runs, metric) -> (x, mean, std)``
    drawn with a +-1 std band; ``rounds``: x is the round (integer ticks, seed counts in the legend)."""
    plt = _pyplot()
    colors = _colors(list(runs))
    fig, axes = plt.subplots(1, 2, figsize=(FIGURE_WIDTH, 3.6), sharey=True)
    for ax, (key, title) in zip(axes, _panels(runs), strict=True):
        for label, results_list in runs.items():
            x, mean, std = curve(results_list, key)
            ax.plot(x, mean, marker="o", markersize=4, color=colors[label],
                    label=f"{label} (n={len(results_list)})" if rounds else label)
            ax.fill_between(x, mean - std, mean + std, color=colors[label], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        if rounds:
            _integer_rounds(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{'ROUGE-L' if _causal(runs) else 'accuracy'} (mean ± std over seeds)")
    axes[0].set_ylim(0, 1)
    _legend_below(fig, axes[0], len(runs))
    return _finish(fig, path)


@_styled
def plot_personalized_distribution(runs: Runs, path: str | Path | None = None):
    """Per-client personalised accuracy (ROUGE-L for a causal LM) in the last round: a box per
    strategy, one dot per client and seed (results ``rounds[-1].per_client``)."""
    import numpy as np

    plt = _pyplot()
    labels = list(runs)
    colors = _colors(labels)
    fig, ax = plt.subplots(figsize=(min(FIGURE_WIDTH, max(4.0, 1.1 * len(labels) + 2)), 4))
    metric, name = (protocol.ROUGE_L, "ROUGE-L") if _causal(runs) else (protocol.ACCURACY, "accuracy")
    values = [
        [float(m[metric]) for r in runs[label] for m in (r["rounds"][-1].get("per_client") or {}).values()
         if metric in m]
        for label in labels
    ]
    ax.boxplot(values, positions=range(1, len(labels) + 1), widths=0.5, showfliers=False)
    rng = np.random.default_rng(0)  # horizontal jitter of the dots only
    for i, (label, points) in enumerate(zip(labels, values, strict=True), start=1):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(points)), points, s=18, color=colors[label], alpha=0.8, zorder=3)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if len(labels) > 4 else 0,
                  ha="right" if len(labels) > 4 else "center")
    ax.set_ylabel(f"client's personalised {name}\n(local test)")
    ax.set_ylim(0, 1)
    ax.set_title(f"per-client personalised {name}, last round\n(dots: clients x seeds)")
    ax.grid(alpha=0.3, axis="y")
    return _finish(fig, path)


@_styled
def plot_label_distribution(federated: Any, path: str | Path | None = None):
    """Heat map of training examples per client and class (flwr-datasets' plot_label_distributions
    over the federation's partitions, :meth:`fedlora.data.FederatedData.partitions`)."""
    from flwr_datasets.visualization import plot_label_distributions

    _pyplot()
    fig, _, _ = plot_label_distributions(
        federated.partitions(), label_name="clean_label", plot_type="heatmap", size_unit="absolute",
        partition_id_axis="y", title="training examples per client and class (partition)",
        figsize=(min(FIGURE_WIDTH, max(6.0, 0.8 * len(federated.label_names))),
                 max(3.5, 2.5 + 0.35 * len(federated.clients))),
        plot_kwargs={"annot": len(federated.clients) * len(federated.label_names) <= 400,
                     "annot_kws": {"fontsize": MIN_FONT_PT}},
    )
    _at_least(fig, MIN_FONT_PT)
    return _finish(fig, path)


def _at_least(fig: Any, points: float) -> None:
    """No text of ``fig`` (a figure another library drew) smaller than ``points``."""
    for text in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "set_fontsize")):
        if text.get_fontsize() < points:
            text.set_fontsize(points)


MECHANISMS_PLOT = "mechanisms.png"


def mechanism_series(results_list: list[dict[str, Any]]) -> dict[str, tuple[list[int], Any, Any]]:
    """Numeric ``extra`` key -> (rounds, mean, std over the seeds that recorded it that round)."""
    import numpy as np

    from fedlora.app.runs import numeric_extra

    per_key: dict[str, dict[int, list[float]]] = {}
    for results in results_list:
        for record in results.get("rounds") or []:
            for key, value in numeric_extra(record.get("extra")).items():
                per_key.setdefault(key, {}).setdefault(int(record["round"]), []).append(value)
    series = {}
    for key, by_round in per_key.items():
        rounds = sorted(by_round)
        series[key] = (rounds, np.array([np.mean(by_round[r]) for r in rounds]),
                       np.array([np.std(by_round[r]) for r in rounds]))
    return series


@_styled
def plot_mechanisms(out_dir: str | Path | None = None, runs: Runs | None = None, path: str | Path | None = None,
                    columns: int = 2):
    """Each numeric ``extra`` key of the rounds (the methods' mechanisms: FedPissa's relative
    correction, FedTreeLoRA's lambda per block, FedDR-LoRA's split precision, FedHera's ranks ...)
    by round, one panel per key, one line per label that records it (mean over seeds, +-1 std band).

    ``runs`` defaults to :func:`fedlora.app.runs.load_runs` of ``out_dir``; the figure goes to
    ``path`` (default ``out_dir/mechanisms.png``). Returns the figure, or None when no run records a
    numeric ``extra`` entry (nothing is written then).
    """
    if runs is None:
        from fedlora.app.runs import load_runs

        if out_dir is None:
            raise ValueError("plot_mechanisms needs out_dir or runs")
        runs = load_runs(out_dir)
    per_label = {label: mechanism_series(results_list) for label, results_list in runs.items() if results_list}
    keys = sorted({key for series in per_label.values() for key in series})
    if not keys:
        return None
    if path is None and out_dir is not None:
        path = Path(out_dir) / MECHANISMS_PLOT
    plt = _pyplot()
    colors = _colors(list(runs))
    ncols = min(columns, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(FIGURE_WIDTH if ncols > 1 else FIGURE_WIDTH / 2, 2.8 * nrows),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, series in per_label.items():
            if key not in series:
                continue
            rounds, mean, std = series[key]
            n = len(runs[label])
            ax.plot(rounds, mean, marker="o", markersize=3, color=colors[label], label=f"{label} (n={n})")
            ax.fill_between(rounds, mean - std, mean + std, color=colors[label], alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("round")
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=MIN_FONT_PT)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("mechanisms: numeric extra entries of the rounds\n(mean ± std over seeds)")
    return _finish(fig, path)


COMPARISON_PLOTS = (
    "accuracy_vs_round.png",
    "accuracy_vs_bytes.png",
    "personalized_distribution.png",
    "label_distribution.png",
)


def plot_comparison(out_dir: str | Path, runs: Runs, data_config: Any = None) -> dict[str, Any]:
    """Write the four comparison PNGs of ``runs`` (label -> its seeds' results, as
    :func:`fedlora.app.runs.load_runs` reads them) into ``out_dir``; returns file name -> figure.

    ``data_config`` (a DataConfig) gives the partition for the heat map; default: the data
    section of the first run's resolved config.
    """
    from fedlora.config import DataConfig
    from fedlora.data import build_federated_data

    out = Path(out_dir)
    if not runs:
        return {}
    if data_config is None:
        data_config = DataConfig.model_validate(next(iter(runs.values()))[0]["config"]["data"])
    federated = build_federated_data(data_config)
    return {
        "accuracy_vs_round.png": plot_accuracy_vs_round(runs, out / "accuracy_vs_round.png"),
        "accuracy_vs_bytes.png": plot_accuracy_vs_bytes(runs, out / "accuracy_vs_bytes.png"),
        "personalized_distribution.png": plot_personalized_distribution(runs, out / "personalized_distribution.png"),
        "label_distribution.png": plot_label_distribution(federated, out / "label_distribution.png"),
    }
