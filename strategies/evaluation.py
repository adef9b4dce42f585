"""The personalised evaluation's aggregates: what the clients' evaluation replies add up to.

Each sampled client tests its own model on its local split (and, for a method without a global
model, on the global test set); the server combines the valid replies example-weighted (no client
above ``faults.max_client_share``) and unweighted, with the worst client and the 10th percentile:
accuracy for a classifier, ROUGE-L, loss and perplexity for a causal LM. Plain functions that
fill a :class:`~fedlora.results.RoundRecord` and return Flower's round metrics.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import MetricRecord

from fedlora import protocol
from fedlora.results import RoundRecord
from fedlora.strategies.replies import capped_weights


def evaluation_weights(counts: list[float], max_share: float) -> np.ndarray:
    """Evaluation example counts as weights: no client above ``max_share``, and uniform when every
    count is zero (a weighted mean needs a positive total)."""
    weights = capped_weights(counts, max_share)
    return weights if weights.sum() > 0 else np.ones(len(counts))


def token_mean(rows: list[dict[str, float]], key: str, tokens: str) -> float:
    """The token-weighted mean of a per-token loss over clients (nan when no client has tokens)."""
    weights = np.array([r.get(tokens, 0.0) for r in rows], dtype=float)
    if weights.sum() <= 0:
        return math.nan
    return float(np.average([r[key] for r in rows], weights=weights))


def aggregate_accuracy(record: RoundRecord, rows: list[dict[str, float]], max_share: float,
                       global_from_clients: bool) -> MetricRecord | None:
    """A classifier's personalised evaluation: accuracy example-weighted and unweighted, worst,
    p10; validation accuracy weighted by the validation examples; with ``global_from_clients`` (a
    method without a global model) the global-test accuracy of each client's own model. An
    evaluation of no examples counts in none of them (None: no client evaluated an example)."""
    rows = [r for r in rows if r[protocol.NUM_EXAMPLES] > 0]
    if not rows:
        return None
    accuracy = np.array([r[protocol.ACCURACY] for r in rows])
    examples = evaluation_weights([r[protocol.NUM_EXAMPLES] for r in rows], max_share)
    record.personalized_accuracy = float(np.average(accuracy, weights=examples))
    record.personalized_accuracy_unweighted = float(accuracy.mean())
    record.personalized_accuracy_worst = float(accuracy.min())
    record.personalized_accuracy_p10 = float(np.percentile(accuracy, 10))
    validated = [r for r in rows if r.get(protocol.VAL_EXAMPLES, 0.0) > 0]
    if validated and all(protocol.VAL_ACCURACY in r for r in rows):
        val_examples = evaluation_weights([r[protocol.VAL_EXAMPLES] for r in validated], max_share)
        record.validation_accuracy = float(np.average([r[protocol.VAL_ACCURACY] for r in validated],
                                                      weights=val_examples))
    if all(protocol.GLOBAL_ACCURACY in r for r in rows) and global_from_clients:
        record.global_accuracy = float(np.average([r[protocol.GLOBAL_ACCURACY] for r in rows], weights=examples))
    return MetricRecord({protocol.PERSONALIZED_ACCURACY: record.personalized_accuracy})


def aggregate_generation(record: RoundRecord, rows: list[dict[str, float]], max_share: float,
                         global_from_clients: bool) -> MetricRecord | None:
    """A causal LM's personalised evaluation: ROUGE-L example-weighted (by the examples each
    client scored) and unweighted, worst, p10; loss and perplexity token-weighted. An evaluation
    of no examples (none generated) counts in none of them (None: no client generated any)."""
    rows = [r for r in rows if r[protocol.NUM_EXAMPLES] > 0 and r.get(protocol.ROUGE_EXAMPLES, 1.0) > 0]
    if not rows:
        return None
    rouge = np.array([r[protocol.ROUGE_L] for r in rows])
    scored = evaluation_weights([r.get(protocol.ROUGE_EXAMPLES, r[protocol.NUM_EXAMPLES]) for r in rows], max_share)
    record.personalized_rouge_l = float(np.average(rouge, weights=scored))
    record.personalized_rouge_l_unweighted = float(rouge.mean())
    record.personalized_rouge_l_worst = float(rouge.min())
    record.personalized_rouge_l_p10 = float(np.percentile(rouge, 10))
    record.personalized_loss = token_mean(rows, protocol.LOSS, protocol.TOKENS)
    record.personalized_perplexity = math.exp(min(record.personalized_loss, 700.0))
    if all(protocol.VAL_LOSS in r for r in rows):
        record.validation_loss = token_mean(rows, protocol.VAL_LOSS, protocol.VAL_TOKENS)
    if all(protocol.GLOBAL_ROUGE_L in r for r in rows) and global_from_clients:
        examples = evaluation_weights([r[protocol.NUM_EXAMPLES] for r in rows], max_share)
        record.global_rouge_l = float(np.average([r[protocol.GLOBAL_ROUGE_L] for r in rows], weights=examples))
        record.global_loss = float(np.average([r[protocol.GLOBAL_LOSS] for r in rows], weights=examples))
        record.global_perplexity = math.exp(min(record.global_loss, 700.0))
    return MetricRecord({protocol.PERSONALIZED_ROUGE_L: record.personalized_rouge_l})
