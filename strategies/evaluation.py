"""The personalised evaluation's aggregates: what the clients' evaluation replies add up to.

Each sampled client tests its own model on its local split (and, for a method without a global
model, on the global test set); the server combines the valid replies example-weighted and
unweighted, with the worst client and the 10th percentile: accuracy for a classifier, ROUGE-L,
loss and perplexity for a causal LM. Plain functions that fill a
:class:`~fedlora.results.RoundRecord` and return Flower's round metrics.

The counts a client reports weigh at most what its entitlement implies (:class:`CountBounds`, the
weight-share rule of ``fedlora/shares.py``): a client declaring a million test examples weighs as
much as the test split of its partition, so it cannot set the example-weighted figure alone; the
unweighted mean and the worst client are reported beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import MetricRecord

from fedlora import protocol
from fedlora.results import RoundRecord
from fedlora.schema import DataConfig
from fedlora.shares import split_ceiling


@dataclass(frozen=True)
class CountBounds:
    """The most each client's evaluation counts weigh: its test (and ROUGE) and validation example
    counts at most the splits its entitlement implies (:func:`fedlora.shares.split_ceiling`), its
    token counts at most those examples x ``tokens_per_example`` (``train.max_length``)."""

    test: Mapping[int, float]
    val: Mapping[int, float]
    tokens_per_example: float

    @classmethod
    def of(cls, entitled: Mapping[int, float], data: DataConfig, tokens_per_example: float) -> CountBounds:
        """The bounds of clients entitled to ``entitled`` training examples under ``data``'s splits."""
        train = 1.0 - data.test_fraction - data.val_fraction
        return cls({p: split_ceiling(e, data.test_fraction, train) for p, e in entitled.items()},
                   {p: split_ceiling(e, data.val_fraction, train) for p, e in entitled.items()}, tokens_per_example)

    def weights(self, rows: Sequence[Mapping[str, float]], key: str, split: str = "test", tokens: bool = False) -> np.ndarray:
        """``rows``' ``key`` counts, each cut to its client's bound (``split``: 'test' or 'val';
        ``tokens``: a token count), uniform when they are all zero (a mean needs a positive total)."""
        ceilings = self.val if split == "val" else self.test
        per = self.tokens_per_example if tokens else 1.0
        counts = np.array([min(float(r.get(key, 0.0)), ceilings.get(int(r[protocol.PARTITION_ID]), math.inf) * per)
                           for r in rows])
        return counts if counts.sum() > 0 else np.ones(len(rows))


def token_mean(rows: list[dict[str, float]], key: str, tokens: str, bounds: CountBounds | None = None,
               split: str = "test") -> float:
    """The token-weighted mean of a per-token loss over clients (nan when no client has tokens),
    each client's tokens within ``bounds``."""
    weights = np.array([r.get(tokens, 0.0) for r in rows], dtype=float)
    if weights.sum() <= 0:
        return math.nan
    if bounds is not None:
        weights = bounds.weights(rows, tokens, split, tokens=True)
    return float(np.average([r[key] for r in rows], weights=weights))


def aggregate_accuracy(record: RoundRecord, rows: list[dict[str, float]], bounds: CountBounds,
                       global_from_clients: bool) -> MetricRecord | None:
    """A classifier's personalised evaluation: accuracy example-weighted and unweighted, worst,
    p10; validation accuracy weighted by the validation examples; with ``global_from_clients`` (a
    method without a global model) the global-test accuracy of each client's own model. An
    evaluation of no examples counts in none of them (None: no client evaluated an example)."""
    rows = [r for r in rows if r[protocol.NUM_EXAMPLES] > 0]
    if not rows:
        return None
    accuracy = np.array([r[protocol.ACCURACY] for r in rows])
    examples = bounds.weights(rows, protocol.NUM_EXAMPLES)
    record.personalized_accuracy = float(np.average(accuracy, weights=examples))
    record.personalized_accuracy_unweighted = float(accuracy.mean())
    record.personalized_accuracy_worst = float(accuracy.min())
    record.personalized_accuracy_p10 = float(np.percentile(accuracy, 10))
    validated = [r for r in rows if r.get(protocol.VAL_EXAMPLES, 0.0) > 0]
    if validated and all(protocol.VAL_ACCURACY in r for r in rows):
        val_examples = bounds.weights(validated, protocol.VAL_EXAMPLES, "val")
        record.validation_accuracy = float(np.average([r[protocol.VAL_ACCURACY] for r in validated],
                                                      weights=val_examples))
    if all(protocol.GLOBAL_ACCURACY in r for r in rows) and global_from_clients:
        record.global_accuracy = float(np.average([r[protocol.GLOBAL_ACCURACY] for r in rows], weights=examples))
    return MetricRecord({protocol.PERSONALIZED_ACCURACY: record.personalized_accuracy})


def aggregate_generation(record: RoundRecord, rows: list[dict[str, float]], bounds: CountBounds,
                         global_from_clients: bool) -> MetricRecord | None:
    """A causal LM's personalised evaluation: ROUGE-L example-weighted (by the examples each
    client scored) and unweighted, worst, p10; loss and perplexity token-weighted. An evaluation
    of no examples (none generated) counts in none of them (None: no client generated any)."""
    rows = [r for r in rows if r[protocol.NUM_EXAMPLES] > 0 and r.get(protocol.ROUGE_EXAMPLES, 1.0) > 0]
    if not rows:
        return None
    rouge = np.array([r[protocol.ROUGE_L] for r in rows])
    scored = bounds.weights([{**r, protocol.ROUGE_EXAMPLES: r.get(protocol.ROUGE_EXAMPLES, r[protocol.NUM_EXAMPLES])}
                             for r in rows], protocol.ROUGE_EXAMPLES)
    record.personalized_rouge_l = float(np.average(rouge, weights=scored))
    record.personalized_rouge_l_unweighted = float(rouge.mean())
    record.personalized_rouge_l_worst = float(rouge.min())
    record.personalized_rouge_l_p10 = float(np.percentile(rouge, 10))
    record.personalized_loss = token_mean(rows, protocol.LOSS, protocol.TOKENS, bounds)
    record.personalized_perplexity = math.exp(min(record.personalized_loss, 700.0))
    if all(protocol.VAL_LOSS in r for r in rows):
        record.validation_loss = token_mean(rows, protocol.VAL_LOSS, protocol.VAL_TOKENS, bounds, "val")
    if all(protocol.GLOBAL_ROUGE_L in r for r in rows) and global_from_clients:
        examples = bounds.weights(rows, protocol.NUM_EXAMPLES)
        record.global_rouge_l = float(np.average([r[protocol.GLOBAL_ROUGE_L] for r in rows], weights=examples))
        record.global_loss = float(np.average([r[protocol.GLOBAL_LOSS] for r in rows], weights=examples))
        record.global_perplexity = math.exp(min(record.global_loss, 700.0))
    return MetricRecord({protocol.PERSONALIZED_ROUGE_L: record.personalized_rouge_l})
