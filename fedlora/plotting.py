"""Plots of results (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(results: dict[str, Any], path: str | Path):
    """Global and personalised accuracy per round of one run; returns the figure."""
    plt = _pyplot()
    rounds = results["rounds"]
    x = [r["round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("global_accuracy", "global (held-out test)"), ("personalized_accuracy", "personalised (local test)")):
        y = [r[key] if r[key] is not None else float("nan") for r in rounds]
        ax.plot(x, y, marker="o", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"{results['strategy']}: accuracy vs round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig
