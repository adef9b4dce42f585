"""Checks of a results.json round record against numbers computed here from its own parts.

An end-to-end test on a tiny random model cannot expect an accuracy, but it can expect the
record to add up: every client's accuracy is a count over its own test split (k / n), the
personalised accuracies are the example-weighted mean, the plain mean and the minimum of those,
and the global accuracy is a count over the global test set (or, for a strategy without a global
model, the clients' models on it, example-weighted). "A value in [0, 1]" passes a wrong average,
a constant and a swapped weight; these checks do not (and NaN fails every one of them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest


def is_fraction_of(value: Any, n: int) -> bool:
    """``value`` = k / n for a whole k in [0, n] (float32 rounding allowed)."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or n <= 0:
        return False
    count = value * n
    return -1e-4 <= count <= n + 1e-4 and abs(count - round(count)) < 1e-4


def assert_accuracies_add_up(record: dict[str, Any], global_test_size: int, max_client_share: float = 0.6) -> None:
    """The personalised and global accuracies of round ``record`` (a results.json round or its
    ``final``) against its ``per_client`` rows, recomputed here."""
    rows = [row for row in record["per_client"].values() if "accuracy" in row]
    assert rows, f"round {record['round']}: no client reported an accuracy"
    accuracy = np.array([row["accuracy"] for row in rows])
    examples = np.array([row["num-examples"] for row in rows])
    for row in rows:
        assert is_fraction_of(row["accuracy"], int(row["num-examples"])), row
    assert record["personalized_accuracy_unweighted"] == pytest.approx(accuracy.mean(), rel=1e-9)
    assert record["personalized_accuracy_worst"] == pytest.approx(accuracy.min(), rel=1e-9)
    if examples.max() <= max_client_share * examples.sum():  # faults.max_client_share cuts nothing
        assert record["personalized_accuracy"] == pytest.approx(np.average(accuracy, weights=examples), rel=1e-9)
        assert is_fraction_of(record["personalized_accuracy"], int(examples.sum()))
    if all("global-accuracy" in row for row in rows):  # no global model: the clients' own models, weighted
        weights = examples if examples.max() <= max_client_share * examples.sum() else None
        if weights is not None:
            expected = np.average([row["global-accuracy"] for row in rows], weights=weights)
            assert record["global_accuracy"] == pytest.approx(expected, rel=1e-9)
        assert all(is_fraction_of(row["global-accuracy"], global_test_size) for row in rows)
    else:
        assert is_fraction_of(record["global_accuracy"], global_test_size), record["global_accuracy"]


def assert_generation_scores_add_up(record: dict[str, Any], max_client_share: float = 0.6) -> None:
    """A causal LM's personalised scores of round ``record`` against its ``per_client`` rows:
    ROUGE-L example-weighted (by the examples each client scored), plain mean and minimum, each a
    finite value in [0, 1]; the loss token-weighted and its perplexity exp(loss). A client that
    evaluated (or generated for) no example counts in none of them."""
    rows = [row for row in record["per_client"].values()
            if "rouge-l" in row and row["num-examples"] > 0 and row.get("rouge-examples", 1.0) > 0]
    assert rows, f"round {record['round']}: no client reported a ROUGE-L"
    rouge = np.array([row["rouge-l"] for row in rows])
    assert all(math.isfinite(value) and 0.0 <= value <= 1.0 for value in rouge), rouge
    scored = np.array([row.get("rouge-examples", row["num-examples"]) for row in rows])
    assert record["personalized_rouge_l_unweighted"] == pytest.approx(rouge.mean(), rel=1e-9)
    assert record["personalized_rouge_l_worst"] == pytest.approx(rouge.min(), rel=1e-9)
    if scored.max() <= max_client_share * scored.sum():
        assert record["personalized_rouge_l"] == pytest.approx(np.average(rouge, weights=scored), rel=1e-9)
    tokens = np.array([row["tokens"] for row in rows])
    loss = np.average([row["loss"] for row in rows], weights=tokens)
    assert math.isfinite(loss) and loss > 0
    assert record["personalized_loss"] == pytest.approx(loss, rel=1e-9)
    assert record["personalized_perplexity"] == pytest.approx(math.exp(loss), rel=1e-9)
    if all("global-rouge-l" in row for row in rows):  # no global model: the clients' own models, weighted
        examples = np.array([row["num-examples"] for row in rows])
        if examples.max() <= max_client_share * examples.sum():
            expected = np.average([row["global-rouge-l"] for row in rows], weights=examples)
            assert record["global_rouge_l"] == pytest.approx(expected, rel=1e-9)
