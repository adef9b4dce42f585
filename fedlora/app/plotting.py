"""Plots of results (matplotlib figures, saved as PNG files; the Agg backend, except in a notebook,
whose inline backend is kept)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora import protocol


def _pyplot():
    import matplotlib

    if "inline" not in str(matplotlib.rcParams["backend"]):  # a notebook keeps its inline figures
        matplotlib.use("Agg")  # files only: no window, safe in the ServerApp's thread
    import matplotlib.pyplot as plt

    return plt


def _integer_rounds(ax: Any) -> None:
    """Rounds are whole numbers: tick them so."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_accuracy(results: dict[str, Any], path: str | Path):
    """Global and personalised accuracy per round of one run (a causal LM: ROUGE-L, round 0 being
    the zero-shot model); returns the figure."""
    plt = _pyplot()

    rounds = results["rounds"]
    causal = results.get("config", {}).get("model", {}).get("kind") == "causal_lm"
    metric, prefix = ("ROUGE-L", "rouge_l") if causal else ("accuracy", "accuracy")
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in ((f"global_{prefix}", "global (held-out test)"), (f"personalized_{prefix}", "personalised (local test)")):
        evaluated = [(r["round"], r[key]) for r in rounds if r.get(key) is not None]  # skip rounds not evaluated
        if evaluated:
            ax.plot(*zip(*evaluated), marker="o", label=label)
    ax.set_xlabel("round")
    _integer_rounds(ax)
    ax.set_ylabel(metric)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"{results['strategy']}: {metric} vs round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


# --------------------------------------------------------------------------- comparisons
# ``runs`` maps a label (strategy) to the results dicts of its seeds (fedlora.app.runs.load_runs).
Runs = dict[str, list[dict[str, Any]]]

ACCURACY_PANELS = (
    ("global_accuracy", "global accuracy (held-out global test)"),
    ("personalized_accuracy", "personalised accuracy (example-weighted mean of local tests)"),
)
# causal LMs (model.kind = 'causal_lm') have no accuracy: the same plots show ROUGE-L
ROUGE_PANELS = (
    ("global_rouge_l", "global ROUGE-L (held-out global test)"),
    ("personalized_rouge_l", "personalised ROUGE-L (example-weighted mean of local tests)"),
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
        fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return fig


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


def _accuracy_panels(runs: Runs, path: str | Path | None, xlabel: str,
                     curve: Callable[[list[dict[str, Any]], str], tuple[Any, Any, Any]], rounds: bool):
    """The global and personalised panels: per strategy, ``curve(its runs, metric) -> (x, mean, std)``
    drawn with a +-1 std band; ``rounds``: x is the round (integer ticks, seed counts in the legend)."""
    plt = _pyplot()
    colors = _colors(list(runs))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (key, title) in zip(axes, _panels(runs), strict=True):
        for label, results_list in runs.items():
            x, mean, std = curve(results_list, key)
            ax.plot(x, mean, marker="o", color=colors[label],
                    label=f"{label} (n={len(results_list)})" if rounds else label)
            ax.fill_between(x, mean - std, mean + std, color=colors[label], alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if rounds:
            _integer_rounds(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{'ROUGE-L' if _causal(runs) else 'accuracy'} (mean ± std over seeds)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    return _finish(fig, path)


def plot_personalized_distribution(runs: Runs, path: str | Path | None = None):
    """Per-client personalised accuracy (ROUGE-L for a causal LM) in the last round: a box per
    strategy, one dot per client and seed (results ``rounds[-1].per_client``)."""
    import numpy as np

    plt = _pyplot()
    labels = list(runs)
    colors = _colors(labels)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(labels) + 2), 4))
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
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel(f"client's personalised {name} (local test)")
    ax.set_ylim(0, 1)
    ax.set_title(f"per-client personalised {name}, last round (dots: clients x seeds)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return _finish(fig, path)


def plot_label_distribution(federated: Any, path: str | Path | None = None):
    """Heat map of training examples per client and class (flwr-datasets' plot_label_distributions
    over the federation's partitions, :meth:`fedlora.data.FederatedData.partitions`)."""
    from flwr_datasets.visualization import plot_label_distributions

    _pyplot()
    fig, _, _ = plot_label_distributions(
        federated.partitions(), label_name="clean_label", plot_type="heatmap", size_unit="absolute",
        partition_id_axis="y", title="training examples per client and class (partition)",
        figsize=(max(6.0, 1.0 * len(federated.label_names)), max(3.5, 2.5 + 0.35 * len(federated.clients))),
        plot_kwargs={"annot": len(federated.clients) * len(federated.label_names) <= 400},
    )
    return _finish(fig, path)


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


def plot_mechanisms(out_dir: str | Path | None = None, runs: Runs | None = None, path: str | Path | None = None,
                    columns: int = 3):
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
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, series in per_label.items():
            if key not in series:
                continue
            rounds, mean, std = series[key]
            n = len(runs[label])
            ax.plot(rounds, mean, marker="o", markersize=3, color=colors[label], label=f"{label} (n={n})")
            ax.fill_between(rounds, mean - std, mean + std, color=colors[label], alpha=0.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("round")
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("mechanisms: numeric extra entries of the rounds (mean ± std over seeds)", fontsize=10)
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
