"""A folder of runs, ``OUT/<label>/seed<k>/results.json``, read back: the finished runs per label,
and the numeric ``extra`` entries of their rounds (the methods' mechanisms).

The reading half of :mod:`fedlora.app.compare` (which re-exports it), kept apart so that the plots
(:func:`fedlora.app.plotting.plot_mechanisms`) and the trackers read runs without importing the
comparison harness.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("fedlora")

SEED_DIR_PREFIX = "seed"
EXTRA_PREFIX = "extra."


def number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def numeric_extra(extra: Any) -> dict[str, float]:
    """The numeric entries of a round's ``extra`` (flat keys; booleans, strings, lists and nested
    dicts are left out), finite values only."""
    if not isinstance(extra, dict):
        return {}
    values = {str(key): number(value) for key, value in extra.items()}
    return {key: value for key, value in values.items() if math.isfinite(value)}


def final_extra(rounds: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``extra.<key>`` -> the value of the last round that recorded the numeric key."""
    final: dict[str, float] = {}
    for record in rounds:
        final.update({f"{EXTRA_PREFIX}{key}": value for key, value in numeric_extra(record.get("extra")).items()})
    return final


def result_dirs(out_dir: str | Path) -> list[Path]:
    """Every ``OUT/<label>/seed<k>`` folder holding a results.json, in label then seed order (a run
    moved aside, ``seed<k>.old-<time>``, is not one of them)."""
    found = [p.parent for p in Path(out_dir).glob(f"*/{SEED_DIR_PREFIX}*/results.json")
             if p.parent.name[len(SEED_DIR_PREFIX):].lstrip("-").isdigit()]

    def seed_of(path: Path) -> int:
        suffix = path.name[len(SEED_DIR_PREFIX):]
        return int(suffix) if suffix.lstrip("-").isdigit() else 0

    return sorted(found, key=lambda p: (p.parent.name, seed_of(p)))


def train_seed(results: dict[str, Any]) -> int:
    return int(((results.get("config") or {}).get("train") or {}).get("seed", 0))


def load_runs(
    out_dir: str | Path, labels: Sequence[str] | None = None, seeds: Iterable[int] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Label -> the results dicts of its finished seeds (``labels`` picks and orders them;
    ``seeds`` keeps the runs of those ``train.seed`` values only).

    A run still in progress (or interrupted) has a results.json with fewer rounds than its config
    asks for; it is left out, so a summary never mixes partial and final numbers.
    """
    from fedlora.results import load_results

    wanted = None if seeds is None else {int(s) for s in seeds}
    runs: dict[str, list[dict[str, Any]]] = {}
    for folder in result_dirs(out_dir):
        results = load_results(folder)
        planned = ((results.get("config") or {}).get("train") or {}).get("rounds")
        done = [r.get("round") for r in results.get("rounds") or [] if r.get("round") != 0]  # causal LM: zero-shot 0
        if planned is not None and done != list(range(1, planned + 1)):
            logger.info("compare: %s has %d of %d rounds, not summarised", folder, len(done), planned)
            continue
        if wanted is not None and train_seed(results) not in wanted:
            continue
        results["_seed_dir"] = folder.name
        runs.setdefault(folder.parent.name, []).append(results)
    if labels is not None:
        runs = {label: runs[label] for label in labels if label in runs}
    return runs
