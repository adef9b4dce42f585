"""One figure per 2026 method that shows whether its mechanism acted, from the rounds' records.

The generic figure (:func:`fedlora.app.plotting.plot_mechanisms`) draws every numeric ``extra``
entry; these draw the few quantities a reader needs to see the mechanism at work, at the README's
width (three panels at most):

- **FedHera**: r_tot and r_main per budget tier (columns per adapted module, mean over the tier's
  sampled clients), the decoupled method against its coupled ablation, and the download each tier
  used against its budget (1 = the budget binds);
- **FedTreeLoRA**: the tree of the last round per block: its clusters, their agreement with planted
  task groups (adjusted Rand index, where the partition has groups) and the mixing weight lambda;
- **FedPissa**: the relative correction the projection adds to the plain mean of B, and the overlap
  of the clients' tail subspaces;
- **FedDR-LoRA**: the precision and recall with which the local split flags the planted noisy
  labels, and the flagged fraction against the realised noise rate.

``runs`` maps a job label to its seeds' results (:func:`fedlora.app.runs.load_runs`); every value
is a mean over the seeds that recorded it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora.app.plotting import Runs, _finish, _integer_rounds, _pyplot, mechanism_series

MECHANISM_PLOT = "mechanism.png"
WIDTH, HEIGHT = 10.5, 3.0  # inches at 120 dpi: 1260 x 360 px, readable at a README's width
TIERS = ("low", "medium", "high")
STYLES = ("-", "--", ":", "-.")
COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple")


def _line(ax: Any, series: dict[str, tuple[list[int], Any, Any]], key: str, **style: Any) -> None:
    if key in series:
        rounds, mean, _ = series[key]
        ax.plot(rounds, mean, marker="o", markersize=2.5, **style)


def _axes(count: int) -> tuple[Any, list[Any]]:
    fig, axes = _pyplot().subplots(1, count, figsize=(WIDTH, HEIGHT), squeeze=False)
    return fig, list(axes.flat)


def _by_round(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("round", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    _integer_rounds(ax)
    ax.grid(alpha=0.3)


# --------------------------------------------------------------------------- FedHera
def _tier_of(budget: float, tiers: list[dict[str, Any]]) -> str | None:
    """The budget tier whose download budget this client's is (the server applies the tier's)."""
    named = [t for t in tiers if t.get("name") in TIERS]
    closest = min(named, key=lambda t: abs(float(t["download"]) - budget), default=None)
    return None if closest is None or abs(float(closest["download"]) - budget) > 1e-6 * budget else closest["name"]


def download_use(results: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Tier -> round -> the mean over the tier's sampled clients of download bytes / download budget."""
    tiers = ((results.get("config") or {}).get("clients") or {}).get("budget_tiers") or []
    use: dict[str, dict[int, list[float]]] = {}
    for record in results.get("rounds") or []:
        clients = ((record.get("extra") or {}).get("fedhera") or {}).get("clients") or {}
        for client in clients.values():
            budget = float(client.get("download_budget") or 0.0)
            tier = _tier_of(budget, tiers) if budget > 0 and client.get("budget_applies", True) else None
            if tier is not None:
                use.setdefault(tier, {}).setdefault(int(record["round"]), []).append(client["download_bytes"] / budget)
    return {tier: {r: statistics.fmean(v) for r, v in rounds.items()} for tier, rounds in use.items()}


def _run_mean(results: dict[str, Any], key: str) -> float:
    """The mean over a run's rounds of the numeric extra ``key`` (NaN where never recorded)."""
    series = mechanism_series([results]).get(key)
    return float(statistics.fmean(series[1])) if series is not None else math.nan


def tier_means(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Tier -> r_tot, r_main (columns per module) and download / budget, each a mean over the rounds."""
    use = download_use(results)
    return {tier: {"r_tot": _run_mean(results, f"fedhera_r_tot_{tier}"),
                   "r_main": _run_mean(results, f"fedhera_r_main_{tier}"),
                   "download": statistics.fmean(use[tier].values()) if use.get(tier) else math.nan}
            for tier in TIERS}


def fedhera_figure(runs: Runs, path: str | Path | None = None) -> Any:
    labels = [label for label, results in runs.items()
              if results and any(f"fedhera_r_tot_{tier}" in mechanism_series(results) for tier in TIERS)]
    fig, axes = _axes(3)
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        per_seed = [tier_means(results) for results in runs[label]]
        x = [t + (i - (len(labels) - 1) / 2) * width for t in range(len(TIERS))]
        for ax, key in zip(axes, ("r_tot", "r_main", "download")):
            values = [[seed[tier][key] for seed in per_seed if math.isfinite(seed[tier][key])] for tier in TIERS]
            ax.bar(x, [statistics.fmean(v) if v else 0.0 for v in values], width=width,
                   label=f"{label} (n={len(per_seed)})")
    for ax, (title, ylabel) in zip(axes, (("r_tot: columns a client receives", "columns per module"),
                                          ("r_main: columns a client trains", "columns per module"),
                                          ("download used / budget", "fraction of the budget"))):
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(TIERS)), [f"{tier} tier" for tier in TIERS], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes[2].axhline(1.0, color="grey", linewidth=0.8)
    axes[2].set_ylim(0, 1.1)
    axes[0].legend(fontsize=7)
    fig.suptitle("FedHera: the spectrum each budget tier receives (r_tot) and trains (r_main), mean over rounds and "
                 "seeds", fontsize=10)
    return _finish(fig, path)


# --------------------------------------------------------------------------- FedTreeLoRA
def _last_tree(results: dict[str, Any]) -> dict[str, Any] | None:
    """The extra of the last round that ran the tree (FedTreeLoRA's warm-up rounds have none)."""
    trees = [r.get("extra") for r in results.get("rounds") or [] if (r.get("extra") or {}).get("phase") == "tree"]
    return trees[-1] if trees else None


def tree_per_block(results: dict[str, Any]) -> dict[str, list[float]] | None:
    """The last tree's clusters, lambda mean / min / max and (planted task groups) ARI per block."""
    from fedlora.data.federated import client_groups
    from fedlora.methods.fedtreelora import tree_agreement
    from fedlora.schema import DataConfig

    tree = _last_tree(results)
    if tree is None:
        return None
    membership = {int(b): {int(c): int(k) for c, k in m.items()} for b, m in (tree.get("clusters") or {}).items()}
    blocks = sorted(membership)
    found: dict[str, list[float]] = {
        "clusters": [float(len(set(membership[b].values()))) for b in blocks],
        **{key: [math.nan if v is None else float(v) for v in tree.get(key) or []]
           for key in ("lam_mean", "lam_min", "lam_max")},
    }
    groups = client_groups(DataConfig(**(results.get("config") or {}).get("data", {})))
    if groups:
        agreement = tree_agreement(membership, groups)
        found["ari"] = [agreement[b] for b in blocks]
    return found


def fedtreelora_figure(runs: Runs, path: str | Path | None = None) -> Any:
    trees = {label: [t for r in results if (t := tree_per_block(r)) is not None] for label, results in runs.items()}
    trees = {label: found for label, found in trees.items() if found}
    with_groups = any("ari" in t for found in trees.values() for t in found)
    fig, axes = _axes(3 if with_groups else 2)
    width = 0.8 / max(len(trees), 1)

    def mean_of(found: list[dict[str, list[float]]], key: str) -> list[float]:
        rows = [t[key] for t in found if t.get(key)]
        means = [[v for v in col if math.isfinite(v)] for col in zip(*rows)]
        return [statistics.fmean(col) if col else math.nan for col in means]

    for i, (label, found) in enumerate(trees.items()):
        clusters = mean_of(found, "clusters")
        x = [b + (i - (len(trees) - 1) / 2) * width for b in range(len(clusters))]
        axes[0].bar(x, clusters, width=width, label=f"{label} (n={len(found)})")
        if with_groups:
            axes[1].bar(x, mean_of(found, "ari"), width=width, label=label)
        lam, low, high = (mean_of(found, k) for k in ("lam_mean", "lam_min", "lam_max"))
        if lam:
            axes[-1].errorbar(list(range(len(lam))), lam, yerr=[[m - lo for m, lo in zip(lam, low)], [hi - m for m, hi in zip(lam, high)]],
                              marker="o", markersize=3, capsize=2, linestyle=STYLES[i % len(STYLES)], label=label)
    titles = [("clusters per block (last tree)", "clusters")]
    if with_groups:
        titles.append(("agreement with the task groups", "adjusted Rand index"))
    titles.append(("mixing weight lambda (mean, min-max)", "lambda"))
    n_blocks = max((len(t["clusters"]) for found in trees.values() for t in found), default=0)
    for ax, (title, ylabel) in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(n_blocks))
        ax.set_xlabel("block (shallow to deep)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if with_groups:
        axes[1].set_ylim(-0.1, 1.05)
    axes[-1].set_ylim(0, 1.05)
    axes[0].legend(fontsize=6)
    fig.suptitle("FedTreeLoRA: where the tree branches, whether it finds the groups, how much each client mixes",
                 fontsize=10)
    return _finish(fig, path)


# --------------------------------------------------------------------------- FedPissa, FedDR-LoRA
def _rounds_figure(runs: Runs, panels: list[tuple[str, str, list[tuple[str, str]]]], title: str,
                   path: str | Path | None) -> Any:
    """Panels of (title, y label, [(extra key, its legend)]) by round, one line per label and key."""
    fig, axes = _axes(len(panels))
    for ax, (panel, ylabel, keys) in zip(axes, panels):
        for i, (label, results) in enumerate(runs.items()):
            series = mechanism_series(results) if results else {}
            for color, (key, name) in zip(COLORS, keys):
                if key in series:  # a color per quantity, a line style per label
                    _line(ax, series, key, linestyle=STYLES[i % len(STYLES)], color=color if len(keys) > 1 else None,
                          label=f"{label}: {name}" if len(keys) > 1 else label)
        _by_round(ax, panel, ylabel)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    return _finish(fig, path)


def fedpissa_figure(runs: Runs, path: str | Path | None = None) -> Any:
    return _rounds_figure(runs, [
        ("correction of the mean of B", "relative to the mean's norm", [("relative_correction", "correction")]),
        ("overlap of the clients' tail subspaces", "overlap (1 = the same)", [("projector_overlap", "overlap")]),
    ], "FedPissa: what the projection adds to the mean of B, and on which tail spaces", path)


def feddr_lora_figure(runs: Runs, path: str | Path | None = None) -> Any:
    return _rounds_figure(runs, [
        ("the split against the planted noise", "fraction", [("feddr_noise_precision", "precision"),
                                                             ("feddr_noise_recall", "recall")]),
        ("flagged against noisy", "fraction of the training examples", [("feddr_flagged_fraction", "flagged"),
                                                                       ("feddr_noise_rate", "noisy")]),
    ], "FedDR-LoRA: how well the local split finds the noisy labels", path)


FIGURES: dict[str, Callable[[Runs, str | Path | None], Any]] = {
    "fedhera": fedhera_figure,
    "fedtreelora": fedtreelora_figure,
    "fedpissa": fedpissa_figure,
    "feddr_lora": feddr_lora_figure,
}


def plot_method_mechanism(method: str, runs: Runs, path: str | Path | None = None) -> Any:
    """The mechanism figure of ``method`` (one of :data:`FIGURES`) from ``runs``; None for a method
    without one or when no run recorded its quantities (nothing is written then)."""
    figure = FIGURES.get(method)
    if figure is None or not any(results for results in runs.values()):
        return None
    return figure(runs, path)
